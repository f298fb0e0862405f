"""The generation engine: live conversations held on device, one KV-cache slot each.

Between turns a conversation's new tokens (a user or tool turn) are *appended* to its
slot; nothing is ever re-prefilled. Each slot keeps a queue of tokens not yet in its
cache. The last queued token is always fed by the decode loop (it produces the logits
of the first new token), everything before it by a batched, bucketed extend. After a
generation the last sampled token stays queued, so the cache always holds exactly the
conversation minus its final token.

Continuous batching: `step()` runs one chunk of decode steps over every slot that is
generating, on a compact batch of just those rows (bucketed to a power of two); slots
that wait on a user or a tool cost nothing, finished rows leave the batch at the next
chunk and new conversations join it there.

Compilations: one decode program per batch bucket (powers of two up to `num_slots`) and
one extend program per (batch bucket, width bucket) pair actually used.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from muajax.engine import kv_cache
from muajax.engine.sampling import sample_tokens
from muajax.models.qwen3 import KVCache, Qwen3Config, forward
from muajax.models.tokenizer import IM_END_ID

FINISH_REASONS = ("running", "stop", "length", "context")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"top_k must be >= 0 and max_new_tokens >= 1, got {self.top_k}, {self.max_new_tokens}")


@dataclasses.dataclass
class Generation:
    """A finished generation: sampled ids, their logprobs, and why it stopped
    ('stop' = a stop token, 'length' = max_new_tokens, 'context' = the slot is full)."""

    slot: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclasses.dataclass
class _Slot:
    seed: int
    queued: list[int] = dataclasses.field(default_factory=list)
    length: int = 0  # tokens in the cache (host mirror of cache.lengths)
    sampling: SamplingParams | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


class Engine:
    def __init__(self, params, cfg: Qwen3Config, *, num_slots: int, max_len: int, mesh=None,
                 stop_ids: Iterable[int] = (IM_END_ID,), decode_chunk: int = 32,
                 extend_widths: Sequence[int] = (32, 128, 512, 2048), min_batch_bucket: int = 1):
        if num_slots < 1 or max_len < 2:
            raise ValueError(f"need num_slots >= 1 and max_len >= 2, got {num_slots}, {max_len}")
        self.params = params  # read directly: assign new params after an update, nothing is copied
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_len = max_len
        self.mesh = mesh
        self.stop_ids = np.asarray(sorted(set(stop_ids)), np.int32)
        self.decode_chunk = decode_chunk
        self.extend_widths = tuple(w for w in extend_widths if w < max_len) + (max_len,)
        # Batches are padded to a power of two (at least min_batch_bucket): each bucket is one
        # compilation; a larger minimum trades a little padded work for fewer compilations.
        self.batch_buckets = tuple(sorted({min(max(2**i, min_batch_bucket), num_slots)
                                           for i in range(num_slots.bit_length() + 1)}))
        self._shardings = None if mesh is None else kv_cache.cache_shardings(cfg, num_slots, max_len, mesh)
        self.cache: KVCache = kv_cache.allocate(cfg, num_slots, max_len, mesh)
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(num_slots))
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "extend_tokens": 0, "device_s": 0.0,
                      "decode_calls": 0, "extend_calls": 0}
        self._decode_fn = jax.jit(functools.partial(_decode_chunk, cfg, self.decode_chunk, self._shardings),
                                  donate_argnums=(1,))
        self._extend_fn = jax.jit(functools.partial(_extend, cfg, self._shardings), donate_argnums=(1,))
        self._reset_fn = jax.jit(_reset_lengths, donate_argnums=(0,))

    # ------------------------------------------------------------------ slots
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def open(self, tokens: Sequence[int], *, seed: int = 0) -> int:
        """Take a free slot for a new conversation starting with `tokens`. `seed` fixes its samples."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} slots are in use: release one first")
        if len(tokens) == 0:
            raise ValueError("a conversation needs at least one token")
        slot = self._free.pop(0)
        self._slots[slot] = _Slot(seed=seed)
        self._run(self._reset_fn, jnp.asarray([slot], jnp.int32))
        self.append(slot, tokens)
        return slot

    def append(self, slot: int, tokens: Sequence[int]) -> None:
        """Queue a new turn's tokens (user message, tool response, generation prompt)."""
        state = self._get(slot)
        if state.sampling is not None:
            raise RuntimeError(f"slot {slot} is generating; append after its generation finishes")
        if state.length + len(state.queued) + len(tokens) > self.max_len:
            raise ValueError(f"slot {slot}: {state.length + len(state.queued) + len(tokens)} tokens exceed max_len={self.max_len}")
        state.queued.extend(int(t) for t in tokens)

    def release(self, slot: int) -> None:
        self._get(slot)
        del self._slots[slot]
        self._free.append(slot)
        self._free.sort()

    def length(self, slot: int) -> int:
        """Tokens of the conversation so far (in the cache plus queued)."""
        state = self._get(slot)
        return state.length + len(state.queued)

    def is_generating(self, slot: int) -> bool:
        return self._get(slot).sampling is not None

    def sampled(self, slot: int) -> list[int]:
        """Tokens the slot's current (or last) generation has sampled so far (for streaming)."""
        return list(self._get(slot).tokens)

    def _get(self, slot: int) -> _Slot:
        if slot not in self._slots:
            raise KeyError(f"slot {slot} is not open")
        return self._slots[slot]

    # ------------------------------------------------------------------ generation
    def start(self, slot: int, sampling: SamplingParams) -> None:
        state = self._get(slot)
        if not state.queued:
            raise RuntimeError(f"slot {slot}: nothing to generate from (append a generation prompt first)")
        if state.length + len(state.queued) >= self.max_len:
            raise ValueError(f"slot {slot}: the context ({self.max_len} tokens) is full")
        state.sampling = sampling
        state.tokens, state.logprobs = [], []

    def step(self) -> list[Generation]:
        """Extend what must be extended, run one decode chunk; return the generations that finished."""
        running = sorted(s for s, st in self._slots.items() if st.sampling is not None)
        if not running:
            return []
        self.flush(running, keep_last=True)
        return self._decode(running)

    def generate(self, slots: Sequence[int], sampling: SamplingParams | Sequence[SamplingParams]) -> dict[int, Generation]:
        """Start `slots` and step until all of them finish (other running slots advance too)."""
        samplings = [sampling] * len(slots) if isinstance(sampling, SamplingParams) else list(sampling)
        for slot, sp in zip(slots, samplings):
            self.start(slot, sp)
        done: dict[int, Generation] = {}
        wanted = set(slots)
        while wanted - set(done):
            for gen in self.step():
                done[gen.slot] = gen
        return {s: done[s] for s in slots}

    def flush(self, slots: Iterable[int] | None = None, *, keep_last: bool = False) -> None:
        """Write queued tokens into the cache (all of them, or all but the last)."""
        slots = sorted(self._slots if slots is None else slots)
        todo = {}
        for slot in slots:
            state = self._slots[slot]
            count = len(state.queued) - (1 if keep_last else 0)
            if count > 0:
                todo[slot] = count
        while todo:
            width = _bucket(max(todo.values()), self.extend_widths)
            group = sorted(todo)[: self.num_slots]
            rows = self._rows(group)
            tokens = np.zeros((len(rows), width), np.int32)
            num_new = np.zeros((len(rows),), np.int32)
            for i, slot in enumerate(group):
                state = self._slots[slot]
                n = min(todo[slot], width)
                tokens[i, :n] = state.queued[:n]
                num_new[i] = n
                del state.queued[:n]
                state.length += n
                todo[slot] -= n
                if todo[slot] == 0:
                    del todo[slot]
            self.stats["extend_tokens"] += int(num_new.sum())
            self.stats["extend_calls"] += 1
            self._run(self._extend_fn, jnp.asarray(rows), jnp.asarray(tokens), jnp.asarray(num_new))

    def _rows(self, slots: Sequence[int]) -> np.ndarray:
        size = _bucket(len(slots), self.batch_buckets)
        rows = np.full((size,), self.num_slots, np.int32)  # padding row: reads clamp, writes drop
        rows[: len(slots)] = slots
        return rows

    def _run(self, fn, *args):
        start = time.perf_counter()
        if fn is self._reset_fn:
            self.cache = fn(self.cache, *args)
            out = None
        else:
            self.cache, out = fn(self.params, self.cache, *args)
        jax.block_until_ready(self.cache.lengths)
        self.stats["device_s"] += time.perf_counter() - start
        return out

    def _layer_views(self) -> list | None:
        """Each layer's weights as its own array, aliasing `self.params` (no copy), or None.

        XLA on CPU copies a slice of a stacked weight before a dot can read it: every
        decode step would copy all the layer weights. On a single CPU device a numpy view
        of one layer, put on the device, shares the parameter's memory instead. Made per
        call and dropped after it: a live view would stop a train step from donating the
        params. Elsewhere (a mesh, an accelerator) the decode step scans the stacked layers."""
        leaves, treedef = jax.tree.flatten(self.params["layers"])
        if self.mesh is not None or not all(isinstance(x, jax.Array) and len(x.devices()) == 1
                                            and next(iter(x.devices())).platform == "cpu" for x in leaves):
            return None
        hosts, layers = [np.asarray(x) for x in leaves], self.cfg.num_layers
        # one device_put for all the views: per-array calls cost ~2x as much host time
        flat = jax.device_put([h[i] for i in range(layers) for h in hosts], next(iter(leaves[0].devices())))
        return [treedef.unflatten(flat[i * len(hosts):(i + 1) * len(hosts)]) for i in range(layers)]

    def _decode(self, running: list[int]) -> list[Generation]:
        rows = self._rows(running)
        n = len(rows)
        last = np.zeros((n,), np.int32)
        seeds = np.zeros((n,), np.uint32)
        temperature = np.ones((n,), np.float32)
        top_p = np.ones((n,), np.float32)
        top_k = np.zeros((n,), np.int32)
        budget = np.zeros((n,), np.int32)
        for i, slot in enumerate(running):
            state = self._slots[slot]
            sp = state.sampling
            last[i] = state.queued[-1]
            seeds[i] = state.seed
            temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, sp.top_k
            budget[i] = sp.max_new_tokens - len(state.tokens)
        host_args = (rows, last, seeds, temperature, top_p, top_k, budget, self.stop_ids)
        out = self._run(self._decode_fn, self._layer_views(), *(jnp.asarray(a) for a in host_args))
        tokens, logprobs, counts, reasons = (np.asarray(x) for x in jax.device_get(out))
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += int(counts.max())
        finished = []
        for i, slot in enumerate(running):
            state = self._slots[slot]
            k = int(counts[i])
            if k:
                state.length += 1  # the fed token went into the cache
                state.length += k - 1  # so did every sampled token but the newest
                state.queued = [int(tokens[i, k - 1])]
            state.tokens.extend(int(t) for t in tokens[i, :k])
            state.logprobs.extend(float(x) for x in logprobs[i, :k])
            self.stats["decode_tokens"] += k
            if reasons[i]:
                finished.append(Generation(slot, state.tokens, state.logprobs, FINISH_REASONS[int(reasons[i])]))
                state.sampling = None
        return finished


# ---------------------------------------------------------------------- device programs


def _reset_lengths(cache: KVCache, rows):
    return cache._replace(lengths=cache.lengths.at[rows].set(0, mode="drop"))


def _extend(cfg, shardings, params, cache, rows, tokens, num_new):
    sub = kv_cache.take_rows(cache, rows)
    # only the cache is wanted: returning the hidden state lets XLA drop the LM head
    _, sub = forward(params, cfg, tokens, cache=sub, num_new=num_new, return_hidden=True)
    return kv_cache.constrain(kv_cache.put_rows(cache, rows, sub), shardings), None


def _decode_chunk(cfg, steps, shardings, params, cache, layer_params, rows, last, seeds, temperature, top_p, top_k,
                  budget, stop_ids):
    """Up to `steps` decode steps for the rows; stops early once every row is done.

    With `layer_params` (per-layer weight buffers, see `Engine._layer_views`) the rows'
    cache is also taken per layer and the layers run unrolled, so a step slices nothing
    out of a stacked array (see `forward`). Without, the layer scan over the stacked
    params and cache, which accelerators read in place."""
    per_layer = layer_params is not None
    sub = (kv_cache.take_layer_rows if per_layer else kv_cache.take_rows)(cache, rows)
    batch = rows.shape[0]
    max_len = cache.max_len
    keys = jax.vmap(jax.random.key)(seeds)
    active = (rows < cache.lengths.shape[0]) & (budget > 0) & (sub.lengths < max_len)
    out_tokens = jnp.zeros((batch, steps), jnp.int32)
    out_logprobs = jnp.zeros((batch, steps), jnp.float32)
    counts = jnp.zeros((batch,), jnp.int32)
    # a row that cannot even write its fed token has run out of context
    reasons = jnp.where((rows < cache.lengths.shape[0]) & (sub.lengths >= max_len), 3, 0).astype(jnp.int32)

    def cond(carry):
        step, _, active, *_ = carry
        return (step < steps) & jnp.any(active)

    def body(carry):
        step, sub, active, last, out_tokens, out_logprobs, counts, reasons = carry
        logits, sub = forward(params, cfg, last[:, None], cache=sub, num_new=active.astype(jnp.int32),
                              logits_index=jnp.zeros((batch, 1), jnp.int32), layer_params=layer_params)
        # a conversation's key depends only on its seed and the position being sampled
        step_keys = jax.vmap(jax.random.fold_in)(keys, sub.lengths)
        token, logprob = sample_tokens(logits[:, 0], step_keys, temperature, top_p, top_k)
        out_tokens = out_tokens.at[:, step].set(jnp.where(active, token, 0))
        out_logprobs = out_logprobs.at[:, step].set(jnp.where(active, logprob, 0.0))
        counts = counts + active
        hit_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        reason = jnp.where(hit_stop, 1, jnp.where(counts >= budget, 2, jnp.where(sub.lengths >= max_len, 3, 0)))
        reasons = jnp.where(active, reason, reasons)
        last = jnp.where(active, token, last)
        return step + 1, sub, active & (reason == 0), last, out_tokens, out_logprobs, counts, reasons

    carry = (jnp.int32(0), sub, active, last, out_tokens, out_logprobs, counts, reasons)
    _, sub, _, _, out_tokens, out_logprobs, counts, reasons = jax.lax.while_loop(cond, body, carry)
    cache = kv_cache.constrain((kv_cache.put_layer_rows if per_layer else kv_cache.put_rows)(cache, rows, sub),
                               shardings)
    return cache, (out_tokens, out_logprobs, counts, reasons)
