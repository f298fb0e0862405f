"""AdamW with global-norm gradient clipping and the two learning-rate schedules the paper uses.

GRPO ran with a constant lr (1e-6); the cold-start SFT with warmup + cosine decay (5e-6).
Weight decay applies to every parameter, norms included, because that is what
`torch.optim.AdamW(model.parameters(), weight_decay=...)` in verl does; pass `decay_mask`
to exclude some.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "warmup_cosine")


def make_schedule(learning_rate: float, schedule: str = "constant", *, warmup_steps: int = 0,
                  total_steps: int | None = None, final_lr_ratio: float = 0.0) -> optax.Schedule:
    """step -> lr. "constant" (after an optional linear warmup from 0) or "warmup_cosine"
    (linear warmup to `learning_rate`, then cosine decay to `final_lr_ratio * learning_rate`
    at `total_steps`)."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if schedule == "constant":
        if warmup_steps == 0:
            return optax.constant_schedule(learning_rate)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, learning_rate, warmup_steps), optax.constant_schedule(learning_rate)],
            [warmup_steps])
    if schedule == "warmup_cosine":
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(f"schedule 'warmup_cosine' needs total_steps > warmup_steps ({warmup_steps}), "
                             f"got total_steps={total_steps}")
        if not 0.0 <= final_lr_ratio <= 1.0:
            raise ValueError(f"final_lr_ratio must be in [0, 1], got {final_lr_ratio}")
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps, decay_steps=total_steps,
            end_value=learning_rate * final_lr_ratio)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The transformation plus its schedule, so the train step can report the lr it used."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule

    def init(self, params):
        return self.tx.init(params)


def make_optimizer(learning_rate: float, *, schedule: str = "constant", warmup_steps: int = 0,
                   total_steps: int | None = None, final_lr_ratio: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                   grad_clip: float | None = 1.0, decay_mask: Any | Callable | None = None,
                   mu_dtype: Any = None) -> Optimizer:
    """clip_by_global_norm(grad_clip) -> AdamW(schedule). `grad_clip=None` disables clipping.

    The schedule is indexed by optax's own update count, which only advances on applied
    updates: a step skipped for non-finite gradients does not consume the schedule.
    """
    b1, b2 = betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {betas}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if grad_clip is not None and not grad_clip > 0:
        raise ValueError(f"grad_clip must be positive or None, got {grad_clip}")
    lr = make_schedule(learning_rate, schedule, warmup_steps=warmup_steps, total_steps=total_steps,
                       final_lr_ratio=final_lr_ratio)
    adam = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask,
                       mu_dtype=None if mu_dtype is None else jnp.dtype(mu_dtype))
    tx = adam if grad_clip is None else optax.chain(optax.clip_by_global_norm(grad_clip), adam)
    return Optimizer(tx, lr)


def optimizer_from_config(cfg, *, total_steps: int | None = None) -> Optimizer:
    """From a `muajax.config.schema.GRPOConfig` or `SFTConfig` (SFT's warmup is a ratio of total_steps)."""
    warmup = getattr(cfg, "warmup_steps", None)
    if warmup is None:
        ratio = getattr(cfg, "warmup_ratio", 0.0)
        warmup = int(round(ratio * total_steps)) if (ratio and total_steps) else 0
    return make_optimizer(
        cfg.learning_rate, schedule=cfg.schedule, warmup_steps=warmup, total_steps=total_steps,
        betas=tuple(getattr(cfg, "betas", (0.9, 0.999))), weight_decay=getattr(cfg, "weight_decay", 0.01),
        grad_clip=getattr(cfg, "grad_clip", 1.0))
