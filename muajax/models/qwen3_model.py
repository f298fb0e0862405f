"""The Qwen3 decoder as a Flax module (`Qwen3`): embedding, the layer stack, final norm, LM head.

The layer stack runs under `nn.scan` (one compiled layer body whatever the depth) with an
optional remat policy. Attention scores, softmax and logits-to-logprob math run in float32.

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

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from muajax.models.chunked_attention import ATTENTION_LSE, ATTENTION_OUT
from muajax.models.moe_layer import routing_out
from muajax.models.qwen3_config import Qwen3Config
from muajax.models.qwen3_layers import (
    AttentionContext,
    DecoderLayer,
    LayerCarry,
    declare_param,
    rms_norm,
)
from muajax.models.token_tiles import map_tiles


def _remat_policy(name: str):
    policies = jax.checkpoint_policies
    if name == "full":
        return policies.nothing_saveable
    dots = {"dots": policies.checkpoint_dots, "dots_no_batch": policies.checkpoint_dots_with_no_batch_dims}[name]
    # chunked attention's output and log-sum-exp too: O(T) per layer, and without them the
    # backward runs the attention forward a second time to rebuild them
    return policies.save_from_both_policies(dots, policies.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE))


class Qwen3(nn.Module):
    """`__call__(tokens, ctx, cache_kv, logits_index)` -> (logits or hidden, new cache k/v), and
    with `return_routing` a third item: a mixture of experts' `moe.RoutingOut` (experts
    [L, B, T, k] and the load-balancing terms [L, E]; None for a dense model). Forced experts
    come in as `ctx.routing` [L, B, T, k] (see `muajax.models.moe_layer`).

    `in_place` carries the cache through the layer scan (inference) instead of slicing it
    as the scan's xs/ys (autodiff). Prefer the functional `forward` below, which builds the
    attention context.
    """

    cfg: Qwen3Config
    cache_attention: Any = None  # see DecoderLayer

    @nn.compact
    def __call__(self, tokens, ctx: AttentionContext, cache_kv, logits_index=None, return_hidden=False,
                 in_place=False, layer_params=None, return_routing=False):
        cfg = self.cfg
        dt = cfg.compute_dtype
        embed = declare_param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("embed_vocab", "embed"),
                              nn.initializers.normal(0.02))
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
        )(cfg, self.cache_attention, return_routing, name="layers")
        if layer_params is not None:  # unrolled over per-layer weights and caches (see `forward`)
            x, new_cache, routing = self._unrolled(x, ctx, cache_kv, layer_params, return_routing)
        elif in_place and cache_kv is not None:
            carry, (_, routing) = stack(LayerCarry(x, cache_kv, jnp.int32(0)), None, ctx)
            x, new_cache = carry.x, carry.stacked
        else:
            carry, (new_cache, routing) = stack(LayerCarry(x, None, jnp.int32(0)), cache_kv, ctx)
            x = carry.x
        final_norm = declare_param(self, "final_norm", (cfg.hidden_size,), ("norm",), nn.initializers.ones)
        head = embed.T if cfg.tie_word_embeddings else declare_param(
            self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), nn.initializers.normal(0.02))
        logits = self._head(final_norm, head, x, ctx, logits_index, return_hidden)
        return (logits, new_cache, routing_out(routing)) if return_routing else (logits, new_cache)

    def _unrolled(self, x, ctx, cache_kv, layer_params, return_routing):
        """The layers one by one on their own weights and caches: (x, new cache, routing)."""
        per_layer, routings = [], []
        for index, (weights, *layer_cache) in enumerate(zip(layer_params, *cache_kv)):
            carry = LayerCarry(x, None, jnp.int32(index))
            layer = DecoderLayer(self.cfg, self.cache_attention, return_routing)
            if self.cache_attention is None:
                carry, (layer_cache, routing) = layer.apply({"params": weights}, carry, tuple(layer_cache), ctx)
            else:  # the hook reads and returns this layer's own cache parts as its `stacked`
                carry, (_, routing) = layer.apply({"params": weights}, carry._replace(stacked=tuple(layer_cache)),
                                                  None, ctx)
                layer_cache = carry.stacked
            x = carry.x
            per_layer.append(layer_cache)
            routings.append(routing)
        stacked = None if routings[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *routings)
        return x, tuple(map(tuple, zip(*per_layer))), stacked

    def _head(self, final_norm, head, x, ctx, logits_index, return_hidden):
        """The final norm and the LM head (logits), or the normed hidden states."""
        cfg = self.cfg
        if cfg.token_tiles and not return_hidden:  # the norm and the head a tile at a time
            x = x if logits_index is None else jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
            flat = x.reshape(-1, x.shape[-1])
            fn = lambda a: (lm_head(rms_norm(a, final_norm, cfg.rms_norm_eps), head, cfg),)
            return map_tiles(cfg.token_tiles, ctx.live_tiles, fn, flat)[0].reshape(*x.shape[:-1], -1)
        x = rms_norm(x, final_norm, cfg.rms_norm_eps)
        if logits_index is not None:  # only the rows' chosen positions need a [V]-wide head
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        if return_hidden:
            return x
        logits = lm_head(x, head, cfg)
        return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))


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
