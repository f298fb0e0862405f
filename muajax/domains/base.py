"""The interface every domain implements: its environment and its simulated user.

An `Environment` is a domain's policy, tools and tasks. `reset(task)` returns an
`EnvSession`: a fresh, isolated copy of the domain's state for one rollout, so that
concurrent rollouts of one task can never see each other's writes.

A `UserSimulator` starts one `UserSession` per rollout. The session sees only the agent's
visible text (never tool calls or results: MUA-RL's role-flipped history) and answers
asynchronously so that the rollout loop can keep decoding other conversations.

A `Domain` is the two together: what the agent's rollout loop plugs into.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence
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
    (e.g. `transfer_to_human_agents`). `setup_error`: the session's environment could not be
    built (it is built in the background, after `reset` returned): the episode ends as a
    setup failure, left out of the update like one raised by `reset`.
    """

    content: str
    done: bool = False
    error: bool = False
    setup_error: bool = False


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

    # Bumped by a session whose tool list changes mid-episode (BFCL's miss_func adds
    # functions at a later turn): the rollout then renders the new list into the prompt.
    tools_revision: int = 0

    def step_calls(self, calls: Sequence[ToolCall]) -> list[Observation]:
        """Execute the calls of one assistant message, in order; one observation per call
        that ran. A call whose observation ends the episode (done) is the last to run.
        Sessions that count a message as one step (BFCL) override this."""
        observations = []
        for call in calls:
            observations.append(self.step(call))
            if observations[-1].done:
                break
        return observations

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
        """The written domain policy that goes into the agent's system prompt ("": none,
        the system turn holds only the tools)."""

    def policy_for(self, task: Task) -> str:
        """The policy for one task (domains combined from several policies override this)."""
        return self.policy()

    @abc.abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """The tasks of a split ("train" or "test")."""

    @abc.abstractmethod
    def reset(self, task: Task) -> EnvSession:
        """A fresh, isolated session for one rollout of `task`."""

    def never_write_floor(self, tasks: list[Task], *, communicate_info: bool) -> float | None:
        """Success on `tasks` of a careful agent that never writes to the database, where the
        domain can play one (None otherwise): what a policy gets for free, below which a
        lesson about when to write shows nothing."""
        return None


# ---------------------------------------------------------------------- the simulated user

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"
END_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)


@dataclasses.dataclass(frozen=True)
class UserTurn:
    """One user reply. `end` is the end token found in `text` (or None); `failed` marks a
    reply that could not be obtained (endpoint errors after all retries)."""

    text: str
    end: str | None = None
    latency_s: float = 0.0
    failed: bool = False
    error: str | None = None


def find_end_token(text: str) -> str | None:
    for token in END_TOKENS:
        if token in text:
            return token
    return None


class UserSession(abc.ABC):
    @abc.abstractmethod
    async def reply(self, agent_message: str) -> UserTurn:
        """The user's answer to the agent's latest message: its visible text only (no
        reasoning, no tool-call markup), which the caller strips."""


class UserSimulator(abc.ABC):
    @abc.abstractmethod
    def start(self, task: Task, env: EnvSession | None = None) -> UserSession:
        """A new user for one rollout. `env` lets dual-control users call their own tools."""

    async def aclose(self) -> None:  # noqa: B027
        """Release connections."""


# `Evaluation.details` key of a domain that judges writes: one flag per write call, in
# order, True when the user had explicitly confirmed it (the paper's case study).
WRITES_CONFIRMED = "writes_confirmed"


def confirm_before_write_rate(per_rollout_flags: Iterable[Sequence[bool] | None]) -> float | None:
    """Share of rollouts with at least one write whose writes were all confirmed (None when
    no rollout wrote anything, so callers don't log a misleading 0). Rollouts whose flags
    are unknown (None) are left out."""
    with_writes = [flags for flags in per_rollout_flags if flags]
    if not with_writes:
        return None
    return sum(all(flags) for flags in with_writes) / len(with_writes)


def sft_record(env: Environment, task: Task, messages: list[dict[str, Any]],
               evaluation: Evaluation, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One conversation as a line of cold-start SFT data: OpenAI-style `messages` (no system
    message), the agent's `tools` (given, or read from a fresh session) and `system` policy,
    the task, its reward and, where the domain judges it, whether every write was confirmed
    first."""
    if tools is None:
        session = env.reset(task)
        try:
            tools = session.tools()
        finally:
            session.close()
    return {"task_id": task.task_id, "system": env.policy_for(task), "tools": tools, "messages": messages,
            "reward": float(evaluation.reward), WRITES_CONFIRMED: (evaluation.details or {}).get(WRITES_CONFIRMED)}


@dataclasses.dataclass(frozen=True)
class Domain:
    """What a rollout plugs into: the environment and the simulated user of one domain."""

    env: Environment
    user: UserSimulator
