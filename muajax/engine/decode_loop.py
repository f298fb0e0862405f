"""The engine's decode loop on device: up to `decode_chunk` sample steps of every row in one
program, stopping early once every row is done (`decode_loop`), and the live-tile count of
token-tiled calls (`live_tiles`). Every decode program of programs.py runs its own step
function (dense, paged or Pallas attention) inside it.

With `experts`, the loop also keeps each step's chosen experts of a mixture of experts: the
step then returns them beside its logits and cache ([R, L, k], the experts of the token it
fed, per layer), and the loop returns them per row and step ([R, steps, L, k], zero where
the row did not run).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from muajax.engine.sampling import sample_tokens
from muajax.models.token_tiles import TokenTiles, map_tiles


def live_tiles(active, shards: int, tile: int):
    """Tiles per shard up to the last active row of the fullest shard (rows by shard)."""
    per_shard = active.reshape(shards, -1)
    last = jnp.max(jnp.where(per_shard, jnp.arange(per_shard.shape[1], dtype=jnp.int32) + 1, 0))
    return (last + tile - 1) // tile


def _sampler(tiles: TokenTiles | None, temperature, top_p, top_k):
    def sample(logits, step_keys, active):
        if tiles is None:
            return sample_tokens(logits, step_keys, temperature, top_p, top_k)
        fn = lambda lg, kd, t, p, k: sample_tokens(lg, jax.random.wrap_key_data(kd), t, p, k)
        return map_tiles(tiles, live_tiles(active, tiles.shards, tiles.tile), fn, logits,
                         jax.random.key_data(step_keys), temperature, top_p, top_k)

    return sample


def decode_loop(step, cache, lengths, last, seeds, temperature, top_p, top_k, budget, limit, stop_ids, *,
                steps: int, max_len: int, tiles: TokenTiles | None = None, experts: jax.ShapeDtypeStruct | None = None):
    """Up to `steps` decode steps; stops early once every row is done.

    `step(cache, last [R], num_new [R], lengths [R]) -> (logits [R, V], cache)` feeds each
    active row's last token at its `lengths` (with `experts`, the per-row shape and dtype of
    a step's chosen experts, it returns (logits, cache, experts [R, ...]) instead). A row runs
    while it has `budget` (new tokens left), `limit` (tokens its pages hold this chunk;
    padding rows have 0) and context. Reasons: 0 still running, 1 stop token, 2 budget
    (length), 3 context full. Returns (cache, (tokens, logprobs, counts, reasons, computed)),
    `computed` the row-steps computed: every row each step, or with `tiles` the live tiles';
    with `experts` a sixth item, the experts [R, steps, ...] of each step's fed token."""
    batch = last.shape[0]
    keys = jax.vmap(jax.random.key)(seeds)
    active = (limit > 0) & (budget > 0) & (lengths < max_len)
    outs = (jnp.zeros((batch, steps), jnp.int32), jnp.zeros((batch, steps), jnp.float32))
    if experts is not None:
        outs += (jnp.zeros((batch, steps, *experts.shape), experts.dtype),)
    counts = jnp.zeros((batch,), jnp.int32)
    reasons = jnp.zeros((batch,), jnp.int32)
    sample = _sampler(tiles, temperature, top_p, top_k)

    def cond(carry):
        return (carry[0] < steps) & jnp.any(carry[3])

    def computed_rows(active):
        if tiles is None:
            return jnp.int32(batch)
        return live_tiles(active, tiles.shards, tiles.tile) * tiles.tile * tiles.shards

    def body(carry):
        i, cache, lengths, active, last, outs, counts, reasons, computed = carry
        computed = computed + computed_rows(active)
        logits, cache, *chosen = step(cache, last, active.astype(jnp.int32), lengths)
        lengths = lengths + active
        # a conversation's key depends only on its seed and the position being sampled
        step_keys = jax.vmap(jax.random.fold_in)(keys, lengths)
        token, logprob = sample(logits, step_keys, active)
        rows = (token, logprob, *chosen)
        outs = tuple(o.at[:, i].set(jnp.where(active.reshape(-1, *[1] * (r.ndim - 1)), r, 0).astype(o.dtype))
                     for o, r in zip(outs, rows))
        counts = counts + active
        hit_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        reason = jnp.where(hit_stop, 1, jnp.where(counts >= budget, 2, jnp.where(lengths >= max_len, 3, 0)))
        reasons = jnp.where(active, reason, reasons)
        last = jnp.where(active, token, last)
        active = active & (reason == 0) & (counts < limit)
        return i + 1, cache, lengths, active, last, outs, counts, reasons, computed

    carry = (jnp.int32(0), cache, lengths, active, last, outs, counts, reasons, jnp.int32(0))
    _, cache, _, _, _, outs, counts, reasons, computed = jax.lax.while_loop(cond, body, carry)
    return cache, (outs[0], outs[1], counts, reasons, computed, *outs[2:])
