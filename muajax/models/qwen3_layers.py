"""One Qwen3 decoder layer (`DecoderLayer`) and the pieces it is built from.

Per layer: RMSNorm -> grouped-query attention (per-head RMSNorm on q and k, then RoPE)
-> residual -> RMSNorm -> SwiGLU MLP -> residual.

Cast order follows HF exactly: RMSNorm normalises in float32 and casts back before the
weight multiply; RoPE tables are built in float32 then cast to the compute dtype.
Attention itself is `muajax.models.attention` (`cfg.attention`: xla, chunked, splash,
cudnn or auto).

Every weight and activation carries logical axis names (`embed`, `q_heads`, `mlp`, ...);
`muajax.parallel` maps them onto mesh axes.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from muajax.models.attention import attention
from muajax.models.context_parallel import sequence_split
from muajax.models.moe_layer import declare_moe, empty_routing, layer_slice, moe_mlp, token_valid
from muajax.models.qwen3_config import Qwen3Config
from muajax.models.token_tiles import tiled_layer


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, head_dim], built in float32 like HF, then cast."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, head_dim]; HF's rotate_half convention (halves, not interleaved)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class AttentionContext(NamedTuple):
    """What every layer needs besides its weights, shared (broadcast) across the scan.

    q_index [B, T]: each query's index in the key sequence (its cache slot); None without
        a cache (causal self-attention: query t sees keys <= t).
    kv_valid [B, S]: which key slots hold real tokens after this chunk is written (cache only).
    write_index [B, T]: where each new token's k/v goes in the cache (out of range = dropped).
    cos, sin [B, T, head_dim]: rotary tables at the queries' absolute positions.
    segment_ids [B, T]: without a cache, attention stays within equal ids (packing, padding).
    pages: whatever a `cache_attention` hook reads (e.g. a paged cache's page tables); None otherwise.
    live_tiles: with `cfg.token_tiles`, the tiles per shard that hold tokens (int32 scalar);
        the others are not computed (see `tiled_layer`).
    routing [L, B, T, k] int32: mixture of experts only, each token's experts per layer to use
        instead of the router's choice (routing replay; see `muajax.models.moe_layer`).
    """

    q_index: jax.Array | None
    kv_valid: jax.Array | None
    write_index: jax.Array | None
    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array | None = None
    pages: Any = None
    live_tiles: jax.Array | None = None
    routing: jax.Array | None = None


def declare_param(module: nn.Module, name: str, shape, axes, init):
    """`module`'s weight `name` in `cfg.weight_dtype`, tagged with its logical axes for sharding."""
    cfg = module.cfg
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, cfg.weight_dtype)


class LayerCarry(NamedTuple):
    """The scan carry: the residual stream and, for in-place caching, the stacked cache
    (k, v [L, B, S, K, H]) with the index of the layer about to run."""

    x: jax.Array
    stacked: tuple[jax.Array, jax.Array] | None
    layer: jax.Array


class DecoderLayer(nn.Module):
    """`cache_attention`, if set, replaces the cache write and the attention: called as
    `(q [B,T,N,H], k, v [B,T,K,H], cache, layer index, ctx) -> (out [B,T,N,H], cache)` with the
    cache carried through the layers (`in_place`); a paged cache (muajax.engine) plugs in here.

    Returns (carry, (new layer cache or None, routing)): `routing` is the layer's
    `moe_layer.LayerRouting` when `return_routing` is set on a mixture of experts, else None."""

    cfg: Qwen3Config
    cache_attention: Any = None
    return_routing: bool = False

    @nn.compact
    def __call__(self, carry: LayerCarry, layer_cache: tuple[jax.Array, jax.Array] | None, ctx: AttentionContext):
        """`layer_cache`: this layer's (k, v) [B, K, S, H] slice as a scan x (returned updated as
        the scan y), or None: no cache, or the stacked cache in `carry` (updated in place)."""
        cfg = self.cfg
        x, stacked = carry.x, carry.stacked
        dt = cfg.compute_dtype
        d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        dense = nn.initializers.normal(0.02)
        ones = nn.initializers.ones

        attn_norm = declare_param(self, "attn_norm", (d,), ("norm",), ones)
        wq = declare_param(self, "wq", (d, n, h), ("embed", "q_heads", "head_dim"), dense)
        wk = declare_param(self, "wk", (d, k, h), ("embed", "kv_heads", "head_dim"), dense)
        wv = declare_param(self, "wv", (d, k, h), ("embed", "kv_heads", "head_dim"), dense)
        wo = declare_param(self, "wo", (n, h, d), ("q_heads", "head_dim", "embed"), dense)
        q_norm = declare_param(self, "q_norm", (h,), ("head_dim",), ones)
        k_norm = declare_param(self, "k_norm", (h,), ("head_dim",), ones)
        mlp_norm = declare_param(self, "mlp_norm", (d,), ("norm",), ones)
        if cfg.is_moe:  # the experts and their router (muajax.models.moe_layer)
            experts = declare_moe(self)
            ctx = ctx._replace(routing=layer_slice(ctx.routing, carry.layer))  # [B, T, k] from here on
        else:
            w_gate = declare_param(self, "w_gate", (d, f), ("embed", "mlp"), dense)
            w_up = declare_param(self, "w_up", (d, f), ("embed", "mlp"), dense)
            w_down = declare_param(self, "w_down", (f, d), ("mlp", "embed"), dense)

        # Projections run on the tokens as one [B*T, ...] axis (a free reshape): with B and T
        # as two dims, each weight gradient contracts over both, and XLA:CPU transposes the
        # [B, T, F] activations to feed it, measured 1.4x slower on the MLP's forward+backward.
        # Not when a mesh's sequence axis splits the rows: a [B*T] axis sharded over batch and
        # sequence holds whole rows where [B, T] holds parts of several, and every layer
        # would move its activations between the two.
        flat = cfg.token_tiles or sequence_split(jax.sharding.get_abstract_mesh(), x.shape[1]) == 1
        row_axes = ("activation_tokens",) if flat else ("activation_batch", "activation_length")
        # a tile's slice has no logical axes of its own: no constraints inside tiles
        constrain = (lambda a, axes: a) if cfg.token_tiles else nn.with_logical_constraint
        tokens = lambda a: constrain(a.reshape(-1, a.shape[-1]) if flat else a, (*row_axes, None))
        project = lambda a, w: jnp.einsum("...i,io->...o", a, w.astype(dt).reshape(a.shape[-1], -1))

        def pre_attention(x, cos, sin):
            b, t = x.shape[:2]
            y = tokens(rms_norm(x, attn_norm, cfg.rms_norm_eps))
            q = project(y, wq).reshape(b, t, n, h)
            kk = project(y, wk).reshape(b, t, k, h)
            vv = project(y, wv).reshape(b, t, k, h)
            q = constrain(q, ("activation_batch", "activation_length", "activation_heads", "head_dim"))
            q = apply_rope(rms_norm(q, q_norm, cfg.rms_norm_eps), cos, sin)
            return q, apply_rope(rms_norm(kk, k_norm, cfg.rms_norm_eps), cos, sin), vv

        def post_attention(x, attn, sub):
            """-> (x, routing): `sub` is the context of these rows (a tile's under token tiles)."""
            b, t = x.shape[:2]
            x = x + project(attn.reshape(*((b * t,) if flat else (b, t)), n * h), wo).reshape(b, t, d)
            x = constrain(x, ("activation_batch", "activation_length", "activation_embed"))
            y = tokens(rms_norm(x, mlp_norm, cfg.rms_norm_eps))
            routing = None
            if cfg.is_moe:
                out, routing = moe_mlp(y, experts, cfg, b, t, sub.routing, token_valid(sub, b, t),
                                       self.return_routing)
            else:
                hidden = nn.silu(project(y, w_gate)) * project(y, w_up)
                out = project(constrain(hidden, (*row_axes, "activation_mlp")), w_down)
            x = x + out.reshape(b, t, d)
            return constrain(x, ("activation_batch", "activation_length", "activation_embed")), routing

        want_routing = cfg.is_moe and self.return_routing
        if cfg.token_tiles:  # the layer one tile at a time (token_tiles.py)
            rope = lambda q_index: rope_tables(q_index, h, cfg.rope_theta, dt)
            extra = empty_routing(cfg, *x.shape[:2]) if want_routing else None
            x, stacked, routing = tiled_layer(cfg.token_tiles, rope, pre_attention, post_attention,
                                              self.cache_attention, x, stacked, carry.layer, ctx, extra)
            return LayerCarry(x, stacked, carry.layer + 1), (None, routing)
        q, kk, vv = pre_attention(x, ctx.cos, ctx.sin)
        new_cache = None
        if self.cache_attention is not None:
            attn, stacked = self.cache_attention(q, kk, vv, stacked, carry.layer, ctx)
        else:
            attn, stacked, new_cache = _attend(cfg, q, kk, vv, stacked, layer_cache, carry.layer, ctx)
        x, routing = post_attention(x, attn, ctx)
        return LayerCarry(x, stacked, carry.layer + 1), (new_cache, routing)


def _attend(cfg, q, kk, vv, stacked, layer_cache, layer, ctx):
    """Attention without a hook: the chunk's k/v written into the stacked cache (in place),
    the layer's cache slice (returned as the new slice) or no cache. -> (out, stacked, new slice)."""
    dt = cfg.compute_dtype
    new_cache = None
    if stacked is not None:
        stacked = _write_stacked(stacked, layer, kk, vv, ctx.write_index)
        keys, values = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False).astype(dt) for c in stacked)
    elif layer_cache is not None:
        keys, values = _write_cache(layer_cache, kk, vv, ctx.write_index)
        new_cache = (keys, values)
        keys, values = keys.astype(dt), values.astype(dt)
    else:
        keys, values = kk.transpose(0, 2, 1, 3), vv.transpose(0, 2, 1, 3)
    attn = attention(q, keys, values, implementation=cfg.attention, segment_ids=ctx.segment_ids,
                     q_index=ctx.q_index, kv_valid=ctx.kv_valid)
    return attn, stacked, new_cache


def _write_cache(layer_cache, k_new, v_new, write_index):
    """Scatter the chunk's k/v [B, T, K, H] into each row at that row's own offsets; padding
    is dropped. (Indices split by a slice put their broadcast dims [B, T] first.)"""
    k_cache, v_cache = layer_cache
    rows = jnp.arange(k_new.shape[0])[:, None]
    k_cache = k_cache.at[rows, :, write_index].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, :, write_index].set(v_new.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def _write_stacked(stacked, layer, k_new, v_new, write_index):
    """`_write_cache` into layer `layer` of the whole stacked cache (an in-place scatter)."""
    k_cache, v_cache = stacked
    rows = jnp.arange(k_new.shape[0])[:, None]
    k_cache = k_cache.at[layer, rows, :, write_index].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, rows, :, write_index].set(v_new.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache
