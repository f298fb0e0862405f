"""The environment interface every tool domain implements.

An `Environment` is a domain (its policy, tools and tasks). `reset(task)` returns an
`EnvSession`: a fresh, isolated copy of the domain's state for one rollout, so that
concurrent rollouts of one task can never see each other's writes.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool invocation as parsed from the agent's (or user's) output."""

    name: str
    arguments: dict[str, Any]
    call_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a tool call returns to the agent.

    `error` marks observations produced for bad calls (unknown tool, bad arguments,
    tool-raised errors) so the rollout can count them; `done` ends the episode
    (e.g. `transfer_to_human_agents`).
    """

    content: str
    done: bool = False
    error: bool = False


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Binary reward plus the partial score (TCR: fraction of criteria met)."""

    reward: float
    partial: float
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Task:
    """One task. All n rollouts of a task share `first_user_message`."""

    task_id: str
    domain: str
    first_user_message: str
    user_scenario: str  # the instructions the simulated user follows
    gold_actions: tuple[ToolCall, ...] = ()
    split: str = "train"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def call_shape_problem(call: Any) -> str | None:
    """Why `call` is not a well-formed ToolCall (no name, non-object arguments), or None.
    Environments check this before looking the tool up."""
    if not isinstance(call, ToolCall):
        return f"expected a ToolCall, got {type(call).__name__}"
    if not isinstance(call.name, str) or not call.name:
        return "the tool call has no name"
    if not isinstance(call.arguments, dict):
        return f"arguments of {call.name!r} must be a JSON object, got {type(call.arguments).__name__}"
    return None


class EnvSession(abc.ABC):
    """One rollout's private state: a fresh database copy and the tools over it."""

    task: Task

    @abc.abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """The agent's tools as OpenAI function schemas ({"type": "function", ...})."""

    @abc.abstractmethod
    def step(self, call: ToolCall) -> Observation:
        """Execute one agent tool call. Never raises for bad input: returns an error Observation."""

    def user_tools(self) -> list[dict[str, Any]]:
        """Tools the simulated user may call (dual control, e.g. τ2 telecom). Default: none."""
        return []

    def user_step(self, call: ToolCall) -> Observation:
        return Observation(f"Error: the user has no tool named {call.name!r}", error=True)

    @abc.abstractmethod
    def evaluate(self, messages: list[dict[str, Any]], *, communicate_info: bool) -> Evaluation:
        """Score the final state and conversation (OpenAI-style messages).

        `communicate_info` toggles the check that required facts were said to the user:
        off in training (as MUA-RL did), on in evaluation.
        """

    def close(self) -> None:  # noqa: B027 - optional hook for backends holding resources
        """Release resources (subprocesses, connections)."""


class Environment(abc.ABC):
    """A tool domain: its written policy, its tasks, and fresh sessions per rollout."""

    name: str

    @abc.abstractmethod
    def policy(self) -> str:
        """The written domain policy that goes into the agent's system prompt."""

    def policy_for(self, task: Task) -> str:
        """The policy for one task (domains combined from several policies override this)."""
        return self.policy()

    @abc.abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """The tasks of a split ("train" or "test")."""

    @abc.abstractmethod
    def reset(self, task: Task) -> EnvSession:
        """A fresh, isolated session for one rollout of `task`."""
