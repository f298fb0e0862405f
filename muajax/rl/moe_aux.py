"""The router's load-balancing loss in the train steps of a mixture-of-experts model.

HF's `Qwen3MoeForCausalLM` adds `router_aux_loss_coef * load_balancing_loss` to its loss, the
loss of Switch Transformer (`muajax.models.moe.load_balancing_loss`): E * sum over experts of
(the share of tokens routed to the expert) * (its mean router probability), both averaged
over all layers' real tokens. The GRPO and SFT steps (`muajax.rl.grpo`, `muajax.rl.sft`) add
the same term to their loss, per microbatch: a microbatch's term is weighted by its share of
the loss's denominator, so with one microbatch the step's loss is exactly
loss + coef * aux. `moe/aux_loss` reports the (weighted) aux loss itself.

The real tokens are each trajectory's tokens up to its last loss token (`real_tokens`): the
tokens the loss reads (a position after a row's last loss token predicts nothing the loss
counts), so padded rows, packed rows and rows with a shared prefix count the same tokens.
The forward marks the others with segment id 0 (`forward_with_routing`): they then attend
only among themselves, which changes nothing of the real tokens' hidden states. A shared
prefix counts once per trajectory, as each trajectory's own forward would count it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from muajax.models.moe import load_balancing_loss
from muajax.models.qwen3 import KVCache, Qwen3Config, forward, init_cache
from muajax.rl.packed_prefix import forward_packed_prefix

AUX_SUM = "moe_aux_sum"  # the metric sums' key: the aux loss times the microbatch's denominator
METRIC = "moe/aux_loss"


def wants_aux(cfg: Qwen3Config) -> bool:
    return cfg.is_moe


def real_tokens(loss_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """bool [B, T]: the tokens at or before the last loss token of their trajectory (a row,
    or with `segment_ids` a segment; id 0 is padding). `loss_mask` indexed by token."""
    t = loss_mask.shape[1]
    seg = jnp.ones(loss_mask.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    position = jnp.arange(t, dtype=jnp.int32)
    # the nearest loss token at or after each position, and whether it is in the same trajectory
    nearest = jax.lax.cummin(jnp.where(loss_mask > 0, position, t), axis=1, reverse=True)
    same = jnp.take_along_axis(seg, jnp.minimum(nearest, t - 1), axis=1) == seg
    return (nearest < t) & same & (seg != 0)


def _combine(parts):
    """[(fraction [L, E], mean_prob [L, E], token count)] -> the count-weighted (fraction, mean_prob)."""
    total = jnp.maximum(sum(n for _, _, n in parts), 1.0)
    fraction = sum(f * n for f, _, n in parts) / total
    return fraction, sum(p * n for _, p, n in parts) / total


def _segment_starts(seg: jax.Array) -> jax.Array:
    """How many segments (nonzero ids, each a run) the rows hold."""
    first = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return jnp.sum(first & (seg != 0)).astype(jnp.float32)


def _shared_prefix(params, cfg: Qwen3Config, tokens, prefix_len: int, valid, routing=None):
    """`forward_shared_prefix` with routing out: the prefix once, then every row's own tokens
    (its real ones as its new tokens, so the statistics count those). `routing` [L, B, T, k]:
    forced experts (the prefix's those of row 0)."""
    forced = (None, None) if routing is None else (routing[:, :1, :prefix_len], routing[:, :, prefix_len:])
    b, t = tokens.shape
    cache = init_cache(cfg, 1, t)
    h_prefix, cache, r_prefix = forward(params, cfg, tokens[:1, :prefix_len], cache=cache, return_hidden=True,
                                        in_place=False, attention=cfg.attention, return_routing=True,
                                        routing=forced[0])
    shape = (cfg.num_layers, b) + cache.k.shape[2:]
    cache = KVCache(jnp.broadcast_to(cache.k, shape), jnp.broadcast_to(cache.v, shape),
                    jnp.broadcast_to(cache.lengths, (b,)))
    rest = valid[:, prefix_len:]
    h_rest, _, r_rest = forward(params, cfg, tokens[:, prefix_len:], cache=cache, return_hidden=True, in_place=False,
                                attention=cfg.attention, num_new=jnp.sum(rest, axis=1).astype(jnp.int32),
                                return_routing=True, routing=forced[1])
    hidden = jnp.concatenate([jnp.broadcast_to(h_prefix, (b,) + h_prefix.shape[1:]), h_rest], axis=1)
    rows = jnp.sum(jnp.any(rest, axis=1)).astype(jnp.float32)
    terms = _combine([(r_prefix.fraction, r_prefix.mean_prob, rows * prefix_len),
                      (r_rest.fraction, r_rest.mean_prob, jnp.sum(rest).astype(jnp.float32))])
    return hidden, terms


def forward_with_routing(params, cfg: Qwen3Config, tokens, *, valid, shared_prefix: int = 0, segment_ids=None,
                         routing=None):
    """(hidden [B, T, D], (fraction [L, E], mean_prob [L, E])) over the `valid` tokens
    (`real_tokens`): `sequence_logprobs`'s forward of a mixture of experts, with its
    load-balancing terms. `routing` [L, B, T, k]: forced experts (routing replay)."""
    if shared_prefix and segment_ids is not None:
        seg = jnp.where(valid, segment_ids, 0)
        hidden, (r_prefix, r_rest) = forward_packed_prefix(params, cfg, tokens, seg, shared_prefix, return_routing=True,
                                                           routing=routing)
        rest = valid[:, shared_prefix:]
        terms = _combine([(r_prefix.fraction, r_prefix.mean_prob, _segment_starts(seg[:, shared_prefix:]) * shared_prefix),
                          (r_rest.fraction, r_rest.mean_prob, jnp.sum(rest).astype(jnp.float32))])
        return hidden, terms
    if shared_prefix:
        return _shared_prefix(params, cfg, tokens, shared_prefix, valid, routing)
    seg = jnp.where(valid, 1 if segment_ids is None else segment_ids, 0).astype(jnp.int32)
    hidden, _, out = forward(params, cfg, tokens, return_hidden=True, segment_ids=seg, return_routing=True,
                             routing=routing)
    return hidden, (out.fraction, out.mean_prob)


def add_aux(cfg: Qwen3Config, loss_sum, denom, sums: dict, terms):
    """The microbatch's (loss_sum, sums) with coef * aux * denom added to the loss (so the
    step's division by the denominator leaves coef * aux) and the aux loss to the metrics."""
    aux = load_balancing_loss(*terms)
    weighted = aux * jnp.asarray(denom, jnp.float32)
    sums = dict(sums, **{AUX_SUM: jax.lax.stop_gradient(weighted)})
    return loss_sum + cfg.router_aux_loss_coef * weighted, sums


def finalize_aux(denom, sums: dict) -> dict:
    """{"moe/aux_loss": ...} when the sums carry it, else {}."""
    if AUX_SUM not in sums:
        return {}
    return {METRIC: sums[AUX_SUM] / jnp.maximum(denom, 1.0)}
