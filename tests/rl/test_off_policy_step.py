"""The off-policy correction in the GRPO update (`grpo.behaviour_is_cap` with
`grpo.recompute_old_logprobs`): the config's cap reaches the step's loss, with one update per
step and with mini-batches (whose batch carries the recomputed `prox_logprobs` beside the
rollout's `old_logprobs`), and its statistics come out as metrics."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from muajax.config.schema import load_config
from muajax.rl.grpo import GRPOConfig, make_grpo_step, make_old_logprobs_fn
from muajax.rl.optim import make_optimizer
from muajax.settings.fields import ConfigError
from tests.support.tiny_models import ONE_LAYER_CONFIG, grpo_update_setup

CFG = ONE_LAYER_CONFIG.replace(rope_theta=10000.0)
B, T = 4, 16


@pytest.fixture(scope="module")
def setup():  # the rollout's logprobs far below the trainer's: every ratio would be clipped
    return grpo_update_setup(CFG, [1.2, -0.4, 0.3, 0.9], B, T)


def first_update(mesh, params, batch, **options):
    step = make_grpo_step(CFG, make_optimizer(1e-3), mesh, grpo=GRPOConfig(kl_coef=0.0, **options), donate=False)
    _, metrics = step(step.init_state(params), batch)
    return {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("minibatch_size", [None, B])
def test_the_cap_weights_every_token_of_the_first_update(setup, minibatch_size):
    """On the first update the ratio to the proximal policy is 1 and every token's weight is
    truncated to the cap: loss and gradient are the cap times those without a weight."""
    mesh, params, batch = setup
    if minibatch_size is not None:
        grpo = GRPOConfig(kl_coef=0.0, minibatch_size=B, recompute_old_logprobs=True)
        batch = dict(batch, prox_logprobs=make_old_logprobs_fn(CFG, mesh, grpo, temperature=1.0)(params, batch))
    options = dict(recompute_old_logprobs=True, minibatch_size=minibatch_size)
    plain = first_update(mesh, params, batch, **options)
    capped = first_update(mesh, params, batch, behaviour_is_cap=2.0, **options)
    assert abs(plain["loss"]) > 1e-4 and abs(plain["ratio_mean"] - 1.0) < 1e-6
    np.testing.assert_allclose(capped["loss"], 2.0 * plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(capped["grad_norm"], 2.0 * plain["grad_norm"], rtol=1e-5)
    assert capped["off_policy/is_truncated_frac"] == 1.0 and capped["off_policy/is_weight_mean"] == 2.0
    # the statistics come without a cap too; the weight's only with one
    for metrics in (plain, capped):
        assert metrics["off_policy/behav_ratio_max"] >= metrics["off_policy/behav_ratio_mean"] > np.exp(3.0)
        assert metrics["off_policy/behav_log_diff"] > 3.0
    assert "off_policy/is_weight_mean" not in plain


def test_mini_batches_without_their_proximal_logprobs_are_refused(setup):
    mesh, params, batch = setup
    with pytest.raises(KeyError, match="prox_logprobs"):
        first_update(mesh, params, batch, recompute_old_logprobs=True, minibatch_size=B)


def test_no_recompute_no_off_policy_metrics(setup):
    mesh, params, batch = setup
    assert not [k for k in first_update(mesh, params, batch) if k.startswith("off_policy/")]


def test_the_config_s_cap():
    grpo = load_config(None, ["grpo.recompute_old_logprobs=true", "grpo.behaviour_is_cap=2"]).grpo
    assert grpo.loss_settings()["behaviour_is_cap"] == 2.0
    assert load_config(None, []).grpo.behaviour_is_cap is None  # the default: no weight
    with pytest.raises(ConfigError, match="behaviour_is_cap"):
        load_config(None, ["grpo.behaviour_is_cap=2"])  # without recompute the weight would be 1
    with pytest.raises(ConfigError, match="behaviour_is_cap"):
        GRPOConfig(recompute_old_logprobs=True, behaviour_is_cap=0.5)  # would truncate on-policy tokens
