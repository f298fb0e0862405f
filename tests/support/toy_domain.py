"""A toy domain a tiny model can learn in a few GRPO steps: the task is solved when the
agent's first message says "yes"; the user stops at once."""
from muajax.domains.base import (STOP, Environment, EnvSession, Evaluation, Observation, Task, UserSession,
                                 UserSimulator, UserTurn)


class _SayYesSession(EnvSession):
    def __init__(self, task):
        self.task = task

    def tools(self):
        return []

    def step(self, call):
        return Observation("Error: no tools here", error=True)

    def evaluate(self, messages, *, communicate_info):
        said = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
        first = said[0] if said else ""
        ok = "yes" in first and "no" not in first
        return Evaluation(float(ok), float(ok))


class SayYesEnvironment(Environment):
    """Reward 1 when the agent's first reply says "yes" and not "no"."""

    name = "say-yes"

    def policy(self):
        return "Answer."

    def tasks(self, split):
        return [Task(f"{split}-{i}", self.name, "Say yes or no.", "") for i in range(4)]

    def reset(self, task):
        return _SayYesSession(task)


class _StopSession(UserSession):
    async def reply(self, agent_message):
        return UserTurn(f"Bye. {STOP}", end=STOP)


class StopUser(UserSimulator):
    def start(self, task, env=None):
        return _StopSession()
