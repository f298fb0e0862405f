"""The mixture-of-experts MLP of a Qwen3-MoE `DecoderLayer` (muajax.models.qwen3_layers): its
weights and the per-layer routing it takes and gives.

Weights of an MoE layer, in place of the dense w_gate / w_up / w_down (stacked over layers by
the layer scan like every other weight):
  router      [D, E]     ("embed", "exp")           HF `mlp.gate.weight` [E, D] transposed
  expert_gate [E, D, F]  ("exp", "embed", "moe_mlp")  gate half of HF `mlp.experts.gate_up_proj`
  expert_up   [E, D, F]  ("exp", "embed", "moe_mlp")  up half of it
  expert_down [E, F, D]  ("exp", "moe_mlp", "embed")  HF `mlp.experts.down_proj` [E, D, F] transposed
with F = `moe_intermediate_size`.

Routing through the model (the same on the layer scan, the in-place cache scan, the unrolled
per-layer path and under `cfg.token_tiles`):
- in: `AttentionContext.routing` [L, B, T, k] int32 or None. Layer l routes token (b, t) to
  `routing[l, b, t]` instead of its router's top k (routing replay; the weights are still the
  router's probabilities at those experts, renormalised as usual).
- out (only when the model is asked, `return_routing`): per layer a `LayerRouting`: the
  experts used [B, T, k] int32 and the load-balancing sums (`muajax.models.moe.MoeStats`) over
  the layer's valid tokens: those with a nonzero segment id when the context has
  `segment_ids` (packing, padding masks), those written into the cache when it has a
  `write_index`, else all. The model stacks them over layers ([L, ...]).
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from muajax.models.moe import MoeStats, RoutingOut, moe_stats, route, stats_terms
from muajax.models.moe_dispatch import expert_ffn


class MoeWeights(NamedTuple):
    router: jax.Array
    gate: jax.Array
    up: jax.Array
    down: jax.Array


class LayerRouting(NamedTuple):
    """One layer's routing out: `experts` [B, T, k] int32 and `stats` (`MoeStats`, sums)."""

    experts: jax.Array
    stats: MoeStats


def declare_moe(module: nn.Module) -> MoeWeights:
    """The MoE layer's weights, declared on `module` (a DecoderLayer) in `cfg.weight_dtype`."""
    cfg = module.cfg
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    dense = nn.initializers.normal(0.02)

    def param(name, shape, axes):
        return module.param(name, nn.with_logical_partitioning(dense, axes), shape, cfg.weight_dtype)

    return MoeWeights(param("router", (d, e), ("embed", "exp")),
                      param("expert_gate", (e, d, f), ("exp", "embed", "moe_mlp")),
                      param("expert_up", (e, d, f), ("exp", "embed", "moe_mlp")),
                      param("expert_down", (e, f, d), ("exp", "moe_mlp", "embed")))


def layer_slice(routing: jax.Array | None, layer: jax.Array) -> jax.Array | None:
    """Layer `layer`'s forced experts [B, T, k] of the model's [L, B, T, k] (None: none)."""
    return None if routing is None else jax.lax.dynamic_index_in_dim(routing, layer, 0, keepdims=False)


def token_valid(ctx, b: int, t: int) -> jax.Array | None:
    """Which of the [B, T] tokens count in the load-balancing statistics (None: all)."""
    if ctx.segment_ids is not None and ctx.segment_ids.shape == (b, t):
        return ctx.segment_ids != 0
    if ctx.write_index is not None and ctx.kv_valid is not None and ctx.write_index.shape == (b, t):
        return ctx.write_index < ctx.kv_valid.shape[-1]
    return None


def moe_mlp(y: jax.Array, weights: MoeWeights, cfg, b: int, t: int, forced: jax.Array | None,
            valid: jax.Array | None, want_routing: bool):
    """The MoE MLP of the layer's normed tokens y ([B*T, D] or [B, T, D]) -> (out [B*T, D],
    LayerRouting or None). `forced` [B, T, k] or None; `valid` [B, T] or None."""
    x = y.reshape(b * t, y.shape[-1])
    routing = route(x, weights.router, cfg, None if forced is None else forced.reshape(b * t, -1))
    # `grouped_experts`, expert-parallel on a mesh with an expert axis (moe_dispatch)
    out = expert_ffn(x, routing.index, routing.weight, weights.gate, weights.up, weights.down)
    if not want_routing:
        return out, None
    stats = moe_stats(routing, None if valid is None else valid.reshape(-1))
    return out, LayerRouting(routing.index.reshape(b, t, -1), stats)


def empty_routing(cfg, b: int, t: int) -> LayerRouting:
    """A zero `LayerRouting` of [B, T] tokens (token tiles fill it tile by tile)."""
    e = cfg.num_experts
    stats = MoeStats(jnp.zeros((e,), jnp.float32), jnp.zeros((e,), jnp.float32), jnp.zeros((), jnp.float32))
    return LayerRouting(jnp.zeros((b, t, cfg.num_experts_per_tok), jnp.int32), stats)


def routing_out(per_layer: LayerRouting | None) -> RoutingOut | None:
    """The model's `RoutingOut` of its layers' `LayerRouting` stacked over layers ([L, ...])."""
    if per_layer is None:
        return None
    fraction, mean_prob = stats_terms(per_layer.stats)
    return RoutingOut(per_layer.experts, fraction, mean_prob, per_layer.stats.tokens)
