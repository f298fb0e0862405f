"""The generation engine: live conversations on a paged KV cache.

A conversation (a *slot*, the handle `open` returns) keeps its pages across turns: between
turns its new tokens (a user or tool turn) are *appended*, never re-prefilled. Each
conversation queues the tokens not yet in the cache. The last queued token is always fed by
the decode loop (it produces the logits of the first new token), everything before it by a
chunked extend. After a generation the last sampled token stays queued, so the cache always
holds exactly the conversation minus its final token.

Pages (pages.py): one pool of `kv_cache_tokens` tokens in pages of `page_size`. A
conversation takes pages as it grows and gives them back when released. When a running
conversation cannot grow, pages are taken from others (preemption): first from
conversations waiting on a user or tool (the newest first), then from unused shared
prefixes, then from running conversations opened after it. A preempted conversation keeps
its tokens and is extended again when it next runs; one that cannot get pages waits. So a
pool smaller than `num_slots * max_len` only costs recomputation, never a conversation.

Continuous batching: `step()` extends what waits, packed (tiles of `extend_tile` tokens
from every waiting conversation, batching.py), and runs one chunk of decode steps over
every generating conversation, rows bucketed per shard; conversations waiting on a user or
a tool cost nothing but their pages. `deterministic`: every token-wise computation runs in
fixed tiles (muajax/models/token_tiles.py), so a conversation's numbers do not depend on
which others share its calls, and only live tiles are computed. `batch_rows` (the older
way to the same end): every call has that many rows per shard, each conversation extended
at its own width; padded slots are computed.

Shared prefixes: `register_prefix(tokens)` (e.g. the system prompt). The first conversation
that starts with it gets the prefix computed once, for the current params, into pages that
every conversation starting with it then shares (full pages only, reference counted).
Assigning new `params` invalidates the computed copies.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from muajax import parallel
from muajax.engine import batching, kv_cache

# re-exported: callers import them from here (see muajax/engine/__init__.py)
from muajax.engine.experts import ExpertLog
from muajax.engine.generation import FINISH_REASONS, Generation, SamplingParams  # noqa: F401
from muajax.engine.layer_views import layer_views
from muajax.engine.paged_attention import DEFAULT_BLOCKS, KernelBlocks
from muajax.engine.pages import PagedSeq, PagePool, PageTables, SharedPrefix
from muajax.engine.precompile import warm_programs
from muajax.engine.prefixes import SharedPrefixes
from muajax.engine.programs import Programs, build_spec
from muajax.models.qwen3 import Qwen3Config
from muajax.models.tokenizer import IM_END_ID


@dataclasses.dataclass(eq=False)
class _Slot:
    seed: int
    seq: PagedSeq
    sampling: SamplingParams | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)


class Engine(SharedPrefixes):
    """The arguments are listed in muajax/engine/__init__.py. `record_experts` (a mixture of
    experts): keep every computed token's chosen experts, read with `experts(slot)`."""

    def __init__(self, params, cfg: Qwen3Config, *, num_slots: int, max_len: int, mesh=None,
                 stop_ids: Iterable[int] = (IM_END_ID,), decode_chunk: int = 32,
                 extend_widths: Sequence[int] = (32, 128, 512, 2048), min_batch_bucket: int = 1,
                 kv_cache_tokens: int | None = None, page_size: int | None = None, max_extend_tokens: int = 8192,
                 attention: str = "auto", kernel_blocks: KernelBlocks = DEFAULT_BLOCKS, batch_rows: int | None = None,
                 extend_tile: int | None = None, deterministic: bool = False, decode_tile: int | None = None,
                 record_experts: bool = False):
        if num_slots < 1 or max_len < 2 or decode_chunk < 1 or not extend_widths or min(extend_widths) < 1:
            raise ValueError(f"need num_slots >= 1, max_len >= 2, decode_chunk >= 1 and extend widths >= 1, got "
                             f"{num_slots}, {max_len}, {decode_chunk}, {tuple(extend_widths)}")
        if (batch_rows is not None and batch_rows < 1) or min(extend_tile or 1, decode_tile or 1) < 1:
            raise ValueError(f"batch_rows (or None), extend_tile and decode_tile must be >= 1, got {batch_rows}, "
                             f"{extend_tile}, {decode_tile}")
        if deterministic and batch_rows is not None:
            raise ValueError("deterministic (token tiles) and batch_rows (fixed rows) are two ways to the same end: "
                             "choose one")
        self.params = params  # read directly: assign new params after an update, nothing is copied
        self.cfg, self.num_slots, self.max_len, self.mesh = cfg, num_slots, max_len, mesh
        self.stop_ids = np.asarray(sorted(set(stop_ids)), np.int32)
        self.decode_chunk, self.max_extend_tokens = decode_chunk, max_extend_tokens
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        shards = 1 if mesh is None else parallel.batch_divisor(mesh)
        tiles = batching.default_tiles(platform, num_slots, shards)
        extend_tile, decode_tile = extend_tile or tiles[0], decode_tile or tiles[1]
        self.spec = build_spec(cfg, mesh, num_slots=num_slots, max_len=max_len, kv_cache_tokens=kv_cache_tokens,
                               page_size=page_size, decode_chunk=decode_chunk, attention=attention,
                               blocks=kernel_blocks, tiled=deterministic, decode_tile=decode_tile,
                               record_experts=record_experts)
        self.attention, self.page_size, pool = self.spec.attention, self.spec.pool.page_size, self.spec.pool
        self.extend_widths = tuple(sorted({min(w, max_len) for w in extend_widths}))
        self.batch_rows, self.extend_tile, self.deterministic = batch_rows, extend_tile, deterministic
        self.batch_buckets = batching.decode_buckets(num_slots, min_batch_bucket, batch_rows,
                                                     decode_tile if deterministic else None)
        # packed extends: rows (tiles) per shard per call
        least = batching.MIN_TILES if deterministic else 1
        self.extend_buckets = batching.buckets(max(least, max_extend_tokens // extend_tile), least)
        self.pool = kv_cache.allocate(pool)
        self.pages = PageTables(PagePool(pool.num_shards, pool.pages_per_shard), self.page_size, pool.max_pages)
        self._programs = Programs(self.spec)
        self._experts = ExpertLog(cfg, max_len) if record_experts else None
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._stop_ids = jax.device_put(self.stop_ids, replicated)
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(num_slots))
        self._priority = itertools.count()
        self._prefixes: list[SharedPrefix] = []
        self._prefix_params: list[weakref.ref] = []
        # *_tokens: real tokens written or sampled; *_positions: token slots the layers computed
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "extend_tokens": 0, "device_s": 0.0, "decode_calls": 0,
                      "extend_calls": 0, "extend_positions": 0, "decode_positions": 0, "preemptions": 0,
                      "prefix_hits": 0, "prefix_prefill_tokens": 0, "peak_pages": 0}

    @property
    def record_experts(self) -> bool:
        return self._experts is not None

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
        self._slots[slot] = _Slot(seed=seed, seq=PagedSeq(priority=next(self._priority)))
        self.append(slot, tokens)
        return slot

    def append(self, slot: int, tokens: Sequence[int]) -> None:
        """Queue a new turn's tokens (user message, tool response, generation prompt)."""
        state = self._get(slot)
        if state.sampling is not None:
            raise RuntimeError(f"slot {slot} is generating; append after its generation finishes")
        if self.length(slot) + len(tokens) > self.max_len:
            raise ValueError(f"slot {slot}: {self.length(slot) + len(tokens)} tokens exceed max_len={self.max_len}")
        state.seq.queued.extend(int(t) for t in tokens)

    def release(self, slot: int) -> None:
        self.pages.drop(self._get(slot).seq)
        del self._slots[slot]
        self._free.append(slot)
        self._free.sort()

    def length(self, slot: int) -> int:
        """Tokens of the conversation so far (in the cache plus queued)."""
        seq = self._get(slot).seq
        return seq.length + len(seq.queued)

    def is_generating(self, slot: int) -> bool:
        return self._get(slot).sampling is not None

    def sampled(self, slot: int) -> list[int]:
        """Tokens the slot's current (or last) generation has sampled so far (for streaming)."""
        return list(self._get(slot).tokens)

    def cached_kv(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values [layers, kv_heads, tokens, head_dim] in the slot's pages (tests, debugging)."""
        seq = self._get(slot).seq
        if not seq.pages:
            shape = (self.cfg.num_layers, self.cfg.num_kv_heads, 0, self.cfg.head_dim)
            return np.zeros(shape), np.zeros(shape)
        return kv_cache.read_tokens(self.pool, self.spec.pool, seq.shard, seq.pages, seq.length)

    def experts(self, slot: int) -> np.ndarray:
        """The chosen experts [tokens, L, k] of each token in the slot's cache (engine/experts.py):
        all of the conversation but its queued tokens (after a generation, its newest token)."""
        if self._experts is None:
            raise RuntimeError("this engine does not record experts: Engine(..., record_experts=True)")
        seq = self._get(slot).seq
        return self._experts.read(seq, seq.length)

    def _get(self, slot: int) -> _Slot:
        if slot not in self._slots:
            raise KeyError(f"slot {slot} is not open")
        return self._slots[slot]

    # ------------------------------------------------------------------ pages
    def _victims(self, seq: PagedSeq, idle_any: bool) -> list[PagedSeq]:
        """Who gives up pages for `seq`, in order: conversations waiting on a user or a tool
        (all of them if `idle_any`, else only those opened after `seq`), newest first; then
        shared-prefix copies; then generating conversations opened after `seq`, newest first."""
        newest_first = sorted(self._slots.values(), key=lambda s: -s.seq.priority)
        idle = [s.seq for s in newest_first if s.sampling is None and (idle_any or s.seq.priority > seq.priority)]
        copies = [c for p in self._prefixes for c in p.copies.values() if c.shard == seq.shard]
        running = [s.seq for s in newest_first if s.sampling is not None and s.seq.priority > seq.priority]
        return idle + copies + running

    def _room(self, seq: PagedSeq, tokens: int, idle_any: bool) -> bool:
        """Make the sequence hold `tokens` tokens, preempting others if it must."""
        if seq.shard is None:
            self._place(seq)
        ok = self.pages.grow(seq, tokens)
        if not ok:
            for victim in self.pages.preempt_for(seq, tokens, self._victims(seq, idle_any)):
                for prefix in self._prefixes:  # a dropped copy is no longer computed
                    prefix.copies = {s: c for s, c in prefix.copies.items() if c is not victim}
            ok = self.pages.grow(seq, tokens)
        self.stats["preemptions"] = self.pages.preemptions
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.pages.pool.in_use)
        return ok

    # ------------------------------------------------------------------ generation
    def start(self, slot: int, sampling: SamplingParams) -> None:
        state = self._get(slot)
        if not state.seq.queued:
            raise RuntimeError(f"slot {slot}: nothing to generate from (append a generation prompt first)")
        if self.length(slot) >= self.max_len:
            raise ValueError(f"slot {slot}: the context ({self.max_len} tokens) is full")
        state.sampling = sampling
        state.tokens, state.logprobs = [], []

    def step(self) -> list[Generation]:
        """Give pages to the generating conversations (oldest first), extend what must be
        extended, run one decode chunk; return the generations that finished."""
        running = sorted((s for s in self._slots.values() if s.sampling is not None), key=lambda s: s.seq.priority)
        ready = []
        for state in running:
            seq = state.seq
            cached = seq.length + len(seq.queued) - 1  # after the extend; the last token is fed by decode
            allowance = min(self.decode_chunk, state.sampling.max_new_tokens - len(state.tokens), self.max_len - cached)
            if self._room(seq, cached + allowance, idle_any=True) or self._room(seq, cached + 1, idle_any=True):
                ready.append((state, min(allowance, len(seq.pages) * self.page_size - cached)))
        ready = [(state, limit) for state, limit in ready if state.seq.pages]  # not preempted since
        if not ready:
            return []
        self._extend([state.seq for state, _ in ready], keep_last=True)
        return self._decode(ready)

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
        """Write queued tokens into the cache (all of them, or all but the last). A conversation
        that cannot get pages without preempting older ones keeps its tokens queued."""
        states = sorted((self._get(s) for s in (self._slots if slots is None else slots)), key=lambda s: s.seq.priority)
        seqs = []
        for state in states:
            seq = state.seq
            count = len(seq.queued) - (1 if keep_last else 0)
            if count > 0 and self._room(seq, seq.length + count, idle_any=False):
                seqs.append(seq)
        self._extend([seq for seq in seqs if seq.pages], keep_last)

    def _extend(self, seqs: Sequence[PagedSeq], keep_last: bool) -> None:
        pool, tables = self.spec.pool, self.pages
        if self.batch_rows is None:
            batches = batching.packed_extend_batches(seqs, keep_last, pool, self.extend_tile, self.extend_buckets,
                                                     self.max_extend_tokens, tables)
        else:
            batches = batching.extend_batches(seqs, keep_last, pool, self.extend_widths, self.batch_buckets,
                                              self.max_extend_tokens, tables, fixed_rows=True)
        for batch in batches:
            self.stats["extend_tokens"] += int(batch.num_new.sum())
            self.stats["extend_calls"] += 1
            # with token tiles the live rows alone run the layers; else every padded slot does
            rows = batch.live_rows * pool.num_shards if self.deterministic else batch.tokens.shape[0]
            self.stats["extend_positions"] += rows * batch.tokens.shape[1]
            args = (batch.page_table, batch.lengths, batch.tokens, batch.num_new)
            experts = self._run(self._programs.extend, args, live=batch.live_rows)
            if experts is not None:
                self._experts.record_extend(batch.seqs, batch.lengths, batch.num_new, np.asarray(experts))

    def _decode(self, ready: list[tuple[_Slot, int]]) -> list[Generation]:
        """One decode chunk over `ready`, in as many calls as the batch size allows."""
        shard_of = lambda item: item[0].seq.shard  # noqa: E731
        return [gen for part in batching.rounds(ready, shard_of, self.spec.pool.num_shards, self.batch_buckets[-1])
                for gen in self._decode_call(part)]

    def _decode_call(self, ready: list[tuple[_Slot, int]]) -> list[Generation]:
        rows = batching.decode_rows(ready, self.spec.pool, self.batch_buckets, self.pages)
        # fixed rows gather every row's whole max_len: a bucket that followed the longest row
        # would change a row's softmax (its reduction's length) with what shares its call
        dense = self.spec.pool.max_pages if self.batch_rows else rows.dense_pages
        out = self._run(self._programs.decode, rows.arrays, dense_pages=dense)
        tokens, logprobs, counts, reasons, computed, *experts = (np.asarray(x) for x in jax.device_get(out))
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += int(counts.max())
        self.stats["decode_positions"] += int(computed)
        finished = []
        slot_of = {id(state): slot for slot, state in self._slots.items()}
        for i, state in enumerate(rows.order):
            if state is None:
                continue
            seq, k = state.seq, int(counts[i])
            if experts:
                self._experts.record_decode(seq, seq.length, k, experts[0][i])
            if k:  # the fed token and every sampled token but the newest went into the cache
                seq.cached.append(seq.queued[-1])
                seq.cached.extend(int(t) for t in tokens[i, : k - 1])
                seq.queued = [int(tokens[i, k - 1])]
            state.tokens.extend(int(t) for t in tokens[i, :k])
            state.logprobs.extend(float(x) for x in logprobs[i, :k])
            self.stats["decode_tokens"] += k
            if reasons[i]:
                slot = slot_of[id(state)]
                finished.append(Generation(slot, state.tokens, state.logprobs, FINISH_REASONS[int(reasons[i])]))
                state.sampling = None
        return finished

    # ------------------------------------------------------------------ memory and compilation
    def release_memory(self) -> None:
        """Free the page pool (e.g. around a train step); it is allocated again on next use.
        No conversation may be open: their pages would be lost."""
        if self._slots:
            raise RuntimeError(f"{len(self._slots)} conversation(s) are open: release them before the pool")
        self._drop_prefix_copies()
        if self.pool is not None:
            self.pool.delete()
            self.pool = None

    def warmup(self, max_tokens: int | None = None) -> int:
        """Compile every program a conversation of up to `max_tokens` (default max_len) tokens
        can need: decode per batch bucket, extend per width and row count, and on the pure-JAX
        path each of those per gather length. Runs them on rows with nothing to do (the pool is
        unchanged); returns the number of programs. The engine must be idle."""
        return warm_programs(self, max_tokens)

    def _run(self, program, row_arrays: tuple, live: int | None = None, dense_pages: int | None = None):
        """Run a program on host per-row arrays (`live`: an extend's live rows per shard;
        `dense_pages`: a decode's gather bucket, for the pure-JAX decode only)."""
        start = time.perf_counter()
        if self.pool is None:
            self.pool = kv_cache.allocate(self.spec.pool)
        args = batching.to_device(row_arrays, self.spec.pool)
        if program is self._programs.decode:
            dense_pages = dense_pages if self.spec.dense_decode else None
            self.pool, out = program(self.params, self.pool, self._layer_views(), *args, self._stop_ids,
                                     dense_pages=dense_pages)
        else:  # an extend returns the pool, or (pool, experts) when recording them
            result = program(self.params, self.pool, *args, np.int32(live))
            self.pool, out = result if self._experts is not None else (result, None)
        jax.block_until_ready(self.pool)
        self.stats["device_s"] += time.perf_counter() - start
        return out

    def _layer_views(self) -> list | None:
        """Per-layer weight views for the dense CPU decode (layer_views.py), or None."""
        if self.mesh is not None or not self.spec.dense_decode:
            return None
        return layer_views(self.params, self.cfg)
