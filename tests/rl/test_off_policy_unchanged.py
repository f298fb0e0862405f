"""Without the behaviour policy's logprobs (no grpo.recompute_old_logprobs, and so the
synchronous loop, max_staleness 0) the GRPO loss, its gradient and the update are bit for bit
what they were before the off-policy correction: compared with a frozen copy of that code
(tests/support/frozen_policy_loss.py, commit f0ae59f)."""
import os
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax import parallel
from muajax.models.qwen3 import init_params
from muajax.models.sharding import param_shardings
from muajax.rl import policy_loss_terms
from muajax.rl.grpo import GRPOConfig, grpo_finalize, grpo_prepare, make_grpo_step
from muajax.rl.optim import make_optimizer
from muajax.rl.step import TrainStep
from muajax.runtime.grpo_packing import pack_bins
from tests.rl.test_grpo_packed import CFG, LENGTHS, PREFIX, packed_batch, padded_batch
from tests.support import frozen_policy_loss as frozen
from tests.support.off_policy_reference import random_inputs

OPTIONS = [
    dict(agg="token-mean", ratio_level="token", dual_clip=3.0, kl_estimator="k3"),
    dict(agg="seq-mean-token-mean", ratio_level="token", dual_clip=None, kl_estimator="k2"),
    dict(agg="seq-mean-token-sum-norm", ratio_level="token", dual_clip=3.0, kl_estimator="k1"),
    dict(agg="token-mean", ratio_level="sequence", dual_clip=3.0, kl_estimator="k3"),
    dict(agg="seq-mean-token-mean", ratio_level="sequence", dual_clip=None, kl_estimator="k3"),
]
CASES = [(o, packed) for o in OPTIONS for packed in (False, True)]
IDS = ["{agg}/{ratio_level}/dual={dual_clip}/{kl_estimator}".format(**o) + ("/packed" if p else "/rows")
       for o, p in CASES]


@partial(jax.jit, static_argnames=("terms", "opts", "num_segments"))
def terms_and_grad(logp, old, ref, adv, mask, terms, opts, segment_ids=None, num_segments=None, sum_norm=None,
                   behaviour=None):
    extra = {} if behaviour is None else {"behaviour_logprobs": behaviour}

    def fn(lp):
        loss_sum, denom, sums = terms(lp, old, ref, adv, mask, **dict(opts), segment_ids=segment_ids,
                                      num_segments=num_segments, sum_norm=sum_norm, **extra)
        return loss_sum, (denom, sums)

    (loss_sum, (denom, sums)), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    return loss_sum, denom, sums, grad


def assert_bitwise(got, want):
    loss_sum, denom, sums, grad = got
    want_sum, want_denom, want_sums, want_grad = want
    assert float(loss_sum) == float(want_sum) and float(denom) == float(want_denom)
    for key, value in want_sums.items():
        assert float(sums[key]) == float(value), key
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))


@pytest.mark.parametrize("options,packed", CASES, ids=IDS)
def test_the_on_policy_loss_and_gradient_are_bitwise_today_s(options, packed):
    logp, old, _, ref, adv, mask, packing = random_inputs(10, packed=packed)
    opts = tuple(sorted(dict(options, clip_low=0.2, clip_high=0.28, kl_coef=0.05).items()))
    want = terms_and_grad(logp, old, ref, adv, mask, frozen.policy_loss_terms, opts, **packing)
    assert float(want[0]) != 0.0 and np.abs(np.asarray(want[3])).max() > 0
    assert_bitwise(terms_and_grad(logp, old, ref, adv, mask, policy_loss_terms, opts, **packing), want)


def test_recomputed_logprobs_without_a_cap_train_as_today_s_recompute():
    """With recompute and no cap, the behaviour logprobs add statistics only: the loss and its
    gradient are those of the recomputed logprobs replacing the rollout's, as before."""
    logp, prox, behav, ref, adv, mask, packing = random_inputs(11, packed=True)
    opts = tuple(sorted(dict(OPTIONS[0], clip_low=0.2, clip_high=0.28, kl_coef=0.05).items()))
    want = terms_and_grad(logp, prox, ref, adv, mask, frozen.policy_loss_terms, opts, **packing)
    got = terms_and_grad(logp, prox, ref, adv, mask, policy_loss_terms, opts, **packing, behaviour=behav)
    assert_bitwise(got, want)
    assert float(got[2]["behav_log_diff_sum"]) > 0


def test_the_on_policy_update_is_bitwise_today_s():
    """A whole GRPO step (packed rows, two microbatches, the KL reference, AdamW) with the
    default settings: today's loss_fn, frozen, in the same step gives the same params and metrics."""
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = init_params(CFG, jax.random.key(0))
    ref = jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    grpo = GRPOConfig(kl_coef=0.01)
    rows = len(pack_bins(LENGTHS, 48, PREFIX))
    batch = packed_batch(padded_batch(2), PREFIX, rows + rows % 2)
    segments = len(LENGTHS) + 1
    step = make_grpo_step(CFG, make_optimizer(1e-3), mesh, grpo=grpo, shared_prefix=PREFIX, microbatches=2,
                          segments=segments, donate=False)
    loss_fn = frozen.grpo_loss_fn(CFG, grpo, temperature=1.0, shared_prefix=PREFIX, segments=segments)
    shardings = param_shardings(CFG, mesh)
    today = TrainStep(loss_fn, make_optimizer(1e-3), mesh, shardings, microbatches=2, prepare_fn=grpo_prepare,
                      finalize_fn=grpo_finalize, frozen_shardings=shardings, requires_frozen=True, donate=False)
    state, metrics = step(step.init_state(params), batch, ref)
    want_state, want_metrics = today(today.init_state(params), batch, ref)
    assert set(metrics) == set(want_metrics)  # no off-policy metrics either
    for key, value in want_metrics.items():
        assert float(metrics[key]) == float(value), key
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree.leaves(state.params),
                                                                          jax.tree.leaves(params))]
    assert max(moved) > 0
