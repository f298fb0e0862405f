"""Qwen3 dense decoder in Flax Linen, computing what HF's `Qwen3ForCausalLM` computes:
the functional entry points (`forward`, `forward_shared_prefix`, `init_params`, ...).

The pieces live by job: the settings in `qwen3_config`, the KV cache in `qwen3_cache`,
one decoder layer in `qwen3_layers`, the Flax module in `qwen3_model`. This module
re-exports their public names, so `from muajax.models.qwen3 import ...` reaches them all.

The KV cache (`KVCache`) is explicit and functional: `forward` takes a cache and returns
the updated one (see `qwen3_model` for how the cache moves through the layers).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from muajax.models.moe import combine_routing
from muajax.models.qwen3_cache import CACHE_AXES, KVCache, cache_shape, init_cache
from muajax.models.qwen3_config import DTYPES, REMAT_POLICIES, Qwen3Config
from muajax.models.qwen3_layers import (AttentionContext, DecoderLayer, LayerCarry, apply_rope, rms_norm,
                                        rope_tables)
from muajax.models.qwen3_model import Qwen3, lm_head

__all__ = [
    "CACHE_AXES", "DTYPES", "REMAT_POLICIES", "AttentionContext", "DecoderLayer", "KVCache", "LayerCarry", "Qwen3",
    "Qwen3Config", "abstract_params", "apply_rope", "cache_shape", "forward", "forward_jit", "forward_shared_prefix",
    "init_cache", "init_params", "lm_head", "logical_axes", "packed_positions", "param_bytes", "rms_norm",
    "rope_tables", "split_layers",
]


def packed_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions [B, T] that restart at 0 wherever the segment id changes."""
    t = segment_ids.shape[1]
    index = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def _no_cache_context(cfg, positions, attention_mask, segment_ids=None) -> AttentionContext:
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    if attention_mask is not None:  # real tokens see real tokens: the mask as two segments
        segment_ids = attention_mask.astype(jnp.int32)
    return AttentionContext(None, None, None, cos, sin, segment_ids)


def _cache_context(cfg, cache: KVCache, num_new: jax.Array, t: int) -> AttentionContext:
    offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_index = cache.lengths[:, None] + offsets
    new_lengths = cache.lengths + num_new
    write_index = jnp.where(offsets < num_new[:, None], q_index, cache.max_len)  # padding -> dropped
    kv_valid = jnp.arange(cache.max_len)[None, :] < new_lengths[:, None]
    cos, sin = rope_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    return AttentionContext(q_index, kv_valid, write_index, cos, sin)


def forward(
    params,
    cfg: Qwen3Config,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    cache: KVCache | None = None,
    num_new: jax.Array | None = None,
    logits_index: jax.Array | None = None,
    return_hidden: bool = False,
    in_place: bool = True,
    layer_params: list | None = None,
    segment_ids: jax.Array | None = None,
    attention: str | None = None,
    live_tiles: jax.Array | None = None,
    routing: jax.Array | None = None,
    return_routing: bool = False,
):
    """Run the model. Returns (logits [B, T or P, V], new cache or None), and with
    `return_routing` a third item, a mixture of experts' `muajax.models.moe.RoutingOut`
    (None for a dense model): the experts each token used per layer [L, B, T, k] and the
    load-balancing terms (`moe.load_balancing_loss(out.fraction, out.mean_prob)`).
    `routing` [L, B, T, k] int32: the experts to use instead of the routers' choice
    (routing replay; e.g. a previous call's `RoutingOut.experts`).

    Without a cache: a causal forward over `tokens` [B, T] (right padding is harmless;
    `attention_mask` hides padded keys when left padding is used). Packed rows pass
    `segment_ids` [B, T] (one id per sequence, 0 for padding): attention never crosses a
    segment, and positions (default) restart in each one. With a cache: the
    chunk `tokens` [B, T] is appended to each row at `cache.lengths[b]`, of which the
    first `num_new[b]` tokens are real (default: all T); positions continue each row.
    `logits_index` [B, P] picks the positions whose logits are wanted.
    `in_place=False` moves the cache through the layers as per-layer slices: the same
    numbers, but cheap to differentiate (see the module docstring).

    A per-layer cache (`KVCache.per_layer`) runs the layers unrolled, each on its own
    weights and cache buffers, so nothing is sliced out of a stacked array per call: XLA
    on CPU copies every dynamic slice that feeds a dot, which in a decode loop is a copy
    of all the weights per token. `layer_params` (default `split_layers(params)`) gives
    the weights; pass ones that are already separate buffers to avoid even static slices.

    `attention` names the attention implementation for this call (`muajax.models.attention`):
    by default `cfg.attention` without a cache and "xla" with one (the engine's extend and
    decode; paged attention is the engine's own concern). `live_tiles`: with
    `cfg.token_tiles`, the tiles per shard to compute (see `muajax.models.token_tiles`).
    """
    impl = attention or (cfg.attention if cache is None else "xla")
    model = Qwen3(cfg if impl == cfg.attention else cfg.replace(attention=impl))
    b, t = tokens.shape
    if segment_ids is not None and (cache is not None or attention_mask is not None):
        raise ValueError("forward: segment_ids (packing) take neither a cache nor an attention_mask")
    if cache is None:
        if positions is None and segment_ids is not None:
            positions = packed_positions(segment_ids)
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ctx = _no_cache_context(cfg, positions, attention_mask, segment_ids)._replace(routing=routing)
        out, _, *moe = model.apply({"params": params}, tokens, ctx, None, logits_index, return_hidden,
                                   return_routing=return_routing)
        return (out, None, *moe)
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    ctx = _cache_context(cfg, cache, num_new.astype(jnp.int32), t)._replace(live_tiles=live_tiles, routing=routing)
    if cache.per_layer and layer_params is None:
        layer_params = split_layers(params, cfg.num_layers)
    out, (k, v), *moe = model.apply({"params": params}, tokens, ctx, (cache.k, cache.v), logits_index,
                                    return_hidden, in_place, layer_params if cache.per_layer else None,
                                    return_routing=return_routing)
    return (out, KVCache(k, v, cache.lengths + num_new.astype(jnp.int32)), *moe)


def split_layers(params, num_layers: int) -> list:
    """Layer i's weights of the stacked `params["layers"]`, as a list of per-layer trees."""
    return [jax.tree.map(lambda p, i=i: p[i], params["layers"]) for i in range(num_layers)]


def forward_shared_prefix(params, cfg: Qwen3Config, tokens: jax.Array, prefix_len: int, *,
                          routing: jax.Array | None = None, return_routing: bool = False):
    """Hidden states [B, T, D] equal to `forward(..., return_hidden=True)` for a batch whose
    rows all begin with the same `prefix_len` tokens (e.g. the system prompt with policy and
    tools, which dominates short agent conversations): the prefix runs once, for one row,
    into a KV cache that every row then extends with its own tokens. Differentiable; the
    prefix's gradient is the sum over rows, as in the full forward. Attention is
    `cfg.attention` in its cache form (`chunked` where splash or cudnn was asked for).
    A mixture of experts takes `routing` [L, B, T, k] as `forward` does (the prefix's from
    row 0) and with `return_routing` returns (hidden, `moe.RoutingOut` of all rows' tokens).
    """
    b, t = tokens.shape
    if not 0 < prefix_len < t:
        raise ValueError(f"prefix_len={prefix_len} must be in (0, {t})")
    cache = init_cache(cfg, 1, t)
    forced = (None, None) if routing is None else (routing[:, :1, :prefix_len], routing[:, :, prefix_len:])
    h_prefix, cache, *first = forward(params, cfg, tokens[:1, :prefix_len], cache=cache, return_hidden=True,
                                      in_place=False, attention=cfg.attention, routing=forced[0],
                                      return_routing=return_routing)
    shape = (cfg.num_layers, b) + cache.k.shape[2:]
    cache = KVCache(jnp.broadcast_to(cache.k, shape), jnp.broadcast_to(cache.v, shape),
                    jnp.broadcast_to(cache.lengths, (b,)))
    h_rest, _, *rest = forward(params, cfg, tokens[:, prefix_len:], cache=cache, return_hidden=True,
                               in_place=False, attention=cfg.attention, routing=forced[1],
                               return_routing=return_routing)
    hidden = jnp.concatenate([jnp.broadcast_to(h_prefix, (b,) + h_prefix.shape[1:]), h_rest], axis=1)
    if not return_routing:
        return hidden
    return hidden, (None if first[0] is None else combine_routing([(first[0], b), (rest[0], 1)]))


def abstract_params(cfg: Qwen3Config):
    """Boxed (LogicallyPartitioned) abstract params: shapes, dtypes and logical axes; nothing allocated."""
    model = Qwen3(cfg.replace(attention="xla"))  # any attention has the same params; this one is cheapest
    tokens = jnp.zeros((1, 1), jnp.int32)
    ctx = _no_cache_context(cfg, jnp.zeros((1, 1), jnp.int32), None)
    return jax.eval_shape(lambda key: model.init(key, tokens, ctx, None)["params"], jax.random.key(0))


def logical_axes(cfg: Qwen3Config):
    """A pytree like params whose leaves are tuples of logical axis names."""
    boxed = abstract_params(cfg)
    return jax.tree.map(lambda p: tuple(p.names), boxed, is_leaf=lambda p: isinstance(p, nn.LogicallyPartitioned))


def init_params(cfg: Qwen3Config, key: jax.Array):
    """Random params (unboxed) — for tests and from-scratch tiny models."""
    model = Qwen3(cfg.replace(attention="xla"))  # any attention has the same params; this one is cheapest
    tokens = jnp.zeros((1, 1), jnp.int32)
    ctx = _no_cache_context(cfg, jnp.zeros((1, 1), jnp.int32), None)
    return nn.meta.unbox(model.init(key, tokens, ctx, None)["params"])


def param_bytes(params) -> int:
    return int(sum(np.prod(p.shape) * jnp.dtype(p.dtype).itemsize for p in jax.tree.leaves(params)))


forward_jit = jax.jit(forward, static_argnames=("cfg", "return_hidden", "in_place", "attention", "return_routing"))
