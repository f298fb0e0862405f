"""The GRPO policy loss exactly as it was before the off-policy correction (muajax/rl/losses.py
at commit f0ae59f, verbatim below this docstring but for its module docstring, then that
commit's `grpo_loss_fn`): the frozen invariant tests/rl/test_off_policy_unchanged.py compares
the on-policy path against, bit for bit. Do not edit: it is a record, not a second
implementation."""
from __future__ import annotations

import math
import numbers
from functools import partial

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

_STATIC = ("clip_low", "clip_high", "dual_clip", "kl_coef", "kl_estimator", "kl_clamp", "agg", "ratio_level")
METRIC_SUM_KEYS = ("num_tokens", "num_seqs", "clip_low_count", "clip_high_count", "dual_clip_count",
                   "kl_sum", "ratio_sum", "ratio_dev_sum", "ppo_kl_sum", "pg_loss_sum")


def _is_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x)


def _check_options(clip_low, clip_high, dual_clip, kl_coef, kl_estimator, kl_clamp, agg, ratio_level) -> None:
    if not _is_number(clip_low) or not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be a number in [0, 1], got {clip_low!r}")
    if not _is_number(clip_high) or clip_high < 0.0:
        raise ValueError(f"clip_high must be a non-negative number, got {clip_high!r}")
    # verl asserts c > 1: below that the cap would bite inside the ordinary clip range.
    if dual_clip is not None and (not _is_number(dual_clip) or dual_clip <= 1.0):
        raise ValueError(f"dual_clip must be None or a number > 1, got {dual_clip!r}")
    if not _is_number(kl_coef) or kl_coef < 0.0:
        raise ValueError(f"kl_coef must be a non-negative number, got {kl_coef!r}")
    if kl_clamp is not None and (not _is_number(kl_clamp) or kl_clamp <= 0.0):
        raise ValueError(f"kl_clamp must be None or a positive number, got {kl_clamp!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")


def _check_shapes(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, packed: bool = False) -> None:
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {logprobs.shape}")
    named = {"old_logprobs": old_logprobs, "loss_mask": loss_mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, arr in named.items():
        if arr.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {logprobs.shape}, got {arr.shape}")
    want = logprobs.shape if packed else logprobs.shape[:1]
    if advantages.shape != want:
        raise ValueError(f"advantages must be {list(want)} (per {'token' if packed else 'row'}), got "
                         f"{advantages.shape}")


def kl_estimate(diff, estimator: str, clamp: float | None = K3_CLAMP):
    """Per-token KL(pi || ref) estimate from diff = logprobs - ref_logprobs; k3 is clamped
    to [-clamp, clamp] (verl's low_var_kl; None: unclamped)."""
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff * diff
    if estimator == "k3":
        log_r = jnp.clip(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = jnp.exp(log_r) - log_r - 1.0
        return k3 if clamp is None else jnp.clip(k3, -clamp, clamp)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _token_weights(maskf, tok_count, agg, sum_norm=None):
    """w with loss_sum = sum(w * per_token): each agg mode is a weighted token sum.
    `tok_count` is per token ([B, T]: its sequence's count)."""
    if agg == "token-mean":
        return maskf
    if agg == "seq-mean-token-mean":
        return maskf / jnp.maximum(tok_count, 1.0)
    # Dr. GRPO: a constant normaliser, so long and short responses weigh per token alike.
    if sum_norm is not None:
        return maskf / jnp.maximum(sum_norm.astype(jnp.float32), 1.0)[:, None]  # padding rows carry 0
    return maskf / maskf.shape[-1]


class _Sequences:
    """Per-sequence sums seen from each token: rows ([B, T] -> [B, 1]) or, with segment ids,
    segments ([B, T] -> each token's segment's sum, [B, T])."""

    def __init__(self, segment_ids, num_segments):
        self.ids, self.n = segment_ids, num_segments

    def sums(self, x):
        """Each sequence's sum of x [B, T]: [S] (segments, id 0 included) or [B] (rows)."""
        if self.ids is None:
            return x.sum(axis=-1)
        return jax.ops.segment_sum(x.reshape(-1), self.ids.reshape(-1), num_segments=self.n)

    def per_token(self, sums):
        """A sequence value back at each of its tokens (broadcastable against [B, T])."""
        return sums[:, None] if self.ids is None else sums[self.ids]

    def count(self, tok_sums):
        """How many sequences have at least one unmasked token (padding, segment 0, never)."""
        real = tok_sums > 0 if self.ids is None else (tok_sums > 0) & (jnp.arange(self.n) > 0)
        return real.astype(jnp.float32).sum()


def _terms(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, *, clip_low, clip_high,
           dual_clip, kl_coef, kl_estimator, kl_clamp, agg, ratio_level, segment_ids=None, num_segments=None,
           sum_norm=None):
    _check_options(clip_low, clip_high, dual_clip, kl_coef, kl_estimator, kl_clamp, agg, ratio_level)
    packed = segment_ids is not None
    _check_shapes(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, packed)
    if packed and (num_segments is None or segment_ids.shape != logprobs.shape):
        raise ValueError("packed rows need segment_ids shaped like logprobs and a static num_segments")
    f32 = jnp.float32
    mask = loss_mask != 0
    maskf = mask.astype(f32)
    logp = logprobs.astype(f32)
    adv = advantages.astype(f32) if packed else advantages.astype(f32)[:, None]
    seqs = _Sequences(segment_ids, num_segments)
    seq_tokens = seqs.sums(maskf)
    tok_count = seqs.per_token(seq_tokens)

    # Masking with `where` before any nonlinearity: padding often carries garbage
    # (-inf old/ref logprobs), and a select's transpose hands masked positions an exact
    # 0 cotangent, where multiplying by the mask later could make 0 * inf = nan.
    token_log_ratio = jnp.where(mask, logp - old_logprobs.astype(f32), 0.0)
    log_ratio = token_log_ratio
    if ratio_level == "sequence":
        # GSPO-token: value exp(masked mean log-ratio), gradient s_i * grad log pi(y_t)
        # for each token. Summed over a sequence's tokens with the 1/|y_i| of a token
        # mean, that is exactly GSPO's sequence gradient s_i * mean_t grad log pi.
        seq_log_ratio = seqs.per_token(seqs.sums(log_ratio)) / jnp.maximum(tok_count, 1.0)
        logp_m = jnp.where(mask, logp, 0.0)
        log_ratio = jnp.where(
            mask, jax.lax.stop_gradient(seq_log_ratio) + logp_m - jax.lax.stop_gradient(logp_m), 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    # The clip is active exactly where it raises the loss; which side depends on sign(A).
    clipped = pg_clipped > pg_unclipped
    pg = jnp.where(clipped, pg_clipped, pg_unclipped)
    clip_high_tok = mask & clipped & (adv > 0)
    clip_low_tok = mask & clipped & (adv < 0)
    if dual_clip is not None:
        pg_cap = -adv * dual_clip
        dual_tok = (adv < 0) & (pg > pg_cap)
        pg = jnp.where(dual_tok, pg_cap, pg)
        dual_tok = dual_tok & mask
    else:
        dual_tok = jnp.zeros_like(mask)
    pg = jnp.where(mask, pg, 0.0)

    if ref_logprobs is not None:
        diff = jnp.where(mask, logp - ref_logprobs.astype(f32), 0.0)
        kl = jnp.where(mask, kl_estimate(diff, kl_estimator, kl_clamp), 0.0)
    else:
        kl = jnp.zeros_like(pg)
    per_token = pg + kl_coef * kl if (kl_coef != 0 and ref_logprobs is not None) else pg

    sg = jax.lax.stop_gradient
    weights = _token_weights(maskf, tok_count, agg, sum_norm if packed else None)
    loss_sum = (per_token * weights).sum()
    num_seqs = seqs.count(seq_tokens)
    sums = {
        "num_tokens": maskf.sum(),
        "num_seqs": num_seqs,
        "clip_low_count": clip_low_tok.astype(f32).sum(),
        "clip_high_count": clip_high_tok.astype(f32).sum(),
        "dual_clip_count": dual_tok.astype(f32).sum(),
        "kl_sum": sg(kl.sum()),
        "ratio_sum": sg(jnp.where(mask, ratio, 0.0).sum()),
        # mean |ratio - 1|: on a step's first pass the policy is the rollout's, so this is the
        # engine's and the trainer's disagreement on the same tokens (the on-policy mismatch)
        "ratio_dev_sum": sg(jnp.where(mask, jnp.abs(ratio - 1.0), 0.0).sum()),
        # verl's ppo_kl: mean of log(pi_old / pi), a cheap drift check against rollout.
        "ppo_kl_sum": sg(-token_log_ratio.sum()),
        "pg_loss_sum": sg((pg * weights).sum()),
    }
    denominator = sums["num_tokens"] if agg == "token-mean" else num_seqs
    return loss_sum, denominator, sums


def finalize_policy_metrics(denominator, metrics_sums):
    """Turn (summed) metric sums into means; safe when nothing was unmasked."""
    n_tok = jnp.maximum(metrics_sums["num_tokens"], 1.0)
    return {
        "clip_frac_low": metrics_sums["clip_low_count"] / n_tok,
        "clip_frac_high": metrics_sums["clip_high_count"] / n_tok,
        "clip_frac": (metrics_sums["clip_low_count"] + metrics_sums["clip_high_count"]) / n_tok,
        "dual_clip_frac": metrics_sums["dual_clip_count"] / n_tok,
        "kl": metrics_sums["kl_sum"] / n_tok,
        "ratio_mean": metrics_sums["ratio_sum"] / n_tok,
        "ratio_abs_dev": metrics_sums["ratio_dev_sum"] / n_tok,
        "ppo_kl": metrics_sums["ppo_kl_sum"] / n_tok,
        "pg_loss": metrics_sums["pg_loss_sum"] / jnp.maximum(denominator, 1.0),
        "num_tokens": metrics_sums["num_tokens"],
        "num_seqs": metrics_sums["num_seqs"],
    }


@partial(jax.jit, static_argnames=_STATIC + ("num_segments",))
def policy_loss_terms(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, *, clip_low=0.2,
                      clip_high=0.2, dual_clip=3.0, kl_coef=0.001, kl_estimator="k3", kl_clamp=K3_CLAMP,
                      agg="token-mean", ratio_level="token", segment_ids=None, num_segments=None,
                      sum_norm=None):
    """(loss_sum, denominator, metrics_sums) of one (micro)batch; see `policy_loss`.
    Packed rows: `segment_ids`, `num_segments`, `sum_norm` and per-token advantages (see
    the module docstring).

    Over microbatches, the full-batch loss is sum(loss_sum) / sum(denominator); the
    denominator counts unmasked tokens for "token-mean" and sequences with at least one
    unmasked token for the seq-mean modes. Differentiate loss_sum / total_denominator
    per microbatch and add the gradients to get the full-batch gradient.
    metrics_sums (keys METRIC_SUM_KEYS) add across microbatches; pass the totals to
    `finalize_policy_metrics`.
    """
    return _terms(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, clip_low=clip_low,
                  clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef, kl_estimator=kl_estimator,
                  kl_clamp=kl_clamp, agg=agg, ratio_level=ratio_level, segment_ids=segment_ids,
                  num_segments=num_segments, sum_norm=sum_norm)


@partial(jax.jit, static_argnames=_STATIC)
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, *, clip_low=0.2,
                clip_high=0.2, dual_clip=3.0, kl_coef=0.001, kl_estimator="k3", kl_clamp=K3_CLAMP,
                agg="token-mean", ratio_level="token"):
    """GRPO policy loss of a batch. Returns (loss, metrics).

    Args:
      logprobs: float[B, T], current policy's log-probabilities of the sampled tokens
        (differentiate with respect to these).
      old_logprobs: float[B, T], the rollout policy's.
      ref_logprobs: float[B, T] or None, the reference policy's; None skips the KL.
      advantages: float[B], one per sequence.
      loss_mask: [B, T]; nonzero marks the tokens the agent sampled.
      clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
      dual_clip: c > 1 caps the loss of negative-advantage tokens at c * |A|; None: off.
      kl_coef: weight of the per-token KL added to the loss (0 adds nothing; the "kl"
        metric is still reported whenever ref_logprobs is given).
      kl_estimator: "k1" (logp - ref), "k2" (half its square) or "k3" (verl low_var_kl).
      kl_clamp: k3 is clamped to [-kl_clamp, kl_clamp] (verl: 10); None leaves it unclamped.
      agg: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum-norm" (Dr. GRPO:
        each sequence's token sum divided by the padded length T, averaged over
        sequences).
      ratio_level: "token" (PPO / GRPO) or "sequence" (GSPO): every token of sequence i
        uses s_i = exp(masked mean of its log-ratios), built as
        exp(sg[mean log-ratio] + logp - sg[logp]) so the value is s_i and each token's
        gradient is s_i * grad logp_t (GSPO-token; with a per-sequence advantage this
        equals GSPO's own gradient). Clips and dual clip then act on s_i.

    A batch with no unmasked token gives loss 0 and zero gradients.
    """
    loss_sum, denominator, sums = _terms(
        logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, kl_coef=kl_coef, kl_estimator=kl_estimator, kl_clamp=kl_clamp, agg=agg,
        ratio_level=ratio_level)
    loss = loss_sum / jnp.maximum(denominator, 1.0)
    metrics = finalize_policy_metrics(denominator, sums)
    metrics["loss"] = jax.lax.stop_gradient(loss)
    return loss, metrics


# ----------------------------------------------------------------------------- the GRPO loss_fn
# `muajax.rl.grpo.grpo_loss_fn` at commit f0ae59f, verbatim but for the imports it needs here
# and the settings it passes (those the loss took then: the config's off-policy cap is new).
from muajax.rl.grpo import _packing  # noqa: E402
from muajax.rl.sequence import sequence_logprobs  # noqa: E402
from muajax.rl.step import shift_left  # noqa: E402


def grpo_loss_fn(cfg, grpo, *, temperature: float, shared_prefix: int, segments: int | None = None):
    """One microbatch's GRPO terms; `ref_params` is only read (and run) when kl_coef > 0.
    Packed rows (`segment_ids` in the batch) need `segments`, an id bound."""
    settings = {k: v for k, v in grpo.loss_settings().items() if k != "behaviour_is_cap"}

    def loss_fn(params, ref_params, mb):
        tokens = mb["tokens"]
        targets = shift_left(tokens)
        mask = shift_left(mb["loss_mask"]).astype(jnp.float32)
        packing = _packing(mb, segments)
        seg = mb.get("segment_ids")
        advantages = shift_left(mb["advantages"]) if packing else mb["advantages"]
        logp, ent = sequence_logprobs(params, cfg, tokens, targets, temperature=temperature,
                                      logits_chunk=grpo.logits_chunk, shared_prefix=shared_prefix, segment_ids=seg)
        if grpo.recompute_old_logprobs and grpo.minibatch_size is None:
            # one update per step: the params being differentiated are the ones the step starts from
            old = jax.lax.stop_gradient(logp)
        else:
            old = shift_left(mb["old_logprobs"].astype(jnp.float32))
        ref_logp = None
        if grpo.uses_reference:
            ref_logp, _ = sequence_logprobs(ref_params, cfg, tokens, targets, temperature=temperature,
                                            logits_chunk=grpo.logits_chunk, shared_prefix=shared_prefix,
                                            segment_ids=seg)
            ref_logp = jax.lax.stop_gradient(ref_logp)
        loss_sum, denom, sums = policy_loss_terms(logp, old, ref_logp, advantages, mask,
                                                  **settings, **packing)
        sums = dict(sums, entropy_sum=jax.lax.stop_gradient(jnp.where(mask > 0, ent, 0.0).sum()))
        return loss_sum, denom, sums

    return loss_fn
