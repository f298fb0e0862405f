"""Routing replay's rollouts: with an engine that records experts (`Engine(record_experts=True)`,
a tiny chatty mixture of experts with the real tokenizer), each trajectory the rollout loop
returns carries the experts of every token the engine computed (prompt, user and tool turns,
sampled tokens: all but the newest), those a plain forward over the trajectory chooses."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from muajax.agent.rollout import run_rollouts_sync
from muajax.bench.rollout import chatty_params, random_params, tiny_config
from muajax.domains.builtin import BuiltinEnvironment
from muajax.domains.builtin.user import ScriptedUser
from muajax.engine.engine import Engine
from muajax.models.qwen3 import forward
from muajax.models.tokenizer import load_tokenizer

MAX_LEN = 2048


def test_trajectories_carry_the_engine_s_experts_of_every_computed_token():
    cfg = tiny_config().replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    tok = load_tokenizer()
    params = chatty_params(random_params(cfg, seed=0), tok, mean_turn_tokens=6.0)
    engine = Engine(params, cfg, num_slots=2, max_len=MAX_LEN, decode_chunk=8, record_experts=True)
    env = BuiltinEnvironment(seed=0)
    batch = run_rollouts_sync(engine, tok, env, ScriptedUser(max_stalls=2), env.tasks("train")[:1], n_per_task=2,
                              max_turns=3, max_new_tokens_per_turn=10, seed=7)
    plain = jax.jit(lambda row: forward(params, cfg, row[None], return_routing=True)[2].experts[:, 0])
    assert len(batch) == 2 and engine.free_slots == 2
    for traj in batch:
        traj.check()
        assert traj.assistant_turns >= 1 and traj.experts.dtype == np.uint8
        assert traj.experts.shape == (len(traj.tokens) - 1, cfg.num_layers, cfg.num_experts_per_tok)
        row = np.zeros(MAX_LEN, np.int32)
        row[: len(traj.tokens)] = traj.tokens
        want = np.asarray(plain(jnp.asarray(row))).transpose(1, 0, 2)[: len(traj.tokens) - 1]
        np.testing.assert_array_equal(traj.experts, want)
