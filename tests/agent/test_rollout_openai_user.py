"""Rollouts whose simulated users live behind a real OpenAI-compatible HTTP server on 127.0.0.1,
healthy, and failing / stalling a share of requests."""
from __future__ import annotations

import asyncio
import time

from muajax.agent.rollout import run_rollouts
from muajax.agent.trajectory import MAX_TURNS, USER_ERROR, USER_STOP
from muajax.domains.base import STOP, UserSimulator
from muajax.domains.openai_user import OpenAIUserSimulator
from tests.support.openai_server import ScriptedOpenAIServer
from tests.agent.test_rollout import builtin_env, shared_engine, tokenizer

KEY_ENV = "MUAJAX_ROLLOUT_TEST_NO_KEY"  # unset: local servers need no key
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "seed": 0, "api_key_env": KEY_ENV}


def agent_lines(request: dict) -> list[str]:
    """The agent's messages as the user saw them (role-flipped: the agent is "user")."""
    return [m["content"] for m in request["messages"] if m["role"] == "user"]


def stop_after(k: int):
    def script(request: dict) -> str:
        heard = agent_lines(request)
        return f"Thanks, bye. {STOP}" if len(heard) >= k else f"Reply {len(heard)}: go on."
    return script


class PerTaskUser(UserSimulator):
    """Each task's users come from its own simulator (here: one per server)."""

    def __init__(self, by_task: dict[str, UserSimulator]):
        self.by_task = by_task

    def start(self, task, env=None):
        return self.by_task[task.task_id].start(task, env)


def test_rollouts_against_an_http_user(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    env = builtin_env()
    tasks = env.tasks("train")[:2]
    with ScriptedOpenAIServer(stop_after(2), latency_s=0.05) as server:
        async def main():
            user = OpenAIUserSimulator(model="user-sim", base_url=server.url, timeout_s=10.0, max_retries=2, **FAST)
            try:
                return await run_rollouts(shared_engine(), tokenizer(), env, user, tasks, n_per_task=2, max_turns=6,
                                          max_new_tokens_per_turn=10, seed=11), user.stats()
            finally:
                await user.aclose()

        batch, stats = asyncio.run(main())
        requests = server.chat_requests
    assert len(batch) == 4 and shared_engine().free_slots == shared_engine().num_slots
    user_turns = 0
    for traj in batch:
        traj.check()
        assert traj.termination in (USER_STOP, MAX_TURNS), traj.termination
        replies = [m for m in traj.messages[1:] if m["role"] == "user"]
        user_turns += len(replies)
        assert len(traj.user_latency_s) == len(replies) and all(x >= 0.05 for x in traj.user_latency_s)
        if traj.termination == USER_STOP:
            assert replies[-1]["content"] == f"Thanks, bye. {STOP}" and len(replies) == 2
        # what the server heard from this conversation is exactly its plain-text assistant turns
        said = [m["content"] for i, m in enumerate(traj.messages)
                if m["role"] == "assistant" and i + 1 < len(traj.messages) and traj.messages[i + 1]["role"] == "user"]
        if not said:
            continue
        last = [r for r in requests if r.body["messages"][1]["content"] == traj.messages[0]["content"]
                and agent_lines(r.body) == said]
        assert last, f"no request carried the agent's messages {said!r}"
    assert stats["requests"] == len(requests) == user_turns and stats["failures"] == 0
    assert all(r.body["model"] == "user-sim" for r in requests)
    assert server.max_in_flight >= 1 and batch.stats["wall_s"] > 0


def test_failing_and_stalling_user_endpoints_never_lose_trajectories(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    env = builtin_env()
    tasks = env.tasks("train")[:3]
    dead = ScriptedOpenAIServer(stop_after(2), fail_rate=1.0)
    # the first request fails and the second stalls past the client timeout, for sure;
    # after that a random share of requests fails or stalls
    flaky = ScriptedOpenAIServer(stop_after(2), fail_first=1, stall_first=1, fail_rate=0.25, stall_rate=0.15,
                                 stall_s=2.0, seed=3)
    healthy = ScriptedOpenAIServer(stop_after(1))
    with dead, flaky, healthy:
        async def main():
            sims = {
                tasks[0].task_id: OpenAIUserSimulator(model="dead", base_url=dead.url, timeout_s=2.0, max_retries=1,
                                                      **FAST),
                tasks[1].task_id: OpenAIUserSimulator(model="flaky", base_url=flaky.url, timeout_s=0.3,
                                                      max_retries=4, **FAST),
                tasks[2].task_id: OpenAIUserSimulator(model="ok", base_url=healthy.url, max_retries=0, **FAST),
            }
            try:
                batch = await run_rollouts(shared_engine(), tokenizer(), env, PerTaskUser(sims), tasks, n_per_task=2,
                                           max_turns=6, max_new_tokens_per_turn=10, seed=5)
                return batch, {k: s.stats() for k, s in sims.items()}
            finally:
                for s in sims.values():
                    await s.aclose()

        start = time.perf_counter()
        batch, stats = asyncio.run(main())
        elapsed = time.perf_counter() - start
        counts = {"dead": dead.counts, "flaky": flaky.counts}
    assert len(batch) == 6 and [(t.group_id, t.rollout_index) for t in batch] == [(g, r) for g in range(3)
                                                                                 for r in range(2)]
    assert shared_engine().free_slots == shared_engine().num_slots
    by_group = {g: [t for t in batch if t.group_id == g] for g in range(3)}
    for traj in batch:
        traj.check()
        assert traj.termination in (USER_ERROR, USER_STOP, MAX_TURNS), traj.termination
    # the dead endpoint: every conversation that reached its user ended with a recorded error
    for traj in by_group[0]:
        if len(traj.user_latency_s):
            assert traj.termination == USER_ERROR and "gave up after 2 attempts" in traj.error
            assert "HTTP 500" in traj.error and traj.messages[-1]["role"] == "assistant"
    assert stats[tasks[0].task_id]["failures"] >= 1 and counts["dead"]["failed"] == counts["dead"]["chat"]
    # the flaky endpoint: failures and timeouts were retried
    flaky_stats = stats[tasks[1].task_id]
    assert counts["flaky"]["failed"] >= 1 and counts["flaky"]["stalled"] >= 1
    assert flaky_stats["retries"] >= 2 and flaky_stats["timeouts"] >= 1
    for traj in by_group[1]:
        if traj.termination == USER_ERROR:
            assert traj.error
        else:
            assert traj.messages[-1]["role"] in ("user", "tool") and traj.error is None
    # the healthy endpoint's conversations completed untouched by the others' failures
    for traj in by_group[2]:
        assert traj.termination in (USER_STOP, MAX_TURNS) and traj.error is None
        assert traj.termination == MAX_TURNS or traj.messages[-1]["content"].endswith(STOP)
    assert elapsed < 60
