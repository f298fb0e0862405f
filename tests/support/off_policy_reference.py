"""A float64 numpy transcription of the decoupled GRPO loss (`muajax.rl.off_policy`) and its
gradient, written from the formulas rather than the code, and the random inputs its tests use.

Per token (unmasked): r = exp(logp - prox), the clipped (and dual-clipped) pg loss of r,
times w = min(exp(prox - behav), cap) (1 without a cap), plus kl_coef times the k3 KL to the
reference; then the aggregation over tokens or sequences (rows, or segments of packed rows).
"""
from __future__ import annotations

import numpy as np

CLAMP = 20.0


def _sequences(mask, segment_ids):
    """Each token's sequence id (rows: the row + 1; packed: its segment) and the ids present."""
    b, t = mask.shape
    ids = np.broadcast_to(np.arange(1, b + 1)[:, None], (b, t)) if segment_ids is None else segment_ids
    return ids, sorted({int(i) for i in ids[mask]})


def _token_weights(mask, ids, seqs, agg, sum_norm):
    """d loss / d per-token loss: the aggregation as weights over tokens."""
    b, t = mask.shape
    if agg == "token-mean":
        return mask / max(mask.sum(), 1)
    n = max(len(seqs), 1)
    if agg == "seq-mean-token-mean":
        counts = {s: (mask & (ids == s)).sum() for s in seqs}
        return np.where(mask, np.vectorize(lambda s: 1.0 / counts.get(s, 1))(ids), 0.0) / n
    norm = np.full(b, float(t)) if sum_norm is None else np.maximum(np.asarray(sum_norm, np.float64), 1.0)
    return mask / norm[:, None] / n


def decoupled_reference(logp, prox, behav, ref, adv, mask, *, clip_low, clip_high, dual_clip, kl_coef, agg,
                        cap=None, segment_ids=None, sum_norm=None):
    """(loss, metrics, d loss / d logp, d loss / d prox) in float64; `adv` per row [B] or,
    packed, per token [B, T]; cap None: no importance weight."""
    logp, prox, behav, ref = (np.asarray(a, np.float64) for a in (logp, prox, behav, ref))
    adv = np.asarray(adv, np.float64)
    adv = adv if adv.ndim == 2 else np.broadcast_to(adv[:, None], logp.shape)
    mask = np.asarray(mask) != 0
    r = np.exp(np.clip(logp - prox, -CLAMP, CLAMP))
    unclipped, clipped = -adv * r, -adv * np.clip(r, 1 - clip_low, 1 + clip_high)
    pg = np.maximum(unclipped, clipped)
    live = clipped <= unclipped  # the unclipped branch, whose derivative is -A r
    if dual_clip is not None:
        dual = (adv < 0) & (pg > -adv * dual_clip)
        pg, live = np.where(dual, -adv * dual_clip, pg), live & ~dual
    rho = np.exp(np.clip(prox - behav, -CLAMP, CLAMP))
    w = np.ones_like(rho) if cap is None else np.minimum(rho, cap)
    d = ref - logp
    k3 = np.exp(d) - d - 1.0
    kl = np.clip(k3, -10.0, 10.0)
    ids, seqs = _sequences(mask, segment_ids)
    weights = _token_weights(mask, ids, seqs, agg, sum_norm)
    loss = (np.where(mask, w * pg + kl_coef * kl, 0.0) * weights).sum()
    d_pg = np.where(mask & live, -adv * r * w, 0.0) * weights  # w is a constant of the gradient
    d_kl = np.where(mask & (np.abs(k3) <= 10.0), kl_coef * (1.0 - np.exp(d)), 0.0) * weights
    n = max(mask.sum(), 1)
    metrics = {"off_policy/behav_ratio_mean": rho[mask].sum() / n,
               "off_policy/behav_ratio_max": rho[mask].max(initial=0.0),
               "off_policy/behav_log_diff": np.abs(prox - behav)[mask].sum() / n,
               "pg_loss": (np.where(mask, w * pg, 0.0) * weights).sum()}
    if cap is not None:
        metrics.update({"off_policy/is_weight_mean": w[mask].sum() / n,
                        "off_policy/is_truncated_frac": (rho[mask] > cap).sum() / n})
    return loss, metrics, d_pg + d_kl, -d_pg


def random_inputs(seed: int, b: int = 8, t: int = 24, packed: bool = False):
    """float32 (logp, prox, behav, ref, adv, mask, packing kwargs): ratios wide enough that
    both clips and the dual clip bite, and behaviour ratios on both sides of a cap of 1.5."""
    rng = np.random.default_rng(seed)
    prox = -rng.exponential(1.5, size=(b, t))
    logp = prox + rng.normal(0.0, 0.35, size=(b, t))
    logp[rng.random((b, t)) < 0.15] += 2.0  # past the dual clip's c = 3 where A < 0
    behav = prox + rng.normal(0.0, 0.6, size=(b, t))
    behav[rng.random((b, t)) < 0.05] -= 30.0  # a log-ratio past the clamp of 20
    ref = logp + rng.normal(0.0, 0.5, size=(b, t))
    mask = rng.random((b, t)) < 0.8
    mask[:, :2] = False
    mask[0] = False  # an empty row
    kwargs = {}
    if packed:
        seg = np.zeros((b, t), np.int32)
        next_id = 1
        for row in range(b):
            cuts = sorted(rng.choice(np.arange(3, t - 2), size=2, replace=False))
            for lo, hi in zip([0, *cuts], [*cuts, t - 2]):  # three segments, then 2 padding tokens
                seg[row, lo:hi], next_id = next_id, next_id + 1
        seg[rng.random(b) < 0.25, -8:] = 0  # some rows end in more padding
        mask &= seg > 0
        seg_adv = rng.normal(0.0, 1.0, size=next_id)
        adv = np.where(seg > 0, seg_adv[seg], 0.0)
        kwargs = dict(segment_ids=seg, num_segments=next_id,
                      sum_norm=rng.integers(t // 2, 2 * t, size=b).astype(np.float32))
    else:
        adv = rng.normal(0.0, 1.0, size=b)
    f32 = lambda a: np.asarray(a, np.float32)
    return f32(logp), f32(prox), f32(behav), f32(ref), f32(adv), mask.astype(np.int32), kwargs
