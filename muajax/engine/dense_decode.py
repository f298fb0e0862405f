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

Both forms read keys laid out positions-last, [.., K, H, positions] (`kv_cache.gather_dense`
with `keys_last`): XLA:CPU's scores dot, one query per row against every cached key, runs
35-45% faster over them than over [.., K, positions, H]. Values keep the model's layout,
which the probabilities' dot already reads fastest. Above TAIL_MAX_ROWS the step writes into
the gathered cache through `in_place_attention`, the model's cache write and attention for
that layout.
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
    """Zero keys [R, K, H, width] and values [R, K, width, H] per layer, laid out like the dense prefix."""
    c = spec.cfg
    shapes = (rows, c.num_kv_heads, c.head_dim, width), (rows, c.num_kv_heads, width, c.head_dim)
    lengths = jnp.zeros((rows,), jnp.int32)
    if per_layer:
        k, v = (tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(c.num_layers)) for shape in shapes)
        return KVCache(k, v, lengths)
    k, v = (jnp.zeros((c.num_layers, *shape), c.compute_dtype) for shape in shapes)
    if spec.mesh is not None:
        sharding = spec.sharding(kv_cache.dense_spec(spec, False).k)
        k, v = (jax.lax.with_sharding_constraint(x, sharding) for x in (k, v))
    return KVCache(k, v, lengths)


def step_context(cfg: Qwen3Config, prefix_len, lengths, active, width: int) -> AttentionContext:
    """One new token per row at position `lengths`; the tail holds lengths - prefix_len so far."""
    q_index = lengths[:, None]
    cos, sin = rope_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    write = jnp.where(active, lengths - prefix_len, width)
    return AttentionContext(q_index, None, None, cos, sin, pages=TailIndex(prefix_len, write))


def _attend(q, keys_and_values, masks):
    """`xla_attention`'s float32 scores, masking and one softmax, over several (keys
    [R, K, H, S], values [R, K, S, H]) parts with masks [R, T, S] of allowed positions."""
    rows, t, n, h = q.shape
    kv = keys_and_values[0][0].shape[1]
    dt = q.dtype
    grouped = q.reshape(rows, t, kv, n // kv, h)
    scores = [jnp.einsum("BTKGH,BKHS->BKGTS", grouped, keys.astype(dt), preferred_element_type=jnp.float32)
              * (h**-0.5) for keys, _ in keys_and_values]
    scores = jnp.concatenate([jnp.where(m[:, None, None], s, NEG) for s, m in zip(scores, masks)], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out, start = 0, 0
    for _, values in keys_and_values:
        width = values.shape[2]
        out = out + jnp.einsum("BKGTS,BKSH->BKGTH", probs[..., start:start + width], values.astype(dt))
        start += width
    return out.transpose(0, 3, 1, 2, 4).reshape(rows, t, n, h)


def _layer_of(layer, *arrays):
    return tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in arrays)


def tail_attention(q, k, v, state, layer, ctx: AttentionContext):
    """The `cache_attention` hook (see `muajax.models.qwen3.DecoderLayer`) up to TAIL_MAX_ROWS.

    q [R, 1, N, H], k, v [R, 1, K, H]; `state` = (prefix k, prefix v, tail k, tail v), keys
    [R, K, H, S] and values [R, K, S, H] (one layer's, the unrolled path), or stacked [L, ...]
    (`layer` picks). One softmax over the prefix and the tail together."""
    prefix_k, prefix_v, tail_k, tail_v = state
    index: TailIndex = ctx.pages
    at, write = jnp.arange(q.shape[0])[:, None], index.write[:, None]
    new_k, new_v = (x[:, 0].astype(tail_k.dtype) for x in (k, v))  # [R, K, H]
    lead = (layer,) if prefix_k.ndim == 5 else ()
    tail_k = tail_k.at[(*lead, at, slice(None), slice(None), write)].set(new_k[:, None], mode="drop")
    tail_v = tail_v.at[(*lead, at, slice(None), write)].set(new_v[:, None], mode="drop")
    parts = (prefix_k, prefix_v, tail_k, tail_v)
    pk, pv, tk, tv = _layer_of(layer, *parts) if lead else parts
    prefix_ok = jnp.arange(pv.shape[2])[None, :] < index.prefix_len[:, None]
    tail_ok = jnp.arange(tv.shape[2])[None, :] <= index.write[:, None]
    out = _attend(q, ((pk, pv), (tk, tv)), (prefix_ok[:, None], tail_ok[:, None]))
    return out, (prefix_k, prefix_v, tail_k, tail_v)


def in_place_attention(q, k, v, state, layer, ctx: AttentionContext):
    """The `cache_attention` hook above TAIL_MAX_ROWS: the model's cache write and attention
    (`_write_cache`, `xla_attention`) over keys [R, K, H, S] and values [R, K, S, H], one
    layer's or stacked [L, ...]. `ctx` is the model's cache context (q_index, kv_valid, write_index)."""
    keys, values = state
    at = jnp.arange(q.shape[0])[:, None]
    lead = (layer,) if keys.ndim == 5 else ()
    keys = keys.at[(*lead, at, slice(None), slice(None), ctx.write_index)].set(k.astype(keys.dtype), mode="drop")
    values = values.at[(*lead, at, slice(None), ctx.write_index)].set(v.astype(values.dtype), mode="drop")
    lk, lv = _layer_of(layer, keys, values) if lead else (keys, values)
    allowed = (jnp.arange(lv.shape[2])[None, None, :] <= ctx.q_index[:, :, None]) & ctx.kv_valid[:, None, :]
    return _attend(q, ((lk, lv),), (allowed,)), (keys, values)


def model(cfg: Qwen3Config, hook=tail_attention) -> Qwen3:
    return Qwen3(cfg, cache_attention=hook)


def run_step(cfg: Qwen3Config, params, layer_params, prefix: KVCache, tail: KVCache, last, lengths, active):
    """One decode step for every row: logits [R, V] at `last` [R], and the tail updated."""
    width = tail.max_len
    ctx = step_context(cfg, prefix.lengths, lengths, active, width)
    zeros = jnp.zeros((last.shape[0], 1), jnp.int32)
    state = (prefix.k, prefix.v, tail.k, tail.v)
    logits, (_, _, tail_k, tail_v) = model(cfg).apply({"params": params}, last[:, None], ctx, state, zeros, False,
                                                       True, layer_params)
    return logits[:, 0], KVCache(tail_k, tail_v, tail.lengths)


def run_in_place_step(cfg: Qwen3Config, params, layer_params, dense: KVCache, last, num_new):
    """One decode step writing into the gathered cache itself (keys positions-last): logits
    [R, V] of `last` [R] at each row's `dense.lengths`, and the cache with `num_new` [R] (0 or 1)
    tokens more. The context `muajax.models.qwen3.forward` builds for a cache."""
    q_index = dense.lengths[:, None]
    new_lengths = dense.lengths + num_new
    write_index = jnp.where(num_new[:, None] > 0, q_index, dense.max_len)  # not running: dropped
    kv_valid = jnp.arange(dense.max_len)[None, :] < new_lengths[:, None]
    cos, sin = rope_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    ctx = AttentionContext(q_index, kv_valid, write_index, cos, sin)
    zeros = jnp.zeros((last.shape[0], 1), jnp.int32)
    logits, (k, v) = model(cfg, in_place_attention).apply({"params": params}, last[:, None], ctx,
                                                           (dense.k, dense.v), zeros, False, True, layer_params)
    return logits[:, 0], KVCache(k, v, new_lengths)
