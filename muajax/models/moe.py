"""Qwen3-MoE's mixture of experts as pure functions (no Flax): routing, the grouped expert
FFN and the router's load-balancing loss, computing what HF's `Qwen3MoeSparseMoeBlock` and
`load_balancing_loss_func` compute.

- `route(x, router, cfg, forced)`: router logits in the compute dtype, softmax in float32,
  the top `num_experts_per_tok` (or the `forced` ones: routing replay), renormalised with
  `norm_topk_prob`, weights cast back to the compute dtype.
- `grouped_experts(x, index, weight, gate, up, down)`: each token's k copies sorted by
  expert, one grouped matmul per projection over the groups (`grouped_matmul`: the native
  `ragged_dot` forward on TPU and GPU, blocks of rows on CPU, and a blocked weight gradient
  everywhere), SwiGLU, the weights, and each token's k results added in ascending expert
  order from zero (HF's `index_add_` order). No all-experts compute in the program, forward
  or backward. A token's output does not depend on the other tokens of the call
  (tests/models/test_moe.py checks it).
- `load_balancing_terms(probs, index, valid)` -> (fraction [E], mean_prob [E]) of one layer
  and `load_balancing_loss(fraction [L, E], mean_prob [L, E])`: HF's loss (Switch
  Transformer eq. 4-6), `num_experts * sum(fraction * mean_prob)` with both averaged over all
  layers' valid tokens. The trainer adds `cfg.router_aux_loss_coef` times it.

`moe_stats` / `RoutingOut` carry what the model returns per layer (see
`muajax.models.qwen3.forward(..., routing=..., return_routing=True)`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from muajax.models.grouped_matmul import grouped_matmul


class Routing(NamedTuple):
    """One layer's routing of N tokens: experts `index` [N, k] int32 (top-k order, or the
    forced order), their `weight` [N, k] in the compute dtype, the router's `probs` [N, E] float32."""

    index: jax.Array
    weight: jax.Array
    probs: jax.Array


class MoeStats(NamedTuple):
    """One layer's routing as sums over its valid tokens (additive over token tiles, rows and
    devices): `counts` [E] tokens routed to each expert (a token counts once per chosen
    expert), `prob_sum` [E] the router probabilities summed, `tokens` [] the valid tokens."""

    counts: jax.Array
    prob_sum: jax.Array
    tokens: jax.Array


class RoutingOut(NamedTuple):
    """What `forward(..., return_routing=True)` returns beside the logits and the cache:
    `experts` [L, B, T, k] int32, each token's experts per layer (what `routing=` takes back
    for a replay); `fraction` [L, E] float32, the share of valid tokens routed to each expert
    (a row sums to k); `mean_prob` [L, E] float32, the mean router probability of each expert;
    `tokens` [L] float32, the valid tokens they are over (to combine the terms of several calls).
    `load_balancing_loss(out.fraction, out.mean_prob)` is HF's aux loss."""

    experts: jax.Array
    fraction: jax.Array
    mean_prob: jax.Array
    tokens: jax.Array


def route(x: jax.Array, router: jax.Array, cfg, forced: jax.Array | None = None) -> Routing:
    """x [N, D], router [D, E] (HF's `mlp.gate.weight` transposed). `forced` [N, k] int32: use
    these experts (routing replay); their weights are the router's probabilities at them,
    renormalised as the top-k's would be."""
    logits = jnp.einsum("nd,de->ne", x, router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if forced is None:
        top, index = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    else:
        index = forced.astype(jnp.int32)
        top = jnp.take_along_axis(probs, index, axis=-1)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return Routing(index.astype(jnp.int32), top.astype(x.dtype), probs)


def grouped_experts(x: jax.Array, index: jax.Array, weight: jax.Array, gate: jax.Array, up: jax.Array,
                    down: jax.Array) -> jax.Array:
    """x [N, D], index and weight [N, k], gate and up [E, D, F], down [E, F, D] -> [N, D]:
    sum over k of weight * down(silu(x gate[e]) * x up[e]) for each token's experts e."""
    n, k = index.shape
    num_experts = gate.shape[0]
    dt = x.dtype
    # each token's experts in ascending order: its k results are then added in HF's order
    by_expert = jnp.argsort(index, axis=-1, stable=True)
    index = jnp.take_along_axis(index, by_expert, axis=-1)
    weight = jnp.take_along_axis(weight, by_expert, axis=-1)
    flat = index.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the n*k token copies grouped by expert
    rows = jnp.take(x, order // k, axis=0)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    hidden = jax.nn.silu(grouped_matmul(rows, gate.astype(dt), sizes)) * grouped_matmul(rows, up.astype(dt), sizes)
    out = grouped_matmul(hidden, down.astype(dt), sizes)
    out = out * jnp.take(weight.reshape(-1), order)[:, None]
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(n, k, -1)
    total = jnp.zeros_like(out[:, 0])
    for j in range(k):  # from zero, in ascending expert order, as HF's index_add_ per expert
        total = total + out[:, j]
    return total


def moe_stats(routing: Routing, valid: jax.Array | None = None) -> MoeStats:
    """The layer's `MoeStats` over the tokens where `valid` [N] (None: all)."""
    num_experts = routing.probs.shape[-1]
    v = jnp.ones(routing.index.shape[:1], jnp.float32) if valid is None else valid.astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(routing.index, num_experts, dtype=jnp.float32) * v[:, None, None], axis=(0, 1))
    return MoeStats(counts, jnp.sum(routing.probs * v[:, None], axis=0), jnp.sum(v))


def stats_terms(stats: MoeStats) -> tuple[jax.Array, jax.Array]:
    """(fraction, mean_prob) of `MoeStats` (any leading layer axes): the sums over the tokens."""
    tokens = jnp.maximum(stats.tokens, 1.0)[..., None]
    return stats.counts / tokens, stats.prob_sum / tokens


def load_balancing_terms(probs: jax.Array, index: jax.Array, valid: jax.Array | None = None):
    """One layer's (fraction [E], mean_prob [E]) over the tokens where `valid` [N] (None: all):
    probs [N, E] float32, index [N, k] the experts used."""
    return stats_terms(moe_stats(Routing(index, None, probs), valid))


def combine_routing(parts: list[tuple[RoutingOut, int]], axis: int = 2) -> RoutingOut:
    """One `RoutingOut` of several calls' over consecutive tokens: [(out, repeat)], each
    call's experts broadcast to the first's rows, concatenated along `axis` (2: positions),
    and its terms weighted by its tokens times `repeat` (a shared prefix run once for
    `repeat` rows counts once per row, as the rows' own forward would)."""
    rows = max(out.experts.shape[1] for out, _ in parts)
    experts = jnp.concatenate([jnp.broadcast_to(out.experts, (out.experts.shape[0], rows, *out.experts.shape[2:]))
                               for out, _ in parts], axis=axis)
    tokens = sum(out.tokens * n for out, n in parts)
    weigh = lambda name: sum(getattr(out, name) * (out.tokens * n)[:, None] for out, n in parts) / jnp.maximum(
        tokens, 1.0)[:, None]
    return RoutingOut(experts, weigh("fraction"), weigh("mean_prob"), tokens)


def load_balancing_loss(fraction: jax.Array, mean_prob: jax.Array) -> jax.Array:
    """HF's `load_balancing_loss_func`: E * sum(fraction * mean_prob), each averaged over the
    layers first ([L, E] or one layer's [E]); every layer sees the same tokens, so that is the
    mean over all layers' tokens as HF takes it."""
    if fraction.ndim > 1:
        fraction, mean_prob = fraction.mean(axis=0), mean_prob.mean(axis=0)
    return fraction.shape[-1] * jnp.sum(fraction * mean_prob)
