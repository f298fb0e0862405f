"""Group-relative advantages for GRPO.

Groups are described by an id per sample rather than by a [groups, n] reshape, so the
layout is free: rollouts of a task need not be contiguous, groups may differ in size
(e.g. after dynamic sampling dropped some rollouts, or when padding rows were added to
fill a batch).
"""
from __future__ import annotations

import numbers
from functools import partial

import jax
import jax.numpy as jnp

ADVANTAGE_SCALES = ("std", "none")


def _check_options(rewards, group_ids, num_groups, scale, eps) -> None:
    # Runs at trace time: every argument checked here is static or a shape.
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {rewards.shape}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have the shape of rewards {rewards.shape}, got {group_ids.shape}")
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")


@partial(jax.jit, static_argnames=("num_groups", "scale", "eps"))
def group_advantages(rewards, group_ids, num_groups, *, scale="std", eps=1e-6):
    """GRPO advantages: (r - group mean) / (group unbiased std + eps), or r - group mean.

    Args:
      rewards: float[B].
      group_ids: int[B]; rows sharing an id form a group. Ids outside [0, num_groups)
        mark rows that belong to no group (padding); their advantage is 0.
      num_groups: static upper bound on the number of groups.
      scale: "std" divides by the group's unbiased std + eps (GRPO); "none" does not
        (Dr. GRPO).
      eps: added to the std, not to the variance, as in the paper and verl.

    Returns float32[B]. A group of one sample, or whose rewards are all equal, gets
    exactly 0: the mean of n equal float32 values need not round back to the value, so
    this is enforced explicitly rather than left to the subtraction.
    """
    _check_options(rewards, group_ids, num_groups, scale, eps)
    rewards = rewards.astype(jnp.float32)
    group_ids = group_ids.astype(jnp.int32)
    in_range = (group_ids >= 0) & (group_ids < num_groups)
    # segment_sum drops out-of-range ids; the gathers below would clamp them into a real
    # group, so gather with a safe index and zero those rows at the end.
    safe_ids = jnp.where(in_range, group_ids, 0)

    counts = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=num_groups)
    sums = jax.ops.segment_sum(rewards, group_ids, num_segments=num_groups)
    means = sums / jnp.maximum(counts, 1.0)
    centered = rewards - means[safe_ids]

    # max == min catches both the singleton and the all-equal group without relying on
    # the floating-point mean reproducing the common value.
    gmax = jax.ops.segment_max(rewards, group_ids, num_segments=num_groups)
    gmin = jax.ops.segment_min(rewards, group_ids, num_segments=num_groups)
    degenerate = (gmax == gmin)[safe_ids]

    if scale == "std":
        # Two-pass variance: the one-pass E[x^2] - E[x]^2 cancels badly in float32.
        sq = jax.ops.segment_sum(centered ** 2, group_ids, num_segments=num_groups)
        std = jnp.sqrt(sq / jnp.maximum(counts - 1.0, 1.0))
        advantages = centered / (std[safe_ids] + eps)
    else:
        advantages = centered
    return jnp.where(in_range & ~degenerate, advantages, 0.0)
