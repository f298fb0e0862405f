"""Routing replay (`grpo.routing_replay`): the rollout engine records each token's experts, the
trajectories carry them, the host batch pads and packs them with their tokens (a shared
prefix too), and the trainer's forward uses them: its logprobs of a rollout are the
engine's to 1e-5 in float32. Without replay they are not, where routing is near a tie: the
routers here give every expert nearly the same logit (each column the first one plus 1e-7
times noise), so the trainer's and the engine's different computation orders (a plain
forward against paged, packed extends and a decode loop) choose different experts."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses

import jax
import numpy as np
import pytest

from muajax import parallel
from muajax.agent.trajectory import Trajectory
from muajax.engine.engine import Engine, SamplingParams
from muajax.rl.grpo import GRPOConfig, make_grpo_step, make_old_logprobs_fn
from muajax.rl.optim import make_optimizer
from muajax.runtime.grpo_layout import make_layout
from muajax.settings.fields import ConfigError
from tests.support.tiny_models import MOE_CONFIG, engine_params, random_ids

CFG = MOE_CONFIG.replace(vocab_size=500)
SYSTEM = 130  # tokens every conversation starts with (a shared prefix from 128 on)
LENGTH = 256


def near_tie(params, eps: float = 1e-7):
    """Every layer's router columns the first column plus `eps` times noise: near ties everywhere."""
    router = params["layers"]["router"]
    noise = jax.random.normal(jax.random.key(1), router.shape)
    return {**params, "layers": {**params["layers"], "router": router[..., :1] + eps * noise}}


def rollouts(params) -> list[Trajectory]:
    """Four conversations of two sampled turns around a user turn, on a registered prefix,
    as the rollout loop records them (experts read before the slot is released)."""
    rng = np.random.RandomState(0)
    system = random_ids(rng, SYSTEM, CFG)
    engine = Engine(params, CFG, num_slots=4, max_len=LENGTH, stop_ids=(), decode_chunk=8, record_experts=True)
    engine.register_prefix(system)
    records = []
    for i in range(4):
        prompt = system + random_ids(rng, 5 + 3 * i, CFG)
        slot = engine.open(prompt, seed=i)
        tokens, mask, logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
        for turn in range(2):
            gen = engine.generate([slot], SamplingParams(temperature=1.0, max_new_tokens=12 + 5 * i))[slot]
            tokens += gen.tokens
            mask += [1] * len(gen.tokens)
            logprobs += gen.logprobs
            if turn == 0:
                user = random_ids(rng, 9, CFG)
                engine.append(slot, user)
                tokens, mask, logprobs = tokens + user, mask + [0] * 9, logprobs + [0.0] * 9
        records.append(Trajectory(task_id=str(i // 2), group_id=i // 2, rollout_index=i % 2, seed=i, tokens=tokens,
                                  loss_mask=mask, logprobs=logprobs, prompt_len=len(prompt), messages=[],
                                  termination="user_stop", reward=float(i % 2), experts=engine.experts(slot)))
        engine.release(slot)
    return records


@pytest.fixture(scope="module")
def setup():
    params = near_tie(engine_params(CFG))
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return mesh, params, rollouts(params)


def layout_batch(mesh, trajectories, grpo, prefix: int):
    layout = make_layout(mesh, CFG, grpo, batch_size=4, max_context=LENGTH, temperature=1.0, prompt_prefix=prefix)
    (batch,) = layout.update_batches(trajectories, grpo, mesh=mesh, pad_id=0, first_group=0)
    return layout, batch


def trainer_deviation(mesh, params, trajectories, *, replay: bool, packed: bool, prefix: int) -> float:
    """max |trainer's - engine's logprob| over the sampled tokens."""
    grpo = GRPOConfig(kl_coef=0.0, routing_replay=replay, pack_rows=packed, length_buckets=(LENGTH,))
    layout, batch = layout_batch(mesh, trajectories, grpo, prefix)
    assert layout.shared_prefix == (SYSTEM if prefix else 0) and ("routing" in batch) == replay
    fn = make_old_logprobs_fn(CFG, mesh, grpo, temperature=1.0, shared_prefix=layout.shared_prefix,
                              packed=layout.packed)
    trainer = np.asarray(fn(params, batch))
    on_mask = batch["loss_mask"] > 0
    assert on_mask.sum() == sum(t.num_sampled for t in trajectories)
    return float(np.abs(trainer - batch["old_logprobs"])[on_mask].max())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("prefix", [0, SYSTEM], ids=["no-prefix", "shared-prefix"])
def test_with_replay_the_trainer_s_logprobs_are_the_engine_s(setup, packed, prefix):
    mesh, params, trajectories = setup
    assert trainer_deviation(mesh, params, trajectories, replay=True, packed=packed, prefix=prefix) <= 1e-5
    # the same near ties route the trainer's own forward elsewhere: without replay they differ
    assert trainer_deviation(mesh, params, trajectories, replay=False, packed=packed, prefix=prefix) > 1e-4


def test_the_first_pass_ratio_deviation_with_and_without_replay(setup):
    """`first_pass/ratio_abs_dev` is the first update's `ratio_abs_dev` (muajax.train.grpo)."""
    mesh, params, trajectories = setup
    devs = {}
    for replay in (False, True):
        grpo = GRPOConfig(kl_coef=0.0, routing_replay=replay, length_buckets=(LENGTH,))
        layout, batch = layout_batch(mesh, trajectories, grpo, SYSTEM)
        step = layout.make_step(CFG, mesh, grpo, total_steps=1)
        _, metrics = step(step.init_state(params), batch)
        devs[replay] = float(metrics["ratio_abs_dev"])
    assert devs[True] < 1e-6 and devs[False] > 10 * max(devs[True], 1e-7), devs


def test_routing_replay_is_off_by_default_and_needs_a_mixture_of_experts(setup):
    mesh, _, trajectories = setup
    assert GRPOConfig().routing_replay is False
    dense = CFG.replace(num_experts=0)
    with pytest.raises(ConfigError, match="routing_replay"):
        make_layout(mesh, dense, GRPOConfig(routing_replay=True), batch_size=4, max_context=LENGTH, temperature=1.0,
                    prompt_prefix=0)
    grpo = GRPOConfig(routing_replay=True, length_buckets=(LENGTH,))
    layout = make_layout(mesh, CFG, grpo, batch_size=4, max_context=LENGTH, temperature=1.0, prompt_prefix=0)
    declared = layout.abstract_batch(mesh)["routing"]  # what the planner compiles
    assert declared.shape == (4, LENGTH, CFG.num_layers, CFG.num_experts_per_tok) and declared.dtype == np.uint8
    assert "routing" not in make_layout(mesh, CFG, GRPOConfig(), batch_size=4, max_context=LENGTH, temperature=1.0,
                                        prompt_prefix=0).abstract_batch(mesh)
    with pytest.raises(ValueError, match="no experts for grpo.routing_replay"):
        layout_batch(mesh, [dataclasses.replace(trajectories[0], experts=None)] + trajectories[1:], grpo, 0)
