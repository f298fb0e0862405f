"""The GRPO policy loss on hand-built rows (clipping, dual clip, sequence ratio, k3), and the
validation of its options and shapes. (The reference and gradient families: test_losses.py.)"""
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.rl import policy_loss, policy_loss_terms


# ----------------------------------------------------------------------------- hand-built cases
def _rows(ratios, advs, mask=None, **opts):
    logp = np.log(np.asarray(ratios, np.float32))
    mask = np.ones(logp.shape, bool) if mask is None else mask
    return policy_loss(logp, np.zeros_like(logp), None, np.asarray(advs, np.float32), mask, **opts)


def test_clipping_hand_built():
    ratios = [[1.5, 0.5, 1.1, 1.25],   # A = +1: only 1.5 > 1 + 0.28 clips (high side); at 0.5
              [0.5, 0.7, 0.9, 1.5],    # the unclipped loss is already the larger one.
              [0.1, 9.0, 1.0, 1.0]]    # A = -1: 0.5 and 0.7 < 1 - 0.2 clip (low side). A = 0: none.
    loss, m = _rows(ratios, [1.0, -1.0, 0.0], clip_low=0.2, clip_high=0.28, dual_clip=None)
    assert float(m["clip_frac_high"]) == pytest.approx(1 / 12) and float(m["clip_frac_low"]) == pytest.approx(2 / 12)
    per_token = [-1.28, -0.5, -1.1, -1.25, 0.8, 0.8, 0.9, 1.5, 0, 0, 0, 0]
    np.testing.assert_allclose(float(loss), np.mean(per_token), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(m["ratio_mean"]), np.mean(ratios), rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_abs_dev"]), np.mean(np.abs(np.asarray(ratios) - 1)), rtol=1e-6)


def test_ratio_deviation_counts_only_unmasked_tokens():
    mask = np.array([[True, True, False], [False, True, False]])
    _, m = _rows([[1.5, 0.9, 9.0], [0.1, 1.0, 0.2]], [1.0, -1.0], mask=mask)
    np.testing.assert_allclose(float(m["ratio_abs_dev"]), (0.5 + 0.1 + 0.0) / 3, rtol=1e-6)


def test_dual_clip_bound_hand_built():
    # A = -2, ratio 5: PPO loss 10, dual clip caps it at c * |A| = 6 with no gradient.
    # A = +2, ratio 5: never dual-clipped, the ordinary clip gives -2 * 1.2.
    lp = np.log(np.array([[5.0, 2.0], [5.0, 1.0]], np.float32))
    args = (np.zeros_like(lp), None, np.array([-2.0, 2.0], np.float32), np.ones_like(lp, bool))
    loss, m = policy_loss(lp, *args)
    np.testing.assert_allclose(float(loss), (6.0 + 4.0 - 2.4 - 2.0) / 4, rtol=1e-6)
    assert float(m["dual_clip_frac"]) == 0.25
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, *args)[0])(lp))
    assert grad[0, 0] == 0.0 and grad[1, 0] == 0.0
    np.testing.assert_allclose(grad[0, 1], 2.0 * 2.0 / 4, rtol=1e-6)  # d(-A r)/dlogp = -A r
    loss, m = policy_loss(lp, *args, dual_clip=None)
    np.testing.assert_allclose(float(loss), (10.0 + 4.0 - 2.4 - 2.0) / 4, rtol=1e-6)
    assert float(m["dual_clip_frac"]) == 0.0


def test_sequence_ratio_hand_built():
    # Token log-ratios log 2 and 0 over the two unmasked tokens: s = exp(log(2) / 2) = sqrt 2,
    # which clip_high = 0.2 clips on both tokens; the masked third token is ignored.
    lp = np.array([[np.log(2.0), 0.0, 5.0]], np.float32)
    mask = np.array([[True, True, False]])
    args = (np.zeros_like(lp), None, np.array([1.0], np.float32), mask)
    loss, m = policy_loss(lp, *args, ratio_level="sequence")
    np.testing.assert_allclose(float(m["ratio_mean"]), np.sqrt(2.0), rtol=1e-6)
    assert float(m["clip_frac_high"]) == 1.0
    np.testing.assert_allclose(float(loss), -1.2, rtol=1e-6)


def test_k3_hand_built():
    # k1 and k2 are checked against the reference above; k3 has the clamp worth pinning.
    lp = np.array([[-1.0, -2.0, -30.0]], np.float32)
    ref = np.array([[-1.5, -2.0, -1.5]], np.float32)  # third: ref - logp = 28.5, k3 clamps to 10
    _, m = policy_loss(lp, lp, ref, np.zeros(1, np.float32), np.ones_like(lp, bool), kl_estimator="k3")
    np.testing.assert_allclose(float(m["kl"]), (np.exp(-0.5) + 0.5 - 1.0 + 10.0) / 3, rtol=1e-6)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, name", [
    (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_low=1.5), "clip_low"),
    (dict(clip_high=-0.2), "clip_high"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(kl_coef=-0.001), "kl_coef"),
    (dict(kl_coef=float("nan")), "kl_coef"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(agg="mean"), "agg"),
    (dict(ratio_level="seq"), "ratio_level"),
])
def test_invalid_options_raise(kwargs, name):
    x = jnp.zeros((2, 3))
    for fn in (policy_loss, policy_loss_terms):
        with pytest.raises(ValueError, match=name):
            fn(x, x, x, jnp.zeros(2), jnp.ones((2, 3)), **kwargs)


def test_bad_shapes_raise():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, jnp.zeros(3), x)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, jnp.zeros((2, 4)), jnp.zeros(2), x)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(x, x, None, jnp.zeros(2), jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(jnp.zeros(3), jnp.zeros(3), None, jnp.zeros(3), jnp.zeros(3))


def test_kl_clamp_bounds_the_k3_estimate_and_none_leaves_it_unclamped():
    # one token whose reference logprob is far below the policy's: k3 = e^-d + d - 1 is huge
    logp = jnp.asarray([[0.0, -0.1]], jnp.float32)
    ref = jnp.asarray([[-20.0, -0.1]], jnp.float32)
    args = (logp, logp, ref, jnp.zeros((1,), jnp.float32), jnp.ones((1, 2), jnp.int32))
    kl = {c: float(policy_loss(*args, kl_coef=1.0, kl_clamp=c)[1]["kl"]) for c in (10.0, 1.0, None)}
    d = 20.0  # logp - ref on the first token; the second contributes 0
    assert kl[10.0] == pytest.approx((min(math.exp(-d) + d - 1.0, 10.0)) / 2)
    assert kl[1.0] == pytest.approx(1.0 / 2)
    assert kl[None] == pytest.approx((math.exp(-d) + d - 1.0) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="kl_clamp"):
        policy_loss(*args, kl_clamp=0.0)


def test_the_config_s_kl_clamp_reaches_the_loss():
    from muajax.config.schema import load_config

    grpo = load_config(None, ["grpo.kl_clamp=2.5"]).grpo
    assert grpo.loss_settings()["kl_clamp"] == 2.5
    assert load_config(None, ["grpo.kl_clamp=null"]).grpo.loss_settings()["kl_clamp"] is None
