"""A rollout against a scripted user that answers after a delay (`user.latency_s`): the
conversations wait on their users at the same time, so the rollout's wall time is about
the slowest conversation's waiting, not the sum of all the waits. (Slow tier: the 8-slot
engine's compiles; tests/domains/test_latency.py's concurrent sessions are the default's.)"""
from __future__ import annotations

import functools
import time

from muajax.agent.rollout import run_rollouts_sync
from muajax.domains.builtin.user import ScriptedUser
from muajax.domains.latency import ReplyDelay
from muajax.engine.engine import Engine
from tests.agent.test_rollout import MAX_LEN, builtin_env, tiny_model, tokenizer

SLOTS = 8
DELAY = ReplyDelay(0.3, jitter=0.3, seed=5)


@functools.cache
def engine() -> Engine:
    cfg, params = tiny_model()
    return Engine(params, cfg, num_slots=SLOTS, max_len=MAX_LEN, decode_chunk=8, extend_widths=(128,))


def rollout(delay: ReplyDelay | None):
    env = builtin_env()
    t0 = time.perf_counter()
    batch = run_rollouts_sync(engine(), tokenizer(), env, ScriptedUser(max_stalls=2, delay=delay),
                              env.tasks("train")[:4], n_per_task=2, max_turns=4, max_new_tokens_per_turn=10, seed=7)
    return batch, time.perf_counter() - t0


def test_the_conversations_wait_on_their_users_together():
    # the first runs compile the engine's programs at the shapes each schedule calls them at
    # (a delay staggers the conversations: other row counts); no delay: the users answer at once
    plain, _ = rollout(None)
    rollout(DELAY)
    _, fast = rollout(None)
    delayed, wall = rollout(DELAY)
    assert len(delayed) == SLOTS and engine().free_slots == SLOTS
    # the delay changes when a reply arrives, never what it says
    assert [t.messages for t in delayed] == [t.messages for t in plain]
    waits = [sum(t.user_latency_s) for t in delayed]
    assert all(len(t.user_latency_s) >= 1 and min(t.user_latency_s) >= 0.3 * (1 - 3 ** 0.5 * 0.3)
               for t in delayed)
    assert sum(len(t.user_latency_s) for t in delayed) >= 2 * SLOTS
    # one conversation's own waits bound the wall from below; the engine's work and the
    # loop's overhead add to them, but the waits of the others do not
    assert max(waits) <= wall < max(waits) + fast + 1.0
    assert sum(waits) > 3 * wall, (waits, wall)
