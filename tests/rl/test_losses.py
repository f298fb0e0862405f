"""The GRPO policy loss against a float64 reference for every option combination, and its
gradient's properties. (Hand-built cases and option validation: test_losses_cases.py.)"""
import inspect
import math
import os
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from muajax.rl import (
    AGG_MODES,
    KL_ESTIMATORS,
    RATIO_LEVELS,
    finalize_policy_metrics,
    group_advantages,
    policy_loss,
    policy_loss_terms,
)


# ----------------------------------------------------------------------------- reference
def reference(logp, old, ref, adv, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=3.0, kl_coef=0.001,
              kl_estimator="k3", agg="token-mean", ratio_level="token"):
    """Token-by-token float64 transcription of the loss as specified (verl conventions)."""
    logp, old, adv = (np.asarray(a, np.float64) for a in (logp, old, adv))
    ref = None if ref is None else np.asarray(ref, np.float64)
    B, T = logp.shape
    per_tok = np.zeros((B, T))
    pg_tok = np.zeros((B, T))
    m = dict(low=0, high=0, dual=0, kl=0.0, ratio=0.0, n=0)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        if ratio_level == "sequence" and idx:
            seq_lr = sum(logp[b, t] - old[b, t] for t in idx) / len(idx)
        a = adv[b]
        for t in idx:
            lr = seq_lr if ratio_level == "sequence" else logp[b, t] - old[b, t]
            r = math.exp(min(max(lr, -20.0), 20.0))
            unclipped, clipped = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
            loss = max(unclipped, clipped)
            if clipped > unclipped:
                m["high" if a > 0 else "low"] += 1
            if dual_clip is not None and a < 0 and loss > -a * dual_clip:
                loss = -a * dual_clip
                m["dual"] += 1
            kl = 0.0
            if ref is not None:
                d = logp[b, t] - ref[b, t]
                if kl_estimator == "k1":
                    kl = d
                elif kl_estimator == "k2":
                    kl = 0.5 * d * d
                else:
                    kl = min(max(math.exp(-d) + d - 1.0, -10.0), 10.0)
            pg_tok[b, t] = loss
            per_tok[b, t] = loss + (kl_coef * kl if ref is not None else 0.0)
            m["kl"] += kl
            m["ratio"] += r
            m["n"] += 1

    def aggregate(x):
        counts = np.asarray(mask, bool).sum(1)
        if agg == "token-mean":
            return x.sum() / max(counts.sum(), 1)
        nonempty = counts > 0
        if agg == "seq-mean-token-mean":
            per_seq = x.sum(1)[nonempty] / counts[nonempty]
        else:
            per_seq = x.sum(1)[nonempty] / T
        return per_seq.mean() if nonempty.any() else 0.0

    n = max(m["n"], 1)
    metrics = dict(clip_frac_low=m["low"] / n, clip_frac_high=m["high"] / n, dual_clip_frac=m["dual"] / n,
                   kl=m["kl"] / n, ratio_mean=m["ratio"] / n, num_tokens=m["n"], pg_loss=aggregate(pg_tok))
    return aggregate(per_tok), metrics


B, T = 24, 16


# Each value of every option appears, each agg with both ratio levels, each KL
# estimator with both ratio levels, dual clip on and off across both ratio levels.
COMBOS = [
    dict(agg="token-mean", ratio_level="token", dual_clip=3.0, kl_estimator="k3"),
    dict(agg="token-mean", ratio_level="sequence", dual_clip=None, kl_estimator="k1"),
    dict(agg="seq-mean-token-mean", ratio_level="token", dual_clip=None, kl_estimator="k2"),
    dict(agg="seq-mean-token-mean", ratio_level="sequence", dual_clip=3.0, kl_estimator="k3"),
    dict(agg="seq-mean-token-sum-norm", ratio_level="token", dual_clip=3.0, kl_estimator="k1"),
    dict(agg="seq-mean-token-sum-norm", ratio_level="sequence", dual_clip=None, kl_estimator="k2"),
]


for _c in COMBOS:
    _c.update(kl_coef=0.05, clip_low=0.2, clip_high=0.28)


COMBO_IDS = ["{agg}/{ratio_level}/dual={dual_clip}/{kl_estimator}".format(**c) for c in COMBOS]


def test_combos_cover_every_option_value():
    for key, values in [("agg", AGG_MODES), ("ratio_level", RATIO_LEVELS), ("kl_estimator", KL_ESTIMATORS),
                        ("dual_clip", (3.0, None))]:
        for level in RATIO_LEVELS:
            assert {c[key] for c in COMBOS if c["ratio_level"] == level or key == "ratio_level"} >= set(values)


# Compiling is the slow part of these tests (seconds per program on a busy CPU), so each
# option set is compiled once, at one shape, into a program giving loss, metrics and
# gradient, and every test below reuses it.
@partial(jax.jit, static_argnames=("opts",))
def loss_metrics_grad(logp, old, ref, adv, mask, opts):
    fn = lambda lp: policy_loss(lp, old, ref, adv, mask, **dict(opts))
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    return loss, metrics, grad


@partial(jax.jit, static_argnames=("opts",))
def terms_and_grad(logp, old, ref, adv, mask, opts):
    fn = lambda lp: policy_loss_terms(lp, old, ref, adv, mask, **dict(opts))[0]
    loss_sum, grad = jax.value_and_grad(fn)(logp)
    _, denominator, sums = policy_loss_terms(logp, old, ref, adv, mask, **dict(opts))
    return loss_sum, denominator, sums, grad


def frozen(opts):
    return tuple(sorted(opts.items()))


def random_batch(seed, near_one=False):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.5, size=(B, T))
    if near_one:  # ratios within a few % of 1: no clip kinks for finite differences
        old = logp + rng.normal(0.0, 0.02, size=(B, T))
    else:  # wide enough that many tokens clip and some pass c = 3
        old = logp + rng.normal(0.0, 0.5, size=(B, T)) + rng.normal(0.0, 0.3, size=(B, 1))
        old[rng.random((B, T)) < 0.08] -= 2.0
    ref = logp + rng.normal(0.0, 0.6, size=(B, T))
    if not near_one:
        ref[rng.random((B, T)) < 0.05] += 4.0  # k3 past its clamp at 10
    lengths = rng.integers(0, T + 1, size=B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask &= rng.random((B, T)) < 0.85  # holes, as between multi-turn assistant turns
    mask[0] = False  # one empty sequence
    mask[1] = True
    rewards, ids = _layout(rng)
    adv = np.asarray(group_advantages(rewards, ids, B))
    if not near_one:
        # Make sure that even sequence-level ratios reach every branch: a negative-advantage
        # sequence past the dual clip and one below the low clip, a positive one above the high.
        neg, pos = np.nonzero((adv < 0) & mask.any(1))[0], np.nonzero((adv > 0) & mask.any(1))[0]
        old[neg[0]] -= 2.0
        old[neg[1]] += 1.0
        old[pos[0]] -= 1.0
    f32 = lambda a: np.asarray(a, np.float32)
    return f32(logp), f32(old), f32(ref), f32(adv), mask


def _layout(rng):
    ids, g = [], 0
    while len(ids) < B:
        ids += [g] * int(rng.integers(1, 9))
        g += 1
    ids = rng.permutation(np.asarray(ids[:B], np.int32))
    rewards = rng.integers(0, 2, size=B).astype(np.float32)
    rewards[ids == ids[2]] = 1.0  # at least one all-equal group
    return rewards, ids


def check_against_reference(got_loss, got_metrics, batch, opts):
    want_loss, want = reference(*batch, **opts)
    np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5, atol=1e-7)
    for key, value in want.items():
        np.testing.assert_allclose(float(got_metrics[key]), value, rtol=1e-5, atol=1e-7, err_msg=key)
    return want


# ----------------------------------------------------------------------------- reference tests
@pytest.mark.parametrize("opts", COMBOS, ids=COMBO_IDS)
def test_matches_reference(opts):
    for seed in (COMBOS.index(opts), 50 + COMBOS.index(opts)):
        batch = random_batch(seed)
        loss, metrics, _ = loss_metrics_grad(*batch, frozen(opts))
        want = check_against_reference(loss, metrics, batch, opts)
        # The random batch must actually exercise the branches being compared.
        assert want["clip_frac_low"] > 0 and want["clip_frac_high"] > 0
        if opts["dual_clip"] is not None:
            assert want["dual_clip_frac"] > 0


def test_kl_coef_zero_and_ref_none():
    batch = random_batch(7)
    logp, old, _, adv, mask = batch
    opts = dict(COMBOS[3], kl_coef=0.0)
    loss_zero, metrics = policy_loss(*batch, **opts)
    want = check_against_reference(loss_zero, metrics, batch, opts)
    assert want["kl"] > 0  # reported even though it adds nothing
    loss_none, metrics_none = policy_loss(logp, old, None, adv, mask, **COMBOS[3])
    assert float(metrics_none["kl"]) == 0.0
    np.testing.assert_allclose(float(loss_none), float(loss_zero), rtol=1e-6)
    check_against_reference(loss_none, metrics_none, (logp, old, None, adv, mask), COMBOS[3])
    # ...and the KL term does move the loss when it is on.
    assert abs(float(loss_none) - float(loss_metrics_grad(*batch, frozen(COMBOS[3]))[0])) > 1e-4


def test_defaults_are_the_paper_settings():
    params = inspect.signature(policy_loss).parameters
    got = {k: params[k].default for k in ("clip_low", "clip_high", "dual_clip", "kl_coef", "kl_estimator", "agg",
                                          "ratio_level")}
    assert got == dict(clip_low=0.2, clip_high=0.2, dual_clip=3.0, kl_coef=0.001, kl_estimator="k3",
                       agg="token-mean", ratio_level="token")
    batch = random_batch(3)
    check_against_reference(*policy_loss(*batch), batch, {})


@pytest.mark.parametrize("opts", COMBOS, ids=COMBO_IDS)
def test_gradient_matches_finite_differences(opts):
    # Also pins GSPO's per-token gradient: the stop-gradient construction must agree
    # with the derivative of the loss value built from exp(mean log-ratio).
    batch = random_batch(11, near_one=True)
    grad = np.asarray(loss_metrics_grad(*batch, frozen(opts))[2])
    logp, mask = batch[0], batch[4]
    rng = np.random.default_rng(0)
    entries = list(zip(*np.nonzero(mask)))
    h = 1e-6
    for i in rng.choice(len(entries), size=12, replace=False):
        b, t = entries[i]
        up, down = logp.astype(np.float64), logp.astype(np.float64)
        up[b, t] += h
        down[b, t] -= h
        fd = (reference(up, *batch[1:], **opts)[0] - reference(down, *batch[1:], **opts)[0]) / (2 * h)
        np.testing.assert_allclose(grad[b, t], fd, rtol=2e-4, atol=1e-7)
    assert np.abs(grad).max() > 1e-3


# ----------------------------------------------------------------------------- gradient properties
@pytest.mark.parametrize("opts", COMBOS, ids=COMBO_IDS)
def test_masked_tokens_get_exactly_zero_gradient(opts):
    logp, old, ref, adv, mask = random_batch(2)
    # Padding garbage must not leak: -inf old/ref logprobs and a huge current logprob.
    logp[~mask] = 80.0
    old[~mask] = -np.inf
    ref[~mask] = -np.inf
    loss, metrics, grad = loss_metrics_grad(logp, old, ref, adv, mask, frozen(opts))
    grad = np.asarray(grad)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert np.all(grad[~mask] == 0.0)
    assert np.count_nonzero(grad[mask]) > mask.sum() // 2


# Three programs are enough here: each agg once, both ratio levels, both scales.
@pytest.mark.parametrize("opts", [COMBOS[i] for i in (1, 2, 5)], ids=[COMBO_IDS[i] for i in (1, 2, 5)])
def test_equal_reward_group_has_zero_policy_gradient(opts):
    rng = np.random.default_rng(4)
    ids = rng.permutation(np.repeat(np.arange(6), 4)).astype(np.int32)
    rewards = rng.uniform(0, 1, size=B).astype(np.float32)
    rewards[ids == 1] = 0.7
    rewards[ids == 3] = 0.0
    scale = "std" if COMBOS.index(opts) % 2 else "none"
    adv = np.asarray(group_advantages(rewards, ids, 6, scale=scale))
    logp, old, ref, _, mask = random_batch(5)
    grad = np.asarray(loss_metrics_grad(logp, old, ref, adv, mask, frozen(dict(opts, kl_coef=0.0)))[2])
    equal = np.isin(ids, [1, 3])
    assert np.all(grad[equal] == 0.0)
    assert np.count_nonzero(grad[~equal]) > 0


@pytest.mark.parametrize("opts", COMBOS, ids=COMBO_IDS)
def test_microbatches_equal_full_batch(opts):
    batch = random_batch(9)
    full_loss, full_metrics, full_grad = loss_metrics_grad(*batch, frozen(opts))
    k = 3  # microbatches of 8 rows; the first holds the empty sequence
    parts = [terms_and_grad(*(a[i * B // k:(i + 1) * B // k] for a in batch), frozen(opts))
             for i in range(k)]
    total = sum(float(d) for _, d, _, _ in parts)
    loss = sum(float(s) for s, _, _, _ in parts) / total
    grad = np.concatenate([np.asarray(g) for _, _, _, g in parts]) / total
    np.testing.assert_allclose(loss, float(full_loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=0, atol=1e-6)
    assert np.abs(np.asarray(full_grad)).max() > 1e-3

    summed = jax.tree.map(lambda *xs: sum(xs), *[m for _, _, m, _ in parts])
    metrics = finalize_policy_metrics(total, summed)
    for key in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl", "ratio_mean", "ratio_abs_dev",
                "num_tokens", "pg_loss", "ppo_kl", "num_seqs"):
        np.testing.assert_allclose(float(metrics[key]), float(full_metrics[key]), rtol=1e-6, atol=1e-7,
                                   err_msg=key)


@pytest.mark.parametrize("opts", COMBOS[::2], ids=COMBO_IDS[::2])
def test_all_masked_batch_is_zero_and_finite(opts):
    logp, old, ref, adv, _ = random_batch(1)
    loss, metrics, grad = loss_metrics_grad(logp, old, ref, adv, np.zeros((B, T), bool), frozen(opts))
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_float_and_bool_masks_agree():
    logp, old, ref, adv, mask = random_batch(5)
    a = policy_loss(logp, old, ref, adv, mask)[0]
    b = policy_loss(logp, old, ref, adv, mask.astype(np.float32))[0]
    assert float(a) == float(b)
