"""Qwen3 dense decoder in Flax Linen, computing what HF's `Qwen3ForCausalLM` computes.

Per layer: RMSNorm -> grouped-query attention (per-head RMSNorm on q and k, then RoPE)
-> residual -> RMSNorm -> SwiGLU MLP -> residual. The layer stack runs under `nn.scan`
(one compiled layer body whatever the depth) with an optional remat policy.

Cast order follows HF exactly: RMSNorm normalises in float32 and casts back before the
weight multiply; RoPE tables are built in float32 then cast to the compute dtype.
Attention scores, softmax and logits-to-logprob math run in float32. Attention itself is
`muajax.models.attention` (`cfg.attention`: xla, chunked, splash, cudnn or auto).

Every weight and activation carries logical axis names (`embed`, `q_heads`, `mlp`, ...);
`muajax.parallel` maps them onto mesh axes.

The KV cache (`KVCache`) is explicit and functional: `forward` takes a cache and returns
the updated one. Each row has its own length; a chunk of new tokens is written at each
row's own offset, so one call serves ragged extend (a user/tool turn appended to every
conversation) and single-token decode alike.

Inference passes the whole stacked cache through the layer scan's carry and each layer
scatters its chunk into it at its own layer index: XLA updates the (donated) buffer in
place. Passing per-layer slices as the scan's xs/ys instead re-stacks the outputs, a copy
of the whole cache per call, most of a small model's decode step. Differentiated callers
(`forward_shared_prefix`) keep the xs/ys form: under autodiff and remat a carried cache
would be saved whole at every layer. The engine's decode loop uses a third form
(`KVCache.per_layer`): layers unrolled over separate per-layer cache and weight buffers,
because XLA on CPU copies any slice of a stacked array that feeds a dot.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from muajax.models.attention import IMPLEMENTATIONS, attention
from muajax.models.chunked_attention import ATTENTION_LSE, ATTENTION_OUT
from muajax.models.context_parallel import sequence_split

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    # Training and full-sequence attention (`muajax.models.attention`); a forward over a KV
    # cache (the engine's extend and decode) uses "xla" unless told otherwise.
    attention: str = "auto"
    # The LM head in float32 (products of bfloat16 values are exact in float32, so with
    # bfloat16 operands only the accumulation changes; see `lm_head`).
    logits_fp32: bool = False

    def __post_init__(self):
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"Qwen3Config.{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"Qwen3Config.remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"Qwen3Config.attention={self.attention!r}: expected one of {IMPLEMENTATIONS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Qwen3Config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    def replace(self, **changes) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * h
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * d + d + head


class KVCache(NamedTuple):
    """k, v: [layers, batch, kv_heads, max_len, head_dim]; lengths: [batch] valid tokens per row.

    Heads come before positions so that one layer's keys and values are already in the
    [batch, kv_heads, positions, head_dim] layout the attention dots consume: with
    positions first, XLA transposed every layer's whole cache on every decode step."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return (self.k[0] if isinstance(self.k, tuple) else self.k).shape[-2]

    @property
    def per_layer(self) -> bool:
        """k and v are tuples of per-layer [batch, kv_heads, max_len, head_dim] arrays."""
        return isinstance(self.k, tuple)


CACHE_AXES = ("layers", "cache_batch", "cache_kv_heads", "cache_length", "head_dim")


def cache_shape(cfg: Qwen3Config, batch: int, max_len: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    dtype = cfg.compute_dtype if dtype is None else dtype
    shape = cache_shape(cfg, batch, max_len)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


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
    """

    q_index: jax.Array | None
    kv_valid: jax.Array | None
    write_index: jax.Array | None
    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array | None = None
    pages: Any = None


def _param(module: nn.Module, name: str, shape, axes, init):
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
    cache carried through the layers (`in_place`); a paged cache (muajax.engine) plugs in here."""

    cfg: Qwen3Config
    cache_attention: Any = None

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

        attn_norm = _param(self, "attn_norm", (d,), ("norm",), ones)
        wq = _param(self, "wq", (d, n, h), ("embed", "q_heads", "head_dim"), dense)
        wk = _param(self, "wk", (d, k, h), ("embed", "kv_heads", "head_dim"), dense)
        wv = _param(self, "wv", (d, k, h), ("embed", "kv_heads", "head_dim"), dense)
        wo = _param(self, "wo", (n, h, d), ("q_heads", "head_dim", "embed"), dense)
        q_norm = _param(self, "q_norm", (h,), ("head_dim",), ones)
        k_norm = _param(self, "k_norm", (h,), ("head_dim",), ones)
        mlp_norm = _param(self, "mlp_norm", (d,), ("norm",), ones)
        w_gate = _param(self, "w_gate", (d, f), ("embed", "mlp"), dense)
        w_up = _param(self, "w_up", (d, f), ("embed", "mlp"), dense)
        w_down = _param(self, "w_down", (f, d), ("mlp", "embed"), dense)

        # Projections run on the tokens as one [B*T, ...] axis (a free reshape): with B and T
        # as two dims, each weight gradient contracts over both, and XLA:CPU transposes the
        # [B, T, F] activations to feed it, measured 1.4x slower on the MLP's forward+backward.
        # Not when a mesh's sequence axis splits the rows: a [B*T] axis sharded over batch and
        # sequence holds whole rows where [B, T] holds parts of several, and every layer
        # would move its activations between the two.
        b, t = x.shape[:2]
        if sequence_split(jax.sharding.get_abstract_mesh(), t) == 1:
            rows, row_axes = (b * t,), ("activation_tokens",)
        else:
            rows, row_axes = (b, t), ("activation_batch", "activation_length")
        tokens = lambda a: nn.with_logical_constraint(a.reshape(*rows, a.shape[-1]), (*row_axes, None))
        project = lambda a, w: jnp.einsum("...i,io->...o", a, w.astype(dt).reshape(a.shape[-1], -1))
        y = tokens(rms_norm(x, attn_norm, cfg.rms_norm_eps))
        q = project(y, wq).reshape(b, t, n, h)
        kk = project(y, wk).reshape(b, t, k, h)
        vv = project(y, wv).reshape(b, t, k, h)
        q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", "head_dim"))
        q = apply_rope(rms_norm(q, q_norm, cfg.rms_norm_eps), ctx.cos, ctx.sin)
        kk = apply_rope(rms_norm(kk, k_norm, cfg.rms_norm_eps), ctx.cos, ctx.sin)

        new_cache = None
        if self.cache_attention is not None:
            attn, stacked = self.cache_attention(q, kk, vv, stacked, carry.layer, ctx)
        elif stacked is not None:
            stacked = _write_stacked(stacked, carry.layer, kk, vv, ctx.write_index)
            keys, values = (jax.lax.dynamic_index_in_dim(c, carry.layer, 0, keepdims=False).astype(dt)
                            for c in stacked)
        elif layer_cache is not None:
            keys, values = _write_cache(layer_cache, kk, vv, ctx.write_index)
            new_cache = (keys, values)
            keys, values = keys.astype(dt), values.astype(dt)
        else:
            keys, values = kk.transpose(0, 2, 1, 3), vv.transpose(0, 2, 1, 3)
        if self.cache_attention is None:
            attn = attention(q, keys, values, implementation=cfg.attention, segment_ids=ctx.segment_ids,
                             q_index=ctx.q_index, kv_valid=ctx.kv_valid)
        x = x + project(attn.reshape(*rows, n * h), wo).reshape(b, t, d)
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))

        y = tokens(rms_norm(x, mlp_norm, cfg.rms_norm_eps))
        hidden = nn.silu(project(y, w_gate)) * project(y, w_up)
        hidden = nn.with_logical_constraint(hidden, (*row_axes, "activation_mlp"))
        x = x + project(hidden, w_down).reshape(b, t, d)
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
        return LayerCarry(x, stacked, carry.layer + 1), new_cache


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


def _remat_policy(name: str):
    policies = jax.checkpoint_policies
    if name == "full":
        return policies.nothing_saveable
    dots = {"dots": policies.checkpoint_dots, "dots_no_batch": policies.checkpoint_dots_with_no_batch_dims}[name]
    # chunked attention's output and log-sum-exp too: O(T) per layer, and without them the
    # backward runs the attention forward a second time to rebuild them
    return policies.save_from_both_policies(dots, policies.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE))


class Qwen3(nn.Module):
    """`__call__(tokens, ctx, cache_kv, logits_index)` -> (logits or hidden, new cache k/v).

    `in_place` carries the cache through the layer scan (inference) instead of slicing it
    as the scan's xs/ys (autodiff). Prefer the functional `forward` below, which builds the
    attention context.
    """

    cfg: Qwen3Config
    cache_attention: Any = None  # see DecoderLayer

    @nn.compact
    def __call__(self, tokens, ctx: AttentionContext, cache_kv, logits_index=None, return_hidden=False,
                 in_place=False, layer_params=None):
        cfg = self.cfg
        dt = cfg.compute_dtype
        embed = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("embed_vocab", "embed"), nn.initializers.normal(0.02))
        # The lookup reads a table whose width is split over fsdp alone, and its result moves
        # to rows over fsdp before positions over sequence: XLA makes each step one all-to-all
        # or a local slice, where going straight from a width split over fsdp and sequence to
        # rows and positions it replicates the whole [B, T, D] on every device instead.
        table = nn.with_logical_constraint(embed, ("embed_vocab", "embed_lookup"))
        x = jnp.take(table, tokens, axis=0).astype(dt)
        x = nn.with_logical_constraint(x, ("activation_batch", None, "activation_embed"))
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))

        layer_cls = DecoderLayer
        if cfg.remat != "none":
            layer_cls = nn.remat(DecoderLayer, policy=_remat_policy(cfg.remat), prevent_cse=False)
        stack = nn.scan(
            layer_cls,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, self.cache_attention, name="layers")
        if layer_params is not None:  # unrolled over per-layer weights and caches (see `forward`)
            per_layer = []
            for index, (weights, *layer_cache) in enumerate(zip(layer_params, *cache_kv)):
                carry = LayerCarry(x, None, jnp.int32(index))
                if self.cache_attention is None:
                    carry, layer_cache = DecoderLayer(cfg).apply({"params": weights}, carry, tuple(layer_cache), ctx)
                else:  # the hook reads and returns this layer's own cache parts as its `stacked`
                    carry, _ = DecoderLayer(cfg, self.cache_attention).apply(
                        {"params": weights}, carry._replace(stacked=tuple(layer_cache)), None, ctx)
                    layer_cache = carry.stacked
                x = carry.x
                per_layer.append(layer_cache)
            new_cache = tuple(map(tuple, zip(*per_layer)))
        elif in_place and cache_kv is not None:
            carry, _ = stack(LayerCarry(x, cache_kv, jnp.int32(0)), None, ctx)
            x, new_cache = carry.x, carry.stacked
        else:
            carry, new_cache = stack(LayerCarry(x, None, jnp.int32(0)), cache_kv, ctx)
            x = carry.x

        final_norm = _param(self, "final_norm", (cfg.hidden_size,), ("norm",), nn.initializers.ones)
        x = rms_norm(x, final_norm, cfg.rms_norm_eps)
        if logits_index is not None:  # only the rows' chosen positions need a [V]-wide head
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        if return_hidden:
            return x, new_cache
        if cfg.tie_word_embeddings:
            head = embed.T
        else:
            head = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                          nn.initializers.normal(0.02))
        logits = lm_head(x, head, cfg)
        logits = nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))
        return logits, new_cache


def lm_head(x: jax.Array, head: jax.Array, cfg: Qwen3Config) -> jax.Array:
    """Logits [..., V] of hidden states x [..., D] through head [D, V]: in the compute dtype,
    or with `cfg.logits_fp32` in float32. bfloat16 operands then stay bfloat16 with a float32
    result (their products are exact in float32: one MXU pass on TPU, no float32 copy of the
    head); any float32 operand makes the dot float32 at full precision."""
    dt = cfg.compute_dtype
    if not cfg.logits_fp32:
        return jnp.einsum("...D,DV->...V", x, head.astype(dt))
    if x.dtype == head.dtype and jnp.dtype(x.dtype).itemsize < 4:
        return jnp.einsum("...D,DV->...V", x, head, preferred_element_type=jnp.float32)
    return jnp.einsum("...D,DV->...V", x.astype(jnp.float32), head.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


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
):
    """Run the model. Returns (logits [B, T or P, V], new cache or None).

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
    decode; paged attention is the engine's own concern).
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
        ctx = _no_cache_context(cfg, positions, attention_mask, segment_ids)
        out, _ = model.apply({"params": params}, tokens, ctx, None, logits_index, return_hidden)
        return out, None
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    ctx = _cache_context(cfg, cache, num_new.astype(jnp.int32), t)
    if cache.per_layer and layer_params is None:
        layer_params = split_layers(params, cfg.num_layers)
    out, (k, v) = model.apply({"params": params}, tokens, ctx, (cache.k, cache.v), logits_index, return_hidden,
                              in_place, layer_params if cache.per_layer else None)
    return out, KVCache(k, v, cache.lengths + num_new.astype(jnp.int32))


def split_layers(params, num_layers: int) -> list:
    """Layer i's weights of the stacked `params["layers"]`, as a list of per-layer trees."""
    return [jax.tree.map(lambda p, i=i: p[i], params["layers"]) for i in range(num_layers)]


def forward_shared_prefix(params, cfg: Qwen3Config, tokens: jax.Array, prefix_len: int) -> jax.Array:
    """Hidden states [B, T, D] equal to `forward(..., return_hidden=True)` for a batch whose
    rows all begin with the same `prefix_len` tokens (e.g. the system prompt with policy and
    tools, which dominates short agent conversations): the prefix runs once, for one row,
    into a KV cache that every row then extends with its own tokens. Differentiable; the
    prefix's gradient is the sum over rows, as in the full forward. Attention is
    `cfg.attention` in its cache form (`chunked` where splash or cudnn was asked for).
    """
    b, t = tokens.shape
    if not 0 < prefix_len < t:
        raise ValueError(f"prefix_len={prefix_len} must be in (0, {t})")
    cache = init_cache(cfg, 1, t)
    h_prefix, cache = forward(params, cfg, tokens[:1, :prefix_len], cache=cache, return_hidden=True,
                              in_place=False, attention=cfg.attention)
    shape = (cfg.num_layers, b) + cache.k.shape[2:]
    cache = KVCache(jnp.broadcast_to(cache.k, shape), jnp.broadcast_to(cache.v, shape),
                    jnp.broadcast_to(cache.lengths, (b,)))
    h_rest, _ = forward(params, cfg, tokens[:, prefix_len:], cache=cache, return_hidden=True, in_place=False,
                        attention=cfg.attention)
    return jnp.concatenate([jnp.broadcast_to(h_prefix, (b,) + h_prefix.shape[1:]), h_rest], axis=1)


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


forward_jit = jax.jit(forward, static_argnames=("cfg", "return_hidden", "in_place", "attention"))
