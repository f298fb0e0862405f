"""The GRPO stage's update (`muajax.train.grpo._update`) with recomputed logprobs and
mini-batches keeps both policies' logprobs: the rollout's `old_logprobs` (the behaviour
policy) and the recomputed `prox_logprobs` (the proximal policy) reach every update; and the
updates' maxima are reported as their max, not their mean."""
import os
from types import SimpleNamespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from muajax.rl.grpo import GRPOConfig
from muajax.train.grpo import _update


def test_the_update_keeps_the_behaviour_and_the_proximal_logprobs():
    parts = [{"tokens": np.full((2, 4), i, np.int32), "old_logprobs": np.full((2, 4), -1.0 - i, np.float32)}
             for i in range(2)]
    seen = []

    def step_fn(state, placed):
        seen.append(placed)
        n = len(seen)
        return state, {"loss": float(n), "clip_frac": 0.0, "ratio_abs_dev": 0.0,
                       "off_policy/behav_ratio_max": [5.0, 3.0, 2.0, 1.0][n - 1], "step": float(n)}

    prox = lambda params, part: part["old_logprobs"] + params  # the "forward" of the step's params
    grpo = GRPOConfig(kl_coef=0.0, minibatch_size=2, ppo_epochs=2, recompute_old_logprobs=True)
    _, summary, shapes = _update(step_fn, SimpleNamespace(params=0.5), parts, None, grpo, prox)
    assert len(seen) == 4 and shapes == [(2, 4), (2, 4)]
    for placed, part in zip(seen, parts * 2):
        np.testing.assert_array_equal(placed["old_logprobs"], part["old_logprobs"])  # the rollout's, kept
        np.testing.assert_array_equal(placed["prox_logprobs"], part["old_logprobs"] + 0.5)
    assert summary["off_policy/behav_ratio_max"] == 5.0 and summary["loss"] == 2.5


def test_the_grpo_stage_logs_the_off_policy_correction(tmp_path):
    """A GRPO step with recomputed logprobs, two mini-batches and a cap: the correction's
    statistics are in the step's record (the engine's logprobs are the behaviour policy's)."""
    from tests.train.test_grpo import one_step

    _, _, record = one_step(tmp_path, "capped", "grpo.recompute_old_logprobs=true", "grpo.minibatch_size=2",
                            "grpo.behaviour_is_cap=2")
    assert record["updates"] == 2
    # the engine and the trainer compute the same policy: the ratio is 1 but for float rounding
    assert 0 < record["off_policy/behav_ratio_max"] < 1.01 and record["off_policy/behav_log_diff"] < 1e-2
    assert record["off_policy/is_truncated_frac"] == 0.0
    assert abs(record["off_policy/is_weight_mean"] - record["off_policy/behav_ratio_mean"]) < 1e-6
