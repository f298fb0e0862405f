"""Several domains trained together (e.g. τ2 retail + airline, as MUA-RL trained on τ-bench
retail + airline): tasks are the union, each task runs in its own domain, under its own
policy."""
from __future__ import annotations

from muajax.domains.base import Environment, EnvSession, Task


class CombinedEnvironment(Environment):
    def __init__(self, environments: list[Environment]):
        if not environments:
            raise ValueError("CombinedEnvironment needs at least one environment")
        self.by_domain: dict[str, Environment] = {}
        for env in environments:
            if env.name in self.by_domain:
                raise ValueError(f"domain {env.name!r} given twice")
            self.by_domain[env.name] = env
        self.name = "+".join(self.by_domain)

    def _env(self, task: Task) -> Environment:
        if task.domain not in self.by_domain:
            raise ValueError(f"task {task.task_id!r} is from domain {task.domain!r}, not one of {sorted(self.by_domain)}")
        return self.by_domain[task.domain]

    def policy(self) -> str:
        raise TypeError(f"{self.name} combines several policies: use policy_for(task)")

    def policy_for(self, task: Task) -> str:
        return self._env(task).policy_for(task)

    def tasks(self, split: str) -> list[Task]:
        return [task for env in self.by_domain.values() for task in env.tasks(split)]

    def reset(self, task: Task) -> EnvSession:
        return self._env(task).reset(task)

    def close(self) -> None:
        """Close the environments that hold resources (e.g. shared MCP servers)."""
        for env in self.by_domain.values():
            close = getattr(env, "close", None)
            if close is not None:
                close()
