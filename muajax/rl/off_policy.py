"""The off-policy correction of the GRPO loss: decoupled PPO with a truncated importance weight.

Three policies meet in an update of off-policy data (asynchronous rollouts, or an engine whose
numbers differ from the trainer's):
  * the behaviour policy pi_behav, which sampled the tokens: the engine's sampling logprobs,
    the batch's `old_logprobs`;
  * the proximal policy pi_prox, the params the step's update starts from: the logprobs the
    trainer recomputes (`grpo.recompute_old_logprobs`);
  * the current policy pi_theta, being differentiated.

The decoupled loss of a token (AReaL's decoupled PPO; verl's truncated importance sampling,
TIS, applies the same weight) is

    w * L_clip(r),   r = pi_theta / pi_prox,   w = sg(min(pi_prox / pi_behav, cap)),

where L_clip is the ordinary clipped (and dual-clipped) loss of `muajax.rl.losses` with its
ratio taken against the proximal policy: the trust region is around the params the update
starts from, however stale the data, and the importance weight w between proximal and
behaviour policy corrects for sampling from pi_behav. w is a constant of the gradient (stop
gradient) and truncated at `cap` (verl's TIS truncates; AReaL instead drops the tokens above
its cap), which bounds the variance a token sampled far off the proximal policy brings. The
KL to the reference is not weighted (verl adds it outside the policy loss too). The weight is
per token whatever `ratio_level` (with GSPO's sequence ratio too), as verl's token-level TIS.

The statistics are sums (`OFF_POLICY_SUM_KEYS`) that add across microbatches like the loss's
own, except the maxima (keys ending in "_max"), which combine by maximum
(`muajax.rl.step.combine_sums`); `finalize_off_policy` turns them into the logged metrics.
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

OFF_POLICY_SUM_KEYS = ("behav_ratio_sum", "behav_ratio_max", "behav_log_diff_sum")
IS_WEIGHT_SUM_KEYS = ("is_weight_sum", "is_truncated_count")
METRIC_PREFIX = "off_policy/"


def check_cap(cap, behaviour_given: bool) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Real)
                            or not math.isfinite(cap) or cap < 1.0):
        raise ValueError(f"behaviour_is_cap must be None or a number >= 1, got {cap!r}")
    if cap is not None and not behaviour_given:
        raise ValueError("behaviour_is_cap needs behaviour_logprobs (the rollout engine's): the importance weight "
                         "is pi_prox / pi_behav")


def behaviour_weight(prox_logprobs, behaviour_logprobs, mask, cap: float | None, log_clamp: float):
    """(w or None, sums) of a (micro)batch: w [B, T] = sg(min(exp(prox - behav), cap)), 0 off
    the mask; None when `cap` is None (no weight applied). The sums describe the raw ratio
    rho = pi_prox / pi_behav (its log clamped to +-log_clamp, as the policy ratio's) always,
    and the applied weight (its sum, how many tokens the cap truncated) when there is one."""
    f32 = jnp.float32
    # masked before the exp: padding often carries garbage (-inf) logprobs
    log_rho = jnp.where(mask, prox_logprobs.astype(f32) - behaviour_logprobs.astype(f32), 0.0)
    rho = jnp.where(mask, jnp.exp(jnp.clip(log_rho, -log_clamp, log_clamp)), 0.0)
    sums = {"behav_ratio_sum": rho.sum(), "behav_ratio_max": rho.max(initial=0.0),
            "behav_log_diff_sum": jnp.abs(log_rho).sum()}
    if cap is None:
        return None, jax.lax.stop_gradient(sums)
    weight = jnp.minimum(rho, jnp.asarray(cap, f32))
    sums.update(is_weight_sum=weight.sum(), is_truncated_count=(mask & (rho > cap)).astype(f32).sum())
    return jax.lax.stop_gradient(weight), jax.lax.stop_gradient(sums)


def finalize_off_policy(metrics_sums, n_tok) -> dict:
    """The metrics of the (summed) off-policy sums present, each a mean over the unmasked
    tokens `n_tok` (the max excepted): nothing without behaviour logprobs."""
    if "behav_ratio_sum" not in metrics_sums:
        return {}
    out = {"behav_ratio_mean": metrics_sums["behav_ratio_sum"] / n_tok,  # pi_prox / pi_behav, before the cap
           "behav_ratio_max": metrics_sums["behav_ratio_max"],
           "behav_log_diff": metrics_sums["behav_log_diff_sum"] / n_tok}  # mean |log pi_prox - log pi_behav|
    if "is_weight_sum" in metrics_sums:
        out.update(is_weight_mean=metrics_sums["is_weight_sum"] / n_tok,  # the weight applied
                   is_truncated_frac=metrics_sums["is_truncated_count"] / n_tok)  # tokens the cap bit
    return {METRIC_PREFIX + k: v for k, v in out.items()}
