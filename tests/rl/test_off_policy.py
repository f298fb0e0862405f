"""The decoupled (off-policy) GRPO loss, `muajax.rl.off_policy`: against a float64 reference on
random inputs (padded and packed rows, every aggregation, dual clip on and off), its
gradient (the importance weight a constant of it), its cap, and its statistics."""
import os
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.rl import finalize_policy_metrics, policy_loss_terms
from muajax.rl.step import combine_sums
from tests.support.off_policy_reference import decoupled_reference, random_inputs

CASES = [
    dict(agg="token-mean", dual_clip=3.0, cap=1.5, packed=False),
    dict(agg="seq-mean-token-mean", dual_clip=None, cap=2.0, packed=False),
    dict(agg="seq-mean-token-sum-norm", dual_clip=3.0, cap=1.5, packed=False),
    dict(agg="token-mean", dual_clip=None, cap=1.5, packed=True),
    dict(agg="seq-mean-token-mean", dual_clip=3.0, cap=1.5, packed=True),
    dict(agg="seq-mean-token-sum-norm", dual_clip=3.0, cap=2.0, packed=True),
    dict(agg="token-mean", dual_clip=3.0, cap=None, packed=False),  # statistics only, no weight
]
IDS = ["{agg}/dual={dual_clip}/cap={cap}/{p}".format(p="packed" if c["packed"] else "rows", **c) for c in CASES]
LOSS = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_estimator="k3")


@partial(jax.jit, static_argnames=("opts", "num_segments"))
def loss_and_grads(logp, prox, behav, ref, adv, mask, opts, segment_ids=None, num_segments=None, sum_norm=None):
    """(loss, metrics, d/d logp, d/d prox, d/d behav) of the decoupled loss."""
    def loss(lp, px, bh):
        loss_sum, denom, sums = policy_loss_terms(lp, px, ref, adv, mask, behaviour_logprobs=bh, **dict(opts),
                                                  segment_ids=segment_ids, num_segments=num_segments,
                                                  sum_norm=sum_norm)
        return loss_sum / jnp.maximum(denom, 1.0), (denom, sums)

    (value, (denom, sums)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(logp, prox, behav)
    return value, finalize_policy_metrics(denom, sums), *grads


def reference_options(case) -> dict:
    return dict(clip_low=LOSS["clip_low"], clip_high=LOSS["clip_high"], kl_coef=LOSS["kl_coef"], agg=case["agg"],
                dual_clip=case["dual_clip"])


def run(case, seed, cap=...):
    cap = case["cap"] if cap is ... else cap
    logp, prox, behav, ref, adv, mask, packing = random_inputs(seed, packed=case["packed"])
    opts = tuple(sorted(dict(LOSS, agg=case["agg"], dual_clip=case["dual_clip"], behaviour_is_cap=cap).items()))
    got = loss_and_grads(logp, prox, behav, ref, adv, mask, opts, **packing)
    packing.pop("num_segments", None)
    want = decoupled_reference(logp, prox, behav, ref, adv, mask, cap=cap, **reference_options(case), **packing)
    return got, want


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_decoupled_loss_equals_the_float64_reference(case):
    for seed in (0, 1):
        (loss, metrics, d_logp, d_prox, _), (want_loss, want_metrics, want_logp, want_prox) = run(case, seed)
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7)
        for key, value in want_metrics.items():
            np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(np.asarray(d_logp), want_logp, rtol=2e-5, atol=1e-8)
        np.testing.assert_allclose(np.asarray(d_prox), want_prox, rtol=2e-5, atol=1e-8)
        # the inputs reach every branch the comparison is about
        assert float(metrics["clip_frac_low"]) > 0 and float(metrics["clip_frac_high"]) > 0
        if case["dual_clip"] is not None:
            assert float(metrics["dual_clip_frac"]) > 0
        if case["cap"] is not None:
            assert 0 < float(metrics["off_policy/is_truncated_frac"]) < 0.5


@pytest.mark.parametrize("case", CASES[:1] + CASES[4:5], ids=IDS[:1] + IDS[4:5])
def test_the_importance_weight_is_a_constant_of_the_gradient(case):
    """The behaviour logprobs enter only through the detached weight: no gradient reaches
    them, and the proximal logprobs' is the ratio's alone (the reference's)."""
    (_, _, d_logp, d_prox, d_behav), (_, _, want_logp, want_prox) = run(case, 2)
    assert np.abs(want_logp).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(d_behav), 0.0)
    np.testing.assert_allclose(np.asarray(d_logp), want_logp, rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(np.asarray(d_prox), want_prox, rtol=2e-5, atol=1e-8)


def test_the_cap_truncates_the_weight():
    """With the cap the loss is the truncated reference's, far from the untruncated one's;
    a different cap gives a different loss, and no cap applies no weight."""
    case = CASES[0]
    (loss, metrics, *_), (want, _, _, _) = run(case, 3)
    untruncated = decoupled_reference(*random_inputs(3)[:6], cap=np.inf, **reference_options(case))[0]
    assert abs(want - untruncated) > 0.1 * abs(want)  # the truncation matters here
    np.testing.assert_allclose(float(loss), want, rtol=2e-6)
    (loss_2, *_), (want_2, *_) = run(case, 3, cap=2.0)
    np.testing.assert_allclose(float(loss_2), want_2, rtol=2e-6)
    assert abs(float(loss_2) - float(loss)) > 1e-3 * abs(float(loss))
    (loss_none, metrics_none, *_), (want_none, *_) = run(case, 3, cap=None)
    np.testing.assert_allclose(float(loss_none), want_none, rtol=2e-6)
    assert "off_policy/is_weight_mean" not in metrics_none and float(metrics["off_policy/is_weight_mean"]) < 1.5


def test_without_behaviour_logprobs_there_are_no_off_policy_metrics_and_a_cap_is_refused():
    logp, prox, _, ref, adv, mask, _ = random_inputs(4)
    _, denom, sums = policy_loss_terms(logp, prox, ref, adv, mask)
    assert not [k for k in finalize_policy_metrics(denom, sums) if k.startswith("off_policy/")]
    with pytest.raises(ValueError, match="behaviour_is_cap needs behaviour_logprobs"):
        policy_loss_terms(logp, prox, ref, adv, mask, behaviour_is_cap=2.0)
    for bad in (0.5, float("nan"), True):
        with pytest.raises(ValueError, match="behaviour_is_cap must be"):
            policy_loss_terms(logp, prox, ref, adv, mask, behaviour_logprobs=prox, behaviour_is_cap=bad)


def test_microbatches_combine_the_statistics_as_the_whole_batch():
    """Sums add and the max is the max: two halves give the whole batch's metrics."""
    logp, prox, behav, ref, adv, mask, _ = random_inputs(5)
    behav = np.where(prox - behav > 20, prox, behav)  # no ratio at the clamp: each half has its own max
    terms = lambda s: policy_loss_terms(logp[s], prox[s], ref[s], adv[s], mask[s], behaviour_logprobs=behav[s],
                                        behaviour_is_cap=1.5)
    _, denom, whole = terms(slice(None))
    (_, d0, s0), (_, d1, s1) = terms(slice(0, 4)), terms(slice(4, None))
    want, got = finalize_policy_metrics(denom, whole), finalize_policy_metrics(d0 + d1, combine_sums(s0, s1))
    assert float(s0["behav_ratio_max"]) != float(s1["behav_ratio_max"])
    for key in [k for k in want if k.startswith("off_policy/")]:
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-6, err_msg=key)
