"""Per-token log-probabilities and entropies from logits, in float32.

Logits are [B, T, V] with V ~ 152k for Qwen3, so a [B, T, V] float32 array is the
largest thing a train step holds. These functions never build log_softmax(logits)
explicitly: they take the log-sum-exp (a [B, T] reduction) and gather the target
logit, so the only [B, T, V] float32 temporary is the upcast of the logits, where XLA
does not fuse it into the reductions (XLA:CPU keeps it; the tests pin that bound). The
gradient is a custom VJP (so forward-mode jvp is unsupported) whose residuals are the
caller's own logits and [B, T] vectors, never a float32 copy.

Alignment is the caller's business: logits[:, t] must already be the prediction for
targets[:, t] (i.e. shift before calling). Targets outside [0, V) (an ignore id at a
masked position, say) are clamped into range: their logprob is finite but meaningless.
"""
from __future__ import annotations

import numbers
from functools import partial

import jax
import jax.numpy as jnp


def _check(logits, targets) -> None:
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {logits.shape}")
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets must be [B, T] = {logits.shape[:2]}, got {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")


def _check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")


def _clamp(targets, logits):
    return jnp.clip(targets.astype(jnp.int32), 0, logits.shape[-1] - 1)


def _scaled(logits, temperature):
    x = logits.astype(jnp.float32)
    # Skip the divide at 1.0 so the common case is bit-identical to no temperature.
    return x if temperature == 1.0 else x / jnp.float32(temperature)


def _logsumexp(x):
    m = jnp.max(x, axis=-1, keepdims=True)
    # An all -inf row has max -inf; shifting by it would give nan.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    return jnp.log(jnp.sum(jnp.exp(x - m), axis=-1)) + m[..., 0]


def _gather(x, targets):
    # XLA's SPMD partitioner splits a gather of a size-1 slice along a sharded axis into
    # local gathers plus a masked all-reduce, so a vocab-sharded LM head stays sharded.
    return jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def _entropy(x, lse):
    # H = -sum p (x - lse). Vocabulary entries masked to -inf have p = 0 and would give
    # 0 * -inf = nan, in the value and, through the exp, in the gradient; keep them out
    # of both (the inner where keeps the unused branch finite).
    finite = jnp.isfinite(x)
    centered = jnp.where(finite, x, 0.0) - lse[..., None]
    p = jnp.exp(x - lse[..., None])
    return -jnp.sum(jnp.where(finite, p * centered, 0.0), axis=-1)


# A custom VJP so the backward pass keeps only the caller's logits (already alive, any
# dtype) and two [B, T] vectors as residuals; plain autodiff would save the float32
# upcast and softmax, i.e. one or two extra [B, T, V] float32 arrays per step.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logprobs_entropy(logits, targets, temperature, with_entropy):
    return _logprobs_entropy_fwd(logits, targets, temperature, with_entropy)[0]


def _logprobs_entropy_fwd(logits, targets, temperature, with_entropy):
    x = _scaled(logits, temperature)
    lse = _logsumexp(x)
    logp = _gather(x, targets) - lse
    ent = _entropy(x, lse) if with_entropy else jnp.zeros_like(lse)
    return (logp, ent), (logits, targets, lse, ent)


def _logprobs_entropy_bwd(temperature, with_entropy, residuals, cotangents):
    logits, targets, lse, ent = residuals
    g_logp, g_ent = cotangents
    x = _scaled(logits, temperature)
    p = jnp.exp(x - lse[..., None])
    onehot = jnp.arange(x.shape[-1], dtype=jnp.int32) == targets[..., None]
    # d logp_t / dx_j = [j == t] - p_j
    dx = g_logp[..., None] * (onehot.astype(jnp.float32) - p)
    if with_entropy:
        # dH / dx_j = -p_j (log p_j + H); p_j = 0 entries (x = -inf) contribute nothing.
        finite = jnp.isfinite(x)
        log_p = jnp.where(finite, x, 0.0) - lse[..., None]
        dx = dx - g_ent[..., None] * jnp.where(finite, p * (log_p + ent[..., None]), 0.0)
    if temperature != 1.0:
        dx = dx / jnp.float32(temperature)
    return dx.astype(logits.dtype), None


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd)


@jax.jit
def token_logprobs(logits, targets):
    """float32 [B, T]: log softmax(logits)[b, t, targets[b, t]], computed in float32."""
    _check(logits, targets)
    return _logprobs_entropy(logits, _clamp(targets, logits), 1.0, False)[0]


@jax.jit
def token_entropy(logits):
    """float32 [B, T]: entropy of softmax(logits) at each position, in nats."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {logits.shape}")
    targets = jnp.zeros(logits.shape[:2], jnp.int32)
    return _logprobs_entropy(logits, targets, 1.0, True)[1]


@partial(jax.jit, static_argnames=("temperature",))
def logprobs_and_entropy(logits, targets, temperature=1.0):
    """(logprobs, entropy), both float32 [B, T], of softmax(logits / temperature).

    One log-sum-exp serves both. Pass the sampling temperature so the logprobs are
    those of the distribution the rollout actually sampled from.
    """
    _check(logits, targets)
    _check_temperature(temperature)
    return _logprobs_entropy(logits, _clamp(targets, logits), float(temperature), True)
