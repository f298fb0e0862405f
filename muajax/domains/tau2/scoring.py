"""Scoring a muajax conversation with τ2-bench's own evaluators.

The rollout keeps an OpenAI-style message list (user / assistant with `tool_calls` /
tool). τ2 scores a list of its own message types, and its environment evaluator
*replays* every tool call of that list on a fresh database, checking each replayed
output against the recorded one. So the conversion must yield exactly the tool calls
that really ran through τ2, in the order they ran:

* assistant tool calls are kept only if they name a τ2 agent tool and got a tool
  response (MUA-RL executes only the first call of a message; the others never ran);
  muajax's local general tools (think, calculate) never touch the database and are
  dropped, as are unknown tools and calls whose arguments did not parse;
* the recorded output is the one the session logged for that call (so a rollout that
  trims long tool outputs for the prompt still replays cleanly), else the message's;
* the simulated user's own tool calls (telecom dual control) are not part of the agent's
  conversation: they come from the session's log, placed before the first agent call
  that ran after them.

The reward is τ2's: the product of the 0/1 components in the task's `reward_basis`
(DB, ENV_ASSERTION, ACTION, COMMUNICATE), combined the way `tau2.evaluator.evaluator.
evaluate_simulation` combines them, with COMMUNICATE dropped when `communicate_info` is
off (training, as in MUA-RL). The partial score (TCR) is the fraction of individual
checks met within the components counted: the DB comparison (one check), each env
assertion, each gold action, each communicate-info string.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from loguru import logger

# litellm (imported by tau2) would otherwise fetch its model cost map over the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# tau2 logs every tool response at DEBUG to stderr: thousands of lines per RL step.
if not os.environ.get("MUAJAX_TAU2_LOGS"):
    logger.disable("tau2")

from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage  # noqa: E402
from tau2.data_model.message import ToolCall as Tau2ToolCall  # noqa: E402
from tau2.data_model.simulation import RewardInfo  # noqa: E402
from tau2.data_model.tasks import RewardType  # noqa: E402
from tau2.data_model.tasks import Task as Tau2Task  # noqa: E402
from tau2.evaluator.evaluator_action import ActionEvaluator  # noqa: E402
from tau2.evaluator.evaluator_communicate import CommunicateEvaluator  # noqa: E402
from tau2.evaluator.evaluator_env import EnvironmentEvaluator  # noqa: E402

from muajax.domains.base import Evaluation  # noqa: E402

_ENV_BASES = frozenset({RewardType.DB, RewardType.ENV_ASSERTION})


@dataclasses.dataclass(frozen=True)
class ExecutedCall:
    """One tool call a session ran through τ2, with τ2's response.

    `agent_calls_before` counts the agent's τ2 calls that had run before this one; it
    is how a user-side call is placed among the agent's calls of the conversation.
    """

    call: Tau2ToolCall
    response: ToolMessage
    agent_calls_before: int


def _role(message: Any, index: int) -> str:
    if not isinstance(message, dict):
        raise TypeError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"messages[{index}] has unknown role {role!r}")
    return role


def _text(message: dict[str, Any], index: int) -> str | None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}]: only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{index}]: content must be a string, a list of text parts or None")


def _parse_calls(message: dict[str, Any], index: int) -> list[tuple[str | None, str, dict | None]]:
    """(id, name, arguments or None when they do not parse to an object) per tool call."""
    raw = message.get("tool_calls") or []
    if not isinstance(raw, list):
        raise TypeError(f"messages[{index}]: tool_calls must be a list")
    calls = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise TypeError(f"messages[{index}].tool_calls[{j}] must be a dict")
        fn = item.get("function", item)  # accept both the OpenAI shape and a flat {name, arguments}
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"messages[{index}].tool_calls[{j}] has no function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        calls.append((item.get("id"), name, args if isinstance(args, dict) else None))
    return calls


def _pair(calls: list, responses: list[dict[str, Any]]) -> tuple[list[dict | None], int]:
    """The tool response of each call (by id, else by position) and the unmatched count."""
    by_id = {r.get("tool_call_id"): r for r in responses if r.get("tool_call_id") is not None}
    unnamed = [r for r in responses if r.get("tool_call_id") is None]
    paired: list[dict | None] = []
    for call_id, _, _ in calls:
        if call_id is not None and call_id in by_id:
            paired.append(by_id.pop(call_id))
        elif unnamed:
            paired.append(unnamed.pop(0))
        else:
            paired.append(None)
    return paired, len(by_id) + len(unnamed)


def _kept_calls(calls: list, paired: list[dict | None], index: int, *, agent_tools: frozenset[str],
                agent_log: list[ExecutedCall], emitted: int,
                stats: dict[str, int]) -> tuple[list[Tau2ToolCall], list[ToolMessage]]:
    """The τ2 tool calls of message `index` that really ran, with their recorded responses;
    counts the others in `stats["dropped_tool_calls"]`. `emitted`: agent calls kept before
    this message (their position in the session's log)."""
    kept_calls: list[Tau2ToolCall] = []
    kept_responses: list[ToolMessage] = []
    for (call_id, name, args), response in zip(calls, paired):
        if response is None or args is None or name not in agent_tools:
            stats["dropped_tool_calls"] += 1
            continue
        position = emitted + len(kept_calls)
        tc_id = call_id if isinstance(call_id, str) and call_id else f"muajax-call-{position}"
        call = Tau2ToolCall(id=tc_id, name=name, arguments=args, requestor="assistant")
        logged = agent_log[position] if position < len(agent_log) else None
        if logged is not None and logged.call.name == name and logged.call.arguments == args:
            content, error = logged.response.content, logged.response.error
        else:
            content, error = _text(response, index) or "", False
        kept_calls.append(call)
        kept_responses.append(ToolMessage(id=tc_id, role="tool", content=content, requestor="assistant",
                                          error=error))
    return kept_calls, kept_responses


def to_tau2_trajectory(
    messages: Sequence[dict[str, Any]],
    *,
    agent_tools: frozenset[str],
    executed: Sequence[ExecutedCall],
    prefix: Sequence[Any] = (),
) -> tuple[list[Any], dict[str, int]]:
    """τ2 messages for an OpenAI-style conversation (see the module docstring)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    agent_log = [e for e in executed if e.call.requestor == "assistant"]
    user_log = [e for e in executed if e.call.requestor == "user"]
    out: list[Any] = list(prefix)
    stats = {"dropped_tool_calls": 0, "orphan_tool_messages": 0, "agent_tool_calls": 0, "user_tool_calls": 0}
    next_user = 0
    emitted = 0  # agent τ2 calls emitted so far

    def flush_user_calls(before: int | None) -> None:
        nonlocal next_user
        while next_user < len(user_log) and (before is None or user_log[next_user].agent_calls_before <= before):
            entry = user_log[next_user]
            out.append(UserMessage(role="user", tool_calls=[entry.call]))
            out.append(entry.response)
            next_user += 1
            stats["user_tool_calls"] += 1

    i = 0
    while i < len(messages):
        message = messages[i]
        role = _role(message, i)
        if role == "system":
            i += 1
            continue
        if role == "tool":
            stats["orphan_tool_messages"] += 1
            i += 1
            continue
        if role == "user":
            if message.get("tool_calls"):
                raise ValueError(f"messages[{i}]: user tool calls are taken from the session's log "
                                 "(EnvSession.user_step), not from the agent's messages")
            text = _text(message, i)
            if text is not None:
                out.append(UserMessage(role="user", content=text))
            i += 1
            continue
        end = i + 1
        while end < len(messages) and _role(messages[end], end) == "tool":
            end += 1
        responses = list(messages[i + 1:end])
        calls = _parse_calls(message, i)
        paired, unmatched = _pair(calls, responses)
        stats["orphan_tool_messages"] += unmatched
        kept_calls, kept_responses = _kept_calls(calls, paired, i, agent_tools=agent_tools, agent_log=agent_log,
                                                 emitted=emitted, stats=stats)
        text = _text(message, i)
        if kept_calls:
            flush_user_calls(emitted)
            out.append(AssistantMessage(role="assistant", content=text, tool_calls=kept_calls))
            out.extend(kept_responses)
            emitted += len(kept_calls)
        elif text is not None and text.strip():
            out.append(AssistantMessage(role="assistant", content=text))
        i = end
    flush_user_calls(None)
    stats["agent_tool_calls"] = emitted
    return out, stats


def tool_signature(trajectory: Sequence[Any]) -> tuple:
    """What the environment evaluator depends on: every tool call and recorded output, in order."""
    sig = []
    for message in trajectory:
        if isinstance(message, (AssistantMessage, UserMessage)) and message.tool_calls:
            for call in message.tool_calls:
                arguments = json.dumps(call.arguments, sort_keys=True, default=str)
                sig.append((call.requestor, call.id, call.name, arguments))
        elif isinstance(message, ToolMessage):
            sig.append((message.requestor, message.id, message.content, message.error))
    return tuple(sig)


def environment_reward(task: Tau2Task, trajectory: list[Any],
                       environment_constructor: Callable[..., Any]) -> RewardInfo:
    """τ2's environment evaluator: replays the trajectory, compares DBs, runs env assertions."""
    return EnvironmentEvaluator.calculate_reward(environment_constructor=environment_constructor, task=task,
                                                 full_trajectory=trajectory, solo_mode=False)


def score(task: Tau2Task, trajectory: list[Any], env_info: RewardInfo, *, communicate_info: bool) -> Evaluation:
    """Combine τ2's component rewards like `evaluate_simulation`; see the module docstring."""
    criteria = task.evaluation_criteria
    if criteria is None:
        return Evaluation(1.0, 1.0, {"note": "the task has no evaluation criteria"})
    basis = set(criteria.reward_basis)
    if not communicate_info:
        basis.discard(RewardType.COMMUNICATE)
    if RewardType.NL_ASSERTION in basis:
        raise ValueError(f"τ2 task {task.id!r} is scored by NL assertions, which need an LLM judge "
                         "that muajax does not run")
    reward, checks, breakdown = 1.0, [], {}
    details: dict[str, Any] = {}
    if basis & _ENV_BASES:
        reward *= env_info.reward
        breakdown.update({k.value: v for k, v in (env_info.reward_breakdown or {}).items()})
        if RewardType.DB in basis:
            match = env_info.db_check.db_match if env_info.db_check is not None else env_info.reward == 1.0
            checks.append(bool(match))
            details["db_match"] = bool(match)
        if RewardType.ENV_ASSERTION in basis:
            met = [bool(c.met) for c in env_info.env_assertions or []]
            checks.extend(met)
            details["env_assertions_met"] = met
    if RewardType.ACTION in basis:
        action_info = ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
        reward *= action_info.reward
        breakdown[RewardType.ACTION.value] = action_info.reward
        met = [bool(c.action_match) for c in action_info.action_checks or []]
        checks.extend(met)
        details["actions_matched"] = met
    if RewardType.COMMUNICATE in basis:
        comm_info = CommunicateEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
        reward *= comm_info.reward
        breakdown[RewardType.COMMUNICATE.value] = comm_info.reward
        met = [bool(c.met) for c in comm_info.communicate_checks or []]
        checks.extend(met)
        details["communicated"] = met
    partial = sum(checks) / len(checks) if checks else reward
    details.update(reward_basis=sorted(b.value for b in basis), reward_breakdown=breakdown,
                   checks_met=sum(checks), checks_total=len(checks))
    return Evaluation(float(reward), float(partial), details)
