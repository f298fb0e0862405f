"""A script for `ScriptedOpenAIServer` that plays both sides of a conversation on known tasks:
the agent (requests with the domain's policy as system prompt) replays each task's gold
actions, one call per request, then says it is done; the simulated user (requests whose
system prompt holds a task's scenario) names its task, and stops once the agent is done
or after `patience` replies."""
from __future__ import annotations

import re
from typing import Any

from muajax.domains.base import STOP, Task

_TASK = re.compile(r"\[task ([^\]]+)\]")
DONE = "All done."


class GoldScript:
    def __init__(self, tasks: list[Task], patience: int = 3):
        self.tasks = {f"{t.domain}/{t.task_id}": t for t in tasks}
        self.patience = patience

    def _user_task(self, system: str) -> Task | None:
        return next((t for t in self.tasks.values() if t.user_scenario.strip() and t.user_scenario.strip() in system),
                    None)

    def __call__(self, body: dict[str, Any]) -> Any:
        messages = body["messages"]
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        task = self._user_task(system)
        return self.user(task, messages) if task is not None else self.agent(messages)

    def user(self, task: Task, messages: list[dict[str, Any]]) -> str:
        said = [m for m in messages if m["role"] == "assistant"]  # the user's own turns, role-flipped
        if DONE in (messages[-1].get("content") or "") or len(said) > self.patience:
            return f"Thank you! {STOP}"
        return f"I need help with my request. [task {task.domain}/{task.task_id}]"

    def agent(self, messages: list[dict[str, Any]]) -> Any:
        named = [m for m in (_TASK.search(m.get("content") or "") for m in messages if m["role"] == "user") if m]
        if not named:
            return "Hello! How can I help you today?"
        task = self.tasks[named[0].group(1)]
        done = sum(1 for m in messages if m["role"] == "tool")
        if done < len(task.gold_actions):
            call = task.gold_actions[done]
            return {"content": "", "tool_calls": [{"name": call.name, "arguments": call.arguments}]}
        info = " ".join(str(x) for x in task.metadata.get("communicate_info", ()))
        return f"{DONE} {info}".strip()
