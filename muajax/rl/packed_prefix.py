"""Packed rows that share a prefix: the forward of GRPO's packed rows where every trajectory
begins with the same system prompt.

A packed row (`muajax.runtime.grpo_packing`) holds the common prefix once, in its first P
columns, then the trajectories' own tokens (each without the prefix) one after another,
told apart by `segment_ids`. The prefix runs once, for one row, into a KV cache (as
`muajax.models.qwen3.forward_shared_prefix` does for padded rows); the rows' other tokens
then run with a `cache_attention` hook (`muajax.models.qwen3_layers.DecoderLayer`) whose
mask is "every prefix key, and the keys of the query's own segment up to itself", with
positions that restart at P in each segment. Each trajectory so sees exactly what it sees
in its own padded row whose prefix is shared, and the prefix's gradient is the sum over all
segments' queries, as there.

The attention is the einsum form (float32 scores over the P prefix keys and the row's own
keys): the padded rows' shared prefix runs only where their attention is the einsum or the
chunked one anyway (`muajax.runtime.grpo_layout.shared_prefix_tokens`: not with splash or
cuDNN), and its rows are row-length wide, as there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from muajax.models.chunked_attention import NEG
from muajax.models.qwen3 import (AttentionContext, Qwen3, Qwen3Config, forward, init_cache, packed_positions,
                                 rope_tables)


def prefix_segment_attention(q, k, v, stacked, layer, ctx: AttentionContext):
    """The `cache_attention` hook: q [B, T, N, H] and the row's own k, v [B, T, K, H] (roped);
    `stacked` the prefix's (k, v) [L, 1, K, P, H] of every layer. Returns (out [B, T, N, H],
    stacked unchanged)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    dt = q.dtype
    pk, pv = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)[0].astype(dt) for c in stacked)
    p = pk.shape[1]
    qg = q.reshape(b, t, kv, n // kv, h)
    scale = h ** -0.5
    s_pre = jnp.einsum("BTKGH,KSH->BKGTS", qg, pk, preferred_element_type=jnp.float32) * scale
    s_own = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    seg = ctx.segment_ids
    index = jnp.arange(t)
    allowed = (index[None, :] <= index[:, None])[None] & (seg[:, :, None] == seg[:, None, :])  # [B, T, S]
    s_own = jnp.where(allowed[:, None, None], s_own, NEG)
    probs = jax.nn.softmax(jnp.concatenate([s_pre, s_own], axis=-1), axis=-1).astype(v.dtype)
    out = (jnp.einsum("BKGTS,KSH->BKGTH", probs[..., :p], pv)
           + jnp.einsum("BKGTS,BSKH->BKGTH", probs[..., p:], v))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), stacked


def forward_packed_prefix(params, cfg: Qwen3Config, tokens: jax.Array, segment_ids: jax.Array,
                          prefix_len: int, return_routing: bool = False, routing: jax.Array | None = None):
    """Hidden states [B, T, D] of packed rows whose first `prefix_len` columns are the common
    prefix and whose other columns hold segments (`segment_ids`, 0: padding) that each
    continue that prefix: each position's hidden state is the one it has in its own
    trajectory's row (`forward_shared_prefix` of that row). With `return_routing` (a mixture
    of experts), (hidden, (the prefix's `RoutingOut`, the segments' over their nonzero ids)).
    `routing` [L, B, T, k]: forced experts (routing replay), the prefix's those of row 0."""
    b, t = tokens.shape
    if not 0 < prefix_len < t:
        raise ValueError(f"prefix_len={prefix_len} must be in (0, {t})")
    cache = init_cache(cfg, 1, prefix_len)
    forced = (None, None) if routing is None else (routing[:, :1, :prefix_len], routing[:, :, prefix_len:])
    h_prefix, cache, *r_prefix = forward(params, cfg, tokens[:1, :prefix_len], cache=cache, return_hidden=True,
                                         in_place=False, attention=cfg.attention, return_routing=return_routing,
                                         routing=forced[0])
    seg = segment_ids[:, prefix_len:]
    positions = prefix_len + packed_positions(seg)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    ctx = AttentionContext(q_index=None, kv_valid=None, write_index=None, cos=cos, sin=sin, segment_ids=seg,
                           routing=forced[1])
    model = Qwen3(cfg, cache_attention=prefix_segment_attention)
    h_rest, _, *r_rest = model.apply({"params": params}, tokens[:, prefix_len:], ctx, (cache.k, cache.v), None, True,
                                     True, return_routing=return_routing)
    hidden = jnp.concatenate([jnp.broadcast_to(h_prefix, (b,) + h_prefix.shape[1:]), h_rest], axis=1)
    return (hidden, (r_prefix[0], r_rest[0])) if return_routing else hidden
