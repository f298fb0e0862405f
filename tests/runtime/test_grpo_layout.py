"""`GRPOLayout`'s batches: what the host builds (`fields`) and what the step takes
(`abstract_batch`, the planner's): the latter also carries the recomputed `prox_logprobs`
when recompute_old_logprobs runs before mini-batch updates."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from muajax import parallel
from muajax.rl.grpo import GRPOConfig
from muajax.runtime.grpo_layout import make_layout
from tests.support.tiny_models import ONE_LAYER_CONFIG


@pytest.mark.parametrize("options,proximal", [(dict(), False), (dict(recompute_old_logprobs=True), False),
                                              (dict(recompute_old_logprobs=True, minibatch_size=4), True)])
def test_the_step_s_batch_carries_the_proximal_logprobs_when_they_are_recomputed(options, proximal):
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    layout = make_layout(mesh, ONE_LAYER_CONFIG, GRPOConfig(**options), batch_size=8, max_context=512,
                         temperature=1.0, prompt_prefix=0)
    batch = layout.abstract_batch(mesh)
    assert layout.proximal == proximal and "prox_logprobs" not in layout.fields()
    assert set(batch) == set(layout.fields()) | ({"prox_logprobs"} if proximal else set())
    if proximal:
        assert batch["prox_logprobs"].shape == batch["old_logprobs"].shape
        assert batch["prox_logprobs"].dtype == np.float32
