"""Replaying tasks' gold actions through muajax's own environment and reward path
(`python -m muajax.eval --policy gold`): a check that a domain's tools, its gold data and
its evaluator agree, which anyone can run on a new domain before training on it.

Per task: a fresh session (`env.reset`), the opening user message, then the gold actions
as the agent's tool calls, run by the `execute_tools` a rollout uses, each call in its own
assistant message. Where the gold is a list of calls per user turn (BFCL: the task's
`gold_turn_lengths`), each turn's calls go in one message, as parallel calls, and the
domain's own user (BFCL's scripted turns) answers the agent's closing text with the next
turn. The simulated user's own actions (τ2 telecom: requestor "user") run through
`user_step`. A call whose observation ends the episode (a transfer) ends the replay, as it
ends a rollout. The transcript is scored by `session.evaluate` with communicate_info off:
a replay has the gold actions, not the words a good agent would say.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from muajax.agent.calls import execute_tools
from muajax.agent.conversation import close_quietly
from muajax.domains.base import Environment, EnvSession, Evaluation, Task, ToolCall, UserSimulator

CLOSING_TEXT = "Done."


@dataclasses.dataclass(frozen=True)
class GoldReplay:
    task_id: str
    reward: float
    partial: float
    calls: int  # gold calls that ran (the agent's and the user's)
    errors: int  # of which answered with an error observation
    details: dict[str, Any]


def gold_turns(task: Task) -> list[list[list[ToolCall]]]:
    """The gold actions as user turns of assistant messages of calls (see the module docstring)."""
    actions = list(task.gold_actions)
    lengths = task.metadata.get("gold_turn_lengths")
    if not lengths:
        return [[[call] for call in actions]]
    if sum(lengths) != len(actions):
        raise ValueError(f"task {task.task_id}: gold_turn_lengths sum to {sum(lengths)}, "
                         f"but it has {len(actions)} gold actions")
    turns, start = [], 0
    for n in lengths:
        turns.append([actions[start:start + n]] if n else [])
        start += n
    return turns


class _Replay:
    """One task's replay: the transcript and counters, kept while the calls run."""

    def __init__(self, task: Task, session: EnvSession):
        self.task, self.session = task, session
        self.requestors = list(task.metadata.get("gold_action_requestors") or ())
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task.first_user_message}]
        self.calls = self.errors = self.index = 0
        self.ended = False

    def run_message(self, calls: list[ToolCall]) -> None:
        """One assistant message of gold calls; the user's own calls run on their side."""
        agent_calls = []
        for call in calls:
            who = self.requestors[self.index] if self.index < len(self.requestors) else "assistant"
            self.index += 1
            if who == "user":
                self._count([self.session.user_step(call)])
            else:
                agent_calls.append(call)
        if not agent_calls:
            return
        n = len(self.messages)
        ids = [f"gold_{n}_{i}" for i in range(len(agent_calls))]
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": i, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in zip(ids, agent_calls)]})
        observations = execute_tools(self.session, agent_calls)
        for call_id, call, obs in zip(ids, agent_calls, observations):
            self.messages.append({"role": "tool", "tool_call_id": call_id, "name": call.name, "content": obs.content})
        self._count(observations)
        self.ended = any(obs.done for obs in observations)

    def _count(self, observations) -> None:
        self.calls += len(observations)
        self.errors += sum(bool(obs.error) for obs in observations)


async def _replay(env: Environment, task: Task, user: UserSimulator | None) -> GoldReplay:
    session = env.reset(task)
    try:
        replay = _Replay(task, session)
        turns = gold_turns(task)
        user_session = user.start(task, session) if user is not None and len(turns) > 1 else None
        for number, messages in enumerate(turns):
            for calls in messages:
                if not replay.ended:
                    replay.run_message(calls)
            if replay.ended:
                break
            replay.messages.append({"role": "assistant", "content": CLOSING_TEXT})
            if number + 1 < len(turns):
                if user_session is None:
                    raise ValueError(f"task {task.task_id} has {len(turns)} gold user turns: the replay needs "
                                     "the domain's user to move to the next one")
                turn = await user_session.reply(CLOSING_TEXT)
                replay.messages.append({"role": "user", "content": turn.text})
        try:
            evaluation = session.evaluate(replay.messages, communicate_info=False)
        except Exception as e:  # a domain whose evaluator breaks on its own gold: report it, go on
            evaluation = Evaluation(0.0, 0.0, {"evaluate_error": f"{type(e).__name__}: {e}"})
    finally:
        close_quietly(session)
    return GoldReplay(task.task_id, float(evaluation.reward), float(evaluation.partial), replay.calls,
                      replay.errors, dict(evaluation.details))


def replay_gold(env: Environment, tasks: Sequence[Task], user: UserSimulator | None = None) -> list[GoldReplay]:
    """Replay every task's gold actions (see the module docstring); `user` answers between
    the gold user turns of tasks that have them (BFCL)."""
    async def run_all():
        return [await _replay(env, task, user) for task in tasks]

    return asyncio.run(run_all())


def gold_summary(replays: Sequence[GoldReplay]) -> dict[str, Any]:
    """n, reward_mean, the reward histogram and the tasks that did not score 1."""
    n = len(replays)
    histogram = Counter(str(r.reward) for r in replays)
    return {"n": n, "reward_mean": sum(r.reward for r in replays) / n if n else 0.0,
            "partial_mean": sum(r.partial for r in replays) / n if n else 0.0,
            "histogram": dict(sorted(histogram.items(), key=lambda kv: -float(kv[0]))),
            "not_one": [r.task_id for r in replays if r.reward < 1.0],
            "call_errors": sum(r.errors for r in replays)}
