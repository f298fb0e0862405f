"""Attention over the paged pool in pure JAX, reading the pages in place: the engine's
extend on CPU and GPU, and its decode on GPU (`attention="paged"`).

The model's `cache_attention` hook (see `muajax.models.qwen3.DecoderLayer`), per layer:
the call's new keys and values go into their pages first, then every query attends over
its own row's pages, block by block: an online softmax over key blocks of `block_pages`
pages, each block gathered from this layer's pages by the row's page table. Nothing
holds a dense copy of the cache: at any moment one [rows, block] slice of one layer.
Because the new keys are written before anyone attends, several rows may be pieces of one
sequence (the engine's packed extends cut a turn into tiles of tokens): a later piece sees
the earlier ones' keys.

Batch invariance (a row's numbers do not depend on the other rows of the call, which the
engine's deterministic mode needs): every dot is per row, on [queries, head_dim] x
[block, head_dim] and [queries, block] x [block, head_dim] slices of fixed shape, and the
blocks are visited in order. The loop runs to the longest row's last block; for a shorter
row the blocks past its own end are fully masked, where the online softmax adds exact zeros
(its running max is finite, so exp(NEG - max) is 0 and the rescale exp(0) is 1).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from muajax.engine import kv_cache
from muajax.engine.kv_cache import PoolSpec
from muajax.models.chunked_attention import NEG

BLOCK_TOKENS = 128  # keys per block: a multiple of the page size, at most one sequence's pages


class PagedRows(NamedTuple):
    """Per row (rows-first, sharded like the rows): its page table [R, P], tokens cached once
    the call's are written `kv_lens` [R], and the new tokens' flat page slots [R, W] (out of
    range for padding: their writes are dropped)."""

    page_table: jax.Array
    kv_lens: jax.Array
    slots: jax.Array


def block_pages(spec: PoolSpec) -> int:
    return max(1, min(BLOCK_TOKENS // spec.page_size, spec.max_pages))


def paged_rows(spec: PoolSpec, page_table, lengths, num_new, width: int) -> PagedRows:
    fn = functools.partial(kv_cache.token_slots, num_pages=spec.pages_per_shard, page_size=spec.page_size,
                           width=width)
    rows = spec.rows_spec()
    slots = spec.local(lambda t, s, c: fn(t, s, c), (spec.rows_spec(2), rows, rows), spec.rows_spec(2))(
        page_table, lengths, num_new)
    return PagedRows(page_table, lengths + num_new, slots)


def attend_pages(q, pool, layer, page_table, q_index, kv_lens, *, pages_per_block: int):
    """Attention output [R, T, N, H] of queries q [R, T, N, H] at key positions `q_index`
    [R, T] over the first `kv_lens` [R] tokens of each row's pages in `pool`'s layer `layer`
    (query t sees keys <= q_index[t]). float32 scores, scaled then masked, like the model's."""
    rows, t, n, h = q.shape
    layers, pages, size, kv2, _ = pool.shape
    kv = kv2 // 2
    groups = n // kv
    flat = pool.reshape(layers * pages, size, kv2, h)  # a bitcast: no layer is sliced out
    blocks = -(-page_table.shape[1] // pages_per_block)
    table = jnp.pad(page_table, ((0, 0), (0, blocks * pages_per_block - page_table.shape[1]))) + layer * pages
    width = pages_per_block * size
    queries = q.reshape(rows, t, kv, groups, h).transpose(0, 2, 3, 1, 4).reshape(rows, kv, groups * t, h)
    q_pos = jnp.broadcast_to(q_index[:, None, :], (rows, groups, t)).reshape(rows, groups * t)

    def block(j, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(table, j * pages_per_block, pages_per_block, axis=1)
        kvb = flat[ids].reshape(rows, width, kv, 2, h)
        keys, values = (jnp.swapaxes(kvb[..., i, :], 1, 2).astype(q.dtype) for i in (0, 1))  # [R, K, block, H]
        scores = jnp.einsum("rkqh,rksh->rkqs", queries, keys, preferred_element_type=jnp.float32) * (h**-0.5)
        key = j * width + jnp.arange(width, dtype=jnp.int32)
        visible = (key[None, None, :] <= q_pos[:, :, None]) & (key[None, None, :] < kv_lens[:, None, None])
        scores = jnp.where(visible[:, None], scores, NEG)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("rkqs,rksh->rkqh", p.astype(q.dtype), values, preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

    init = (jnp.full((rows, kv, groups * t), NEG, jnp.float32), jnp.zeros((rows, kv, groups * t), jnp.float32),
            jnp.zeros((rows, kv, groups * t, h), jnp.float32))
    count = jnp.clip(-(-jnp.max(kv_lens) // width), 1, blocks)
    _, l, acc = jax.lax.fori_loop(0, count, block, init)
    out = (acc / l[..., None]).astype(q.dtype).reshape(rows, kv, groups, t, h)
    return out.transpose(0, 3, 1, 2, 4).reshape(rows, t, n, h)


def _attend_local(pages_per_block: int, q, k, v, pool, layer, q_index, rows: PagedRows):
    pool = kv_cache.put_tokens(pool, layer, kv_cache.interleave(k, v), rows.slots)
    out = attend_pages(q, pool, layer, rows.page_table, q_index, rows.kv_lens, pages_per_block=pages_per_block)
    return out, pool


def paged_cache_attention(spec: PoolSpec, q, k, v, pool, layer, ctx):
    """The `cache_attention` hook: `ctx.pages` is a `PagedRows`, `ctx.q_index` the queries'
    positions. Runs per shard (its rows on its own pages and heads)."""
    heads, rows = spec.heads_spec(4, 2), spec.rows_spec()
    fn = spec.local(functools.partial(_attend_local, block_pages(spec)),
                    (heads, heads, heads, spec.pool_spec(), jax.sharding.PartitionSpec(), spec.rows_spec(2),
                     PagedRows(spec.rows_spec(2), rows, spec.rows_spec(2))),
                    (heads, spec.pool_spec()))
    return fn(q, k, v, pool, layer, ctx.q_index, ctx.pages)
