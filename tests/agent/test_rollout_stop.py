"""A stop request while every conversation waits on a slow user: the rollout drops them
within `STOP_POLL_S` (not after the user's 30 s), releases every slot and raises
`RolloutsStopped`; the engine then rolls out as before."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from muajax.agent import rollout
from muajax.agent.rollout import RolloutsStopped, run_rollouts_sync
from muajax.domains.builtin.user import ScriptedUser
from tests.agent.test_rollout import builtin_env, shared_engine, tokenizer


class StopOnFirstQuestion(ScriptedUser):
    """A user that takes 30 s to answer; its first question sets the stop request."""

    def __init__(self, stop: threading.Event):
        super().__init__(max_stalls=2)
        self.stop, self.asked_at = stop, None

    def start(self, task, env=None):
        session, user = super().start(task, env), self

        class Slow(type(session)):
            async def reply(self, agent_message):
                if user.asked_at is None:
                    user.asked_at = time.perf_counter()
                    user.stop.set()
                await asyncio.sleep(30)
                return await super().reply(agent_message)

        session.__class__ = Slow
        return session


@pytest.mark.parametrize("default", [False, True])
def test_a_stop_drops_the_conversations_waiting_on_their_users(default):
    engine, env = shared_engine(), builtin_env()
    stop = threading.Event()
    user = StopOnFirstQuestion(stop)
    if default:  # what muajax.runtime.stopping.install does: every rollout obeys the process's request
        rollout.set_default_stop(stop)
    try:
        with pytest.raises(RolloutsStopped, match=r"conversation\(s\) in flight"):
            run_rollouts_sync(engine, tokenizer(), env, user, env.tasks("train")[:2], n_per_task=2, max_turns=4,
                              max_new_tokens_per_turn=10, seed=7, stop=None if default else stop)
        took = time.perf_counter() - user.asked_at
    finally:
        rollout.set_default_stop(None)
    # the engine call in progress, then at most one poll: far from the user's 30 s
    assert took < 10 * rollout.STOP_POLL_S + 2.0, took
    print(f"stopped {took:.2f}s after the request")
    assert engine.free_slots == engine.num_slots
    batch = run_rollouts_sync(engine, tokenizer(), env, ScriptedUser(max_stalls=2), env.tasks("train")[:1],
                              n_per_task=2, max_turns=2, max_new_tokens_per_turn=10, seed=7)
    assert len(batch) == 2
