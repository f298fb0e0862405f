"""One run of `tests/train/test_determinism.py`: a short GRPO run of the built-in domain whose
simulated users and tools answer after random delays (from the OS's entropy: different in
every run), so replies arrive in a different order each time.

Run as `python -m tests.support.workers.jitter OUT_DIR [overrides...]`; prints one line
`RESULT {json}`: the params' sha256 and the conversations (by seed) of every decode call.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from muajax.config.schema import load_config
from muajax.domains.base import Domain, Environment, EnvSession, UserSession, UserSimulator
from muajax.domains.registry import make_domain
from muajax.engine.engine import Engine
from muajax.runtime import build
from muajax.train.context import build_context
from muajax.train.grpo import run_grpo
from muajax.train.trainer import params_fingerprint
from tests.support.tiny_models import arch_override

RUN = ["run.stages=[grpo]", "model.hf_dir=null", "model.vocab=domain",
       arch_override(),
       "rollout.n_per_task=3", "rollout.tasks_per_step=2", "rollout.max_turns=4", "rollout.max_new_tokens_per_turn=10",
       "rollout.max_context=1536", "env.builtin_terse_tools=true", "rollout.temperature=1.0", "grpo.steps=2", "grpo.learning_rate=1e-3",
       "grpo.microbatch_size=null", "eval.max_tasks=1", "metrics.progress_bar=false", "metrics.tensorboard=false",
       "checkpoint.every_steps=100"]
JITTER = random.Random()  # seeded by the OS: each run is timed differently


class _SlowSession(EnvSession):
    def __init__(self, inner: EnvSession):
        self.inner = inner

    def tools(self):
        return self.inner.tools()

    def step(self, call):  # runs in the tool thread pool
        time.sleep(JITTER.uniform(0, 0.1))
        return self.inner.step(call)

    def evaluate(self, messages, *, communicate_info):
        return self.inner.evaluate(messages, communicate_info=communicate_info)

    def close(self):
        self.inner.close()


class SlowEnvironment(Environment):
    def __init__(self, inner: Environment):
        self.inner, self.name = inner, inner.name

    def policy(self):
        return self.inner.policy()

    def policy_for(self, task):
        return self.inner.policy_for(task)

    def tasks(self, split):
        return self.inner.tasks(split)

    def reset(self, task):
        return _SlowSession(self.inner.reset(task))


class _SlowUserSession(UserSession):
    def __init__(self, inner: UserSession):
        self.inner = inner

    async def reply(self, agent_message):
        await asyncio.sleep(JITTER.uniform(0, 0.1))
        return await self.inner.reply(agent_message)


class SlowUser(UserSimulator):
    def __init__(self, inner: UserSimulator):
        self.inner = inner

    def start(self, task, env=None):
        return _SlowUserSession(self.inner.start(task, env))


def record_calls(log: list) -> None:
    """Log the seeds of the conversations in every decode call."""
    original = Engine._decode_call

    def logged(self, ready):
        log.append(sorted(state.seed for state, _ in ready))
        return original(self, ready)

    Engine._decode_call = logged


def main(out_dir: str, overrides: list[str]) -> None:
    cfg = load_config(None, [*RUN, f"run.out_dir={out_dir}", *overrides])
    inner = make_domain(cfg.env, cfg.user)
    ctx = build_context(cfg, domain=Domain(SlowEnvironment(inner.env), SlowUser(inner.user)))
    calls: list = []
    record_calls(calls)
    params = run_grpo(ctx, build.initial_params(ctx.model_cfg, ctx.hf_dir, ctx.mesh, cfg.run.seed))
    print("RESULT " + json.dumps({"params_sha256": params_fingerprint(params), "decode_calls": calls}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
