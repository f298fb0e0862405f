"""ACEBench's users: a model playing the multi-turn items' persona, and no user for multi-step.

Multi-turn (`AceBenchUserSimulator`): the run's OpenAI-compatible user (model, endpoint,
pacing: `OpenAIUserSimulator`) with ACEBench's own user system prompt for the item (the
phone or airline one, with the item's `question` as its instruction, read from the checkout:
the task's `user_system_prompt`) in place of muajax's guidelines. ACEBench's ending rule: the
dialogue ends as soon as a message of either side contains "finish conversation" (its user is
told to write it when the goal is reached; its agent may write it too); the user's reply with
it ends the episode (###STOP###), and an agent message with it ends it without asking the
model. The turn cap is the rollout's `max_turns` (the eval command's default for acebench
counts ACEBench's 40 dialogue messages, see `muajax.evaluation.saved_policy`).

Multi-step (`NoUserSession`): ACEBench runs these with no user: an agent message that is
not a call gets no answer but a reminder to go on with the known conditions, and the
dialogue ends when the agent says "finish conversation". The reminder here is muajax's own
wording of that.
"""
from __future__ import annotations

import dataclasses

from muajax.domains.base import STOP, EnvSession, Task, UserSession, UserTurn
from muajax.domains.openai_user import OpenAIUserSimulator

FINISH = "finish conversation"
NUDGE = {"en": "There is no user to answer: carry on with the tools from what you already know, and reply "
               "\"finish conversation\" when the task is complete.",
         "zh": "没有用户可以回答：请根据已知信息继续使用工具完成任务，完成后回复\"finish conversation\"。"}


class NoUserSession(UserSession):
    """Multi-step: no user, only ACEBench's reminder; "finish conversation" ends the episode."""

    def __init__(self, language: str = "en"):
        self.nudge = NUDGE.get(language, NUDGE["en"])

    async def reply(self, agent_message: str) -> UserTurn:
        if FINISH in str(agent_message):
            return UserTurn(FINISH, end=STOP)
        return UserTurn(self.nudge)


class FinishingUserSession(UserSession):
    """Multi-turn: the model user, ended by "finish conversation" from either side."""

    def __init__(self, inner: UserSession):
        self.inner = inner

    async def reply(self, agent_message: str) -> UserTurn:
        if FINISH in str(agent_message):
            return UserTurn(FINISH, end=STOP)
        turn = await self.inner.reply(agent_message)
        if not turn.failed and turn.end is None and FINISH in turn.text:
            return dataclasses.replace(turn, end=STOP)
        return turn


class AceBenchUserSimulator(OpenAIUserSimulator):
    """The run's OpenAI-compatible user, under ACEBench's user prompt (see the module docstring)."""

    def system_prompt(self, task: Task) -> str:
        prompt = task.metadata.get("user_system_prompt")
        if not prompt:
            raise ValueError(f"task {task.task_id!r} is not an ACEBench multi-turn item (no user_system_prompt)")
        return prompt

    def start(self, task: Task, env: EnvSession | None = None) -> UserSession:
        if task.metadata.get("subset") == "multi_step":
            return NoUserSession(task.metadata.get("language", "en"))
        return FinishingUserSession(super().start(task, env))
