"""The pure-JAX decode step: attention over a read-only dense prefix plus a small tail.

A decode chunk gathers each row's pages once into a dense prefix (`kv_cache.gather_dense`)
and then samples up to `decode_chunk` tokens. Writing each new token into that prefix and
reading it back in the same loop step made XLA on CPU copy the whole prefix every step
(measured on the bench model, 8 layers, one row at 1280 positions: 5.6 ms a step against
1.0 ms for the attention reads alone), so a turn's cost grew with its history far faster
than the bytes it reads. Here the prefix is never written: the chunk's own keys and values
go into a tail of `decode_chunk` positions, attention takes one softmax over prefix and tail
together, and the tail is written into the pages once, when the chunk ends.

The copy is XLA's for one or two rows (decode steps at 1280 positions, per row: 5.5 ms in
place against 1.3 ms with the tail at one row, 1.5 against 1.3 at two); at eight rows the
in-place write costs nothing extra and the tail's own small ops cost about 0.6 ms a step
(9.1 against 12.0 ms), so `programs._decode_reference` takes the tail up to TAIL_MAX_ROWS.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from muajax.engine import kv_cache
from muajax.engine.kv_cache import PoolSpec
from muajax.models.chunked_attention import NEG
from muajax.models.qwen3 import AttentionContext, KVCache, Qwen3, Qwen3Config, rope_tables


TAIL_MAX_ROWS = 2


class TailIndex(NamedTuple):
    """Per row [R]: tokens in the prefix, and where this step's token goes in the tail
    (the tail's width for rows that are not running: their write is dropped)."""

    prefix_len: jax.Array
    write: jax.Array


def empty_tail(spec: PoolSpec, rows: int, width: int, per_layer: bool) -> KVCache:
    """Zero keys and values for `width` positions per row, laid out like the dense prefix."""
    c = spec.cfg
    shape = (rows, c.num_kv_heads, width, c.head_dim)
    lengths = jnp.zeros((rows,), jnp.int32)
    if per_layer:
        zeros = tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(c.num_layers))
        return KVCache(zeros, zeros, lengths)
    zeros = jnp.zeros((c.num_layers, *shape), c.compute_dtype)
    if spec.mesh is not None:
        zeros = jax.lax.with_sharding_constraint(zeros, spec.sharding(kv_cache.dense_spec(spec, False).k))
    return KVCache(zeros, zeros, lengths)


def step_context(cfg: Qwen3Config, prefix_len, lengths, active, width: int) -> AttentionContext:
    """One new token per row at position `lengths`; the tail holds lengths - prefix_len so far."""
    q_index = lengths[:, None]
    cos, sin = rope_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    write = jnp.where(active, lengths - prefix_len, width)
    return AttentionContext(q_index, None, None, cos, sin, pages=TailIndex(prefix_len, write))


def group_scores(q, keys):
    """float32 scores [R, K, G, 1, S] of queries q [R, K, G, H] against keys [R, K, S, H]: one
    matrix-vector product per query head, which XLA:CPU runs faster than the one [S, H] x
    [H, G] product per key head (G = 2 on the bench model): in-process A/Bs of `bench
    multiturn`'s kept conversation (turns interleaved) took 2.2% less time over its ten turns,
    2.4% capped to AVX2. How fast a turn's cost grows with the history moved within the A/Bs'
    noise (1-2 ms a turn, either way)."""
    per_head = [jnp.einsum("BKSH,BKH->BKS", keys, q[:, :, g], preferred_element_type=jnp.float32)
                for g in range(q.shape[2])]
    return jnp.stack(per_head, axis=2)[:, :, :, None]


def tail_attention(q, k, v, state, layer, ctx: AttentionContext):
    """The `cache_attention` hook (see `muajax.models.qwen3.DecoderLayer`).

    q [R, 1, N, H], k, v [R, 1, K, H]; `state` = (prefix k, prefix v, tail k, tail v), each
    [R, K, S, H] (one layer's, the unrolled path) or [L, R, K, S, H] (stacked: `layer` picks).
    The same float32 scores, masking and softmax as `xla_attention`, over the concatenation."""
    prefix_k, prefix_v, tail_k, tail_v = state
    stacked = prefix_k.ndim == 5
    index: TailIndex = ctx.pages
    rows, _, n, h = q.shape
    kv = k.shape[2]
    width = tail_k.shape[-2]
    at = jnp.arange(rows)[:, None]
    write = index.write[:, None]
    new_k, new_v = (x.transpose(0, 2, 1, 3).astype(tail_k.dtype)[:, :, 0] for x in (k, v))  # [R, K, H]
    if stacked:
        tail_k = tail_k.at[layer, at, :, write].set(new_k[:, None], mode="drop")
        tail_v = tail_v.at[layer, at, :, write].set(new_v[:, None], mode="drop")
        pk, pv, tk, tv = (jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
                          for x in (prefix_k, prefix_v, tail_k, tail_v))
    else:
        tail_k = tail_k.at[at, :, write].set(new_k[:, None], mode="drop")
        tail_v = tail_v.at[at, :, write].set(new_v[:, None], mode="drop")
        pk, pv, tk, tv = prefix_k, prefix_v, tail_k, tail_v
    dt = q.dtype
    grouped = q.reshape(rows, kv, n // kv, h)  # one query per row
    scores = [group_scores(grouped, keys.astype(dt)) * (h**-0.5) for keys in (pk, tk)]
    prefix_ok = jnp.arange(pk.shape[2])[None, :] < index.prefix_len[:, None]
    tail_ok = jnp.arange(width)[None, :] <= index.write[:, None]
    masks = (prefix_ok, tail_ok)
    scores = jnp.concatenate([jnp.where(m[:, None, None, None, :], s, NEG) for s, m in zip(scores, masks)], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    split = pk.shape[2]
    out = (jnp.einsum("BKGTS,BKSH->BKGTH", probs[..., :split], pv.astype(dt))
           + jnp.einsum("BKGTS,BKSH->BKGTH", probs[..., split:], tv.astype(dt)))
    return out.transpose(0, 3, 1, 2, 4).reshape(rows, 1, n, h), (prefix_k, prefix_v, tail_k, tail_v)


def model(cfg: Qwen3Config) -> Qwen3:
    return Qwen3(cfg, cache_attention=tail_attention)


def run_step(cfg: Qwen3Config, params, layer_params, prefix: KVCache, tail: KVCache, last, lengths, active):
    """One decode step for every row: logits [R, V] at `last` [R], and the tail updated."""
    width = (tail.k[0] if tail.per_layer else tail.k).shape[-2]
    ctx = step_context(cfg, prefix.lengths, lengths, active, width)
    zeros = jnp.zeros((last.shape[0], 1), jnp.int32)
    state = (prefix.k, prefix.v, tail.k, tail.v)
    logits, (_, _, tail_k, tail_v) = model(cfg).apply({"params": params}, last[:, None], ctx, state, zeros, False,
                                                       True, layer_params)
    return logits[:, 0], KVCache(tail_k, tail_v, tail.lengths)
