"""The BFCL-v3 multi-turn user: the benchmark's own scripted turns, not a model.

BFCL moves to the next user turn as soon as the agent answers without a tool call; so
does this user: every plain-text message from the agent is answered with the next
scripted turn, taken from the rollout's `BfclSession` (which also unlocks the functions a
miss_func turn adds), and the episode ends with ###STOP### after the last turn. The
session, not this user, owns the turn counter: the environment's scoring needs to know
which turn every call was made in. With a `ReplyDelay` (`user.latency_s`) each turn comes
after a seeded delay (muajax.domains.latency).
"""
from __future__ import annotations

from typing import Any

from muajax.domains.base import EnvSession, Task
from muajax.domains.base import STOP, UserSession, UserSimulator, UserTurn
from muajax.domains.latency import DelayStream, ReplyDelay, SessionDelays, answer_after


class BfclUserSession(UserSession):
    def __init__(self, env: Any, delays: DelayStream | None = None):
        self.env = env
        self.delays = delays

    async def reply(self, agent_message: str) -> UserTurn:
        return await answer_after(self.delays, lambda: self.respond(agent_message))

    def respond(self, agent_message: Any) -> UserTurn:
        """The synchronous core of `reply`: the agent's text does not matter, only that it
        ended its turn."""
        text = self.env.next_user_turn()
        if text is None:
            return UserTurn(STOP, end=STOP)
        return UserTurn(text)


class BfclUser(UserSimulator):
    """Plays BFCL tasks only; `start` needs the rollout's BFCL session."""

    def __init__(self, delay: ReplyDelay | None = None):
        self.delays = SessionDelays(delay)

    def start(self, task: Task, env: EnvSession | None = None) -> BfclUserSession:
        if not isinstance(task, Task):
            raise TypeError(f"BfclUser.start needs a Task, got {type(task).__name__}")
        if task.domain != "bfcl":
            raise ValueError(f"BfclUser plays only BFCL tasks; task {task.task_id!r} is from domain {task.domain!r}")
        # duck-typed so that this module does not import `bfcl` (an optional install)
        if env is None or not callable(getattr(env, "next_user_turn", None)):
            raise ValueError(f"BfclUser needs the task's BFCL environment session (env.reset(task)) to read "
                             f"the scripted turns of {task.task_id!r}; got {type(env).__name__}")
        return BfclUserSession(env, self.delays.start(task.task_id))
