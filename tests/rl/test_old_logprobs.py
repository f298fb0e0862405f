"""`grpo.recompute_old_logprobs`: the old logprobs come from the trainer's own forward of the
params the step starts from (verl), so the first pass's ratio is exactly 1 whatever the
rollout's logprobs were."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models.qwen3 import forward
from muajax.rl.grpo import GRPOConfig, make_grpo_step, make_old_logprobs_fn
from muajax.rl.optim import make_optimizer
from tests.support.tiny_models import ONE_LAYER_CONFIG, grpo_update_setup

CFG = ONE_LAYER_CONFIG.replace(rope_theta=10000.0)
B, T = 4, 16


@pytest.fixture(scope="module")
def setup():  # the rollout's logprobs far below the trainer's: every ratio would be clipped
    return grpo_update_setup(CFG, [0.7071, -0.7071, 0.7071, -0.7071], B, T)


def first_pass(mesh, params, batch, **options):
    grpo = GRPOConfig(kl_coef=0.0, **options)
    step = make_grpo_step(CFG, make_optimizer(1e-3), mesh, grpo=grpo)
    _, metrics = step(step.init_state(params), batch)
    return {k: float(v) for k, v in metrics.items()}


def test_recomputed_old_logprobs_make_the_first_ratio_exactly_one(setup):
    mesh, params, batch = setup
    stale = first_pass(mesh, params, batch)
    assert stale["ratio_mean"] > 100 and stale["clip_frac"] > 0.4  # the rollout's logprobs were used
    fresh = first_pass(mesh, params, batch, recompute_old_logprobs=True)
    assert fresh["ratio_mean"] == 1.0 and fresh["ppo_kl"] == 0.0 and fresh["clip_frac"] == 0.0
    assert fresh["num_tokens"] == stale["num_tokens"] == B * (T - 5)


def reference_logprobs(params, tokens):
    """log p(tokens[t] | tokens[:t]) from a plain forward, by the token predicted (0 at t=0)."""
    logits, _ = forward(params, CFG, jnp.asarray(tokens))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp[:, :-1], jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    return np.concatenate([np.zeros((tokens.shape[0], 1), np.float32), np.asarray(picked)], axis=1)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_mini_batch_forward_gives_the_trainer_s_logprobs(setup, microbatches):
    mesh, params, batch = setup
    grpo = GRPOConfig(kl_coef=0.0, minibatch_size=B, recompute_old_logprobs=True)
    old = np.asarray(make_old_logprobs_fn(CFG, mesh, grpo, temperature=1.0, microbatches=microbatches)(params, batch))
    assert old.shape == (B, T) and (old[batch["loss_mask"] == 0] == 0).all()
    want = np.where(batch["loss_mask"] > 0, reference_logprobs(params, batch["tokens"]), 0.0)
    np.testing.assert_allclose(old, want, rtol=1e-5, atol=1e-5)
    # fed to the step as the old logprobs, the first pass's ratio is 1 up to float rounding
    again = first_pass(mesh, params, dict(batch, old_logprobs=old), minibatch_size=B)
    assert abs(again["ratio_mean"] - 1.0) < 1e-6 and abs(again["ppo_kl"]) < 1e-6 and again["clip_frac"] == 0.0
