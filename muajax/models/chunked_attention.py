"""Blockwise attention in plain XLA: an online softmax over key blocks, with a custom VJP
that recomputes each block's scores in the backward.

Nothing [T, S]-sized is ever alive: the forward keeps one [B, K, bq, bk] score block and
per-query running max/sum; the backward keeps the forward's output and per-query
log-sum-exp (O(T)) and rebuilds the same blocks. Memory is O(T x block) in both passes,
against the einsum reference's O(T x S) scores per layer (and their saved softmax). The G
query heads of a kv head run as one query axis of G x T rows (see `chunked_attention`).

Key blocks past a query block's largest `q_index` are skipped: under a causal mask that is
about half of all block pairs. Each query block runs a loop with that dynamic trip count,
so it holds for the cache-style mask (queries at arbitrary offsets into a KV cache) too.

The mask is the one `muajax.models.attention` describes: key s is visible to query t when
s <= q_index[t], and (if given) q_seg[t] == kv_seg[s], and (if given) kv_valid[s]. Masked
scores take float32's most negative value, as in the reference, so a query that sees no key
at all gets a finite average instead of NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

NEG = float(jnp.finfo(jnp.float32).min)
ATTENTION_OUT, ATTENTION_LSE = "attention_out", "attention_lse"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int, value=0):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, axis: int, size: int):
    """Split `axis` into [n, size] and move n to the front (a scan's xs)."""
    if x is None:
        return None
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblock(x, axis: int):
    """Inverse of `_blocks`: [n, ..., size, ...] -> [..., n * size, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _key_block_bound(q_index_block, bk: int, nk: int):
    """How many key blocks this query block can see: those up to its largest q_index (at
    least one, so that a row of padding still divides by a nonzero sum)."""
    return jnp.clip(jnp.max(q_index_block) // bk + 1, 1, nk)


def _block_scores(qb, k, j, bk, qi, qs, kv_seg, kv_valid, scale):
    """Masked float32 scores [B, K, bq, bk] of query block qb [B, K, bq, H] against key block
    j, in the reference's order: dot in float32, then scale, then mask."""
    kb = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    scores = jnp.einsum("bkqh,bksh->bkqs", qb, kb, preferred_element_type=jnp.float32) * scale
    key_index = j * bk + jnp.arange(bk)
    visible = key_index[None, None, :] <= qi[:, :, None]
    if qs is not None:
        visible &= qs[:, :, None] == jax.lax.dynamic_slice_in_dim(kv_seg, j * bk, bk, axis=1)[:, None, :]
    if kv_valid is not None:
        visible &= jax.lax.dynamic_slice_in_dim(kv_valid, j * bk, bk, axis=1)[:, None, :]
    return jnp.where(visible[:, None], scores, NEG), kb


def _forward(bq, bk, scale, q, k, v, q_index, q_seg, kv_seg, kv_valid):
    """q [B, K, Q, H]; k, v [B, K, Sp, H] (padded to the blocks) -> out like q, lse [B, K, Q]."""
    nk = k.shape[2] // bk

    def query_block(_, xs):
        qb, qi, qs = xs
        init = (jnp.full(qb.shape[:-1], NEG, jnp.float32), jnp.zeros(qb.shape[:-1], jnp.float32),
                jnp.zeros(qb.shape, jnp.float32))

        def key_block(j, carry):
            m, l, acc = carry
            scores, _ = _block_scores(qb, k, j, bk, qi, qs, kv_seg, kv_valid, scale)
            vb = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            m_new = jnp.maximum(m, scores.max(axis=-1))
            p = jnp.exp(scores - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

        m, l, acc = jax.lax.fori_loop(0, _key_block_bound(qi, bk, nk), key_block, init)
        return None, ((acc / l[..., None]).astype(q.dtype), m + jnp.log(l))

    xs = (_blocks(q, 2, bq), _blocks(q_index, 1, bq), _blocks(q_seg, 1, bq))
    _, (out, lse) = jax.lax.scan(query_block, None, xs)
    return _unblock(out, 2), _unblock(lse, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(bq, bk, scale, q, k, v, q_index, q_seg, kv_seg, kv_valid):
    return _forward(bq, bk, scale, q, k, v, q_index, q_seg, kv_seg, kv_valid)[0]


def _flash_fwd(bq, bk, scale, q, k, v, q_index, q_seg, kv_seg, kv_valid):
    out, lse = _forward(bq, bk, scale, q, k, v, q_index, q_seg, kv_seg, kv_valid)
    # Named so that a remat policy can keep them (`muajax.models.qwen3`): the backward then
    # needs no second forward to rebuild them.
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (q, k, v, q_index, q_seg, kv_seg, kv_valid, out, lse)


def _flash_bwd(bq, bk, scale, residuals, d_out):
    """FlashAttention-2's backward: per block, p = exp(s - lse), dv += p^T dO,
    ds = p * (dO v^T - rowsum(dO * O)), dq += ds k, dk += ds^T q. Query blocks run in a scan
    that carries float32 dk, dv for the whole key axis; each emits its dq."""
    q, k, v, q_index, q_seg, kv_seg, kv_valid, out, lse = residuals
    nk = k.shape[2] // bk
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def query_block(carry, xs):
        qb, dob, lseb, deltab, qi, qs = xs

        def key_block(j, inner):
            dq, dk, dv = inner
            scores, kb = _block_scores(qb, k, j, bk, qi, qs, kv_seg, kv_valid, scale)
            vb = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            p = jnp.exp(scores - lseb[..., None])
            dv_j = jnp.einsum("bkqs,bkqh->bksh", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkqh,bksh->bkqs", dob, vb, preferred_element_type=jnp.float32)
            ds = (p * (dp - deltab[..., None])).astype(q.dtype)
            dq = dq + jnp.einsum("bkqs,bksh->bkqh", ds, kb, preferred_element_type=jnp.float32) * scale
            dk_j = jnp.einsum("bkqs,bkqh->bksh", ds, qb, preferred_element_type=jnp.float32) * scale
            add = lambda acc, part: jax.lax.dynamic_update_slice_in_dim(
                acc, jax.lax.dynamic_slice_in_dim(acc, j * bk, bk, axis=2) + part, j * bk, axis=2)
            return dq, add(dk, dk_j), add(dv, dv_j)

        dq, dk, dv = jax.lax.fori_loop(0, _key_block_bound(qi, bk, nk), key_block,
                                       (jnp.zeros(qb.shape, jnp.float32), *carry))
        return (dk, dv), dq

    zeros = jnp.zeros(k.shape, jnp.float32)
    xs = (_blocks(q, 2, bq), _blocks(d_out, 2, bq), _blocks(lse, 2, bq), _blocks(delta, 2, bq),
          _blocks(q_index, 1, bq), _blocks(q_seg, 1, bq))
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), xs)
    return _unblock(dq, 2).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(q, k, v, q_index, *, q_seg=None, kv_seg=None, kv_valid=None, block: int = 512):
    """q [B, T, N, H]; k, v [B, K, S, H]; q_index [B, T]; q_seg [B, T] with kv_seg [B, S], and
    kv_valid [B, S] bool, both optional -> [B, T, N, H] in q's dtype.

    Blocks are `block` long on both axes (the whole axis when shorter); T and S are padded
    up to them inside and the padding is masked out (each query's q_index is clamped below S).
    """
    b, t, n, h = q.shape
    kvh, s = k.shape[1], k.shape[2]
    bq, bk = min(block, t), min(block, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    g = n // kvh
    # The G query heads that share a kv head become one query axis of G x Tp rows (a free
    # reshape), so every dot has a single contraction or row dim: with [G, T] as two dims the
    # backward's dk and dv contract over both, and XLA:CPU transposes each score block first.
    grouped = _pad_axis(q.reshape(b, t, kvh, g, h).transpose(0, 2, 3, 1, 4), 3, tp).reshape(b, kvh, g * tp, h)
    per_head = lambda x, value: None if x is None else jnp.tile(_pad_axis(x, 1, tp, value), (1, g))
    q_index = jnp.minimum(q_index.astype(jnp.int32), s - 1)
    out = _flash(bq, bk, h**-0.5, grouped, _pad_axis(k, 2, sp), _pad_axis(v, 2, sp),
                 per_head(q_index, -1), per_head(q_seg, 0), _pad_axis(kv_seg, 1, sp, -1),
                 _pad_axis(kv_valid, 1, sp, False))
    return out.reshape(b, kvh, g, tp, h)[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
