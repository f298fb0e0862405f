"""ACEBench's Agent subset as a muajax `Environment` (evaluation: ACEBench has no train split).

The items, answers and sandbox classes come from a checkout (`muajax.domains.acebench.checkout`).
Tasks: the 30 multi-turn and 20 multi-step items (English; `env.acebench_language: zh` for the
Chinese ones), split "test" (all), or "multi_turn" / "multi_step" (one subset).

A session is one item's sandbox, built as ACEBench's executor builds it: one instance of each
involved class, each loaded with `_load_scenario` from its own `initial_config` entry and then
from the `BaseApi` entry. The agent sees the item's `function` schemas as tools; a call runs
the method of that name on every involved instance that has one (the phone classes inherit
`BaseApi`'s, so `turn_on_wifi` turns on Wi-Fi in each), the last result is the observation
(a dict as JSON), as ACEBench's executor does. A malformed call, a name no instance has,
arguments the method does not take, or a method that raises, answer with an error message.

Multi-turn items: the opening user message is muajax's fixed one (all rollouts of a task share
it, as on τ2), then the run's simulated user plays the item's `question` under ACEBench's own
user prompt (`muajax.domains.acebench.user`) and ends the dialogue with "finish conversation";
the agent's rules are ACEBench's phone or airline rules (`Checkout.agent_prompt`). Multi-step
items: the whole `question` is the opening message and no user answers (see the user module).
Scoring: `muajax.domains.acebench.scoring` (end-to-end = reward, process = partial).
"""
from __future__ import annotations

import copy
import inspect
import json
import threading
from typing import Any

from muajax.domains.acebench.checkout import SUBSETS, AceBenchError, Checkout, Item
from muajax.domains.acebench.scoring import (
    REPAIRED,
    alternatives,
    compare_state,
    parse_milestone,
    process_accuracy,
    snapshot,
)
from muajax.domains.base import (
    Environment,
    EnvSession,
    Evaluation,
    Observation,
    Task,
    ToolCall,
    call_shape_problem,
)

__all__ = ["DOMAIN", "MAX_TURNS", "SPLIT", "AceBenchEnvironment", "AceBenchError", "AceBenchSession"]

DOMAIN = "acebench"
SPLIT = "test"
# ACEBench caps a dialogue at 40 messages (`max_dialog_turns`), every other one the agent's;
# muajax's `max_turns` counts the others (user replies and tool observations): 20.
MAX_TURNS = 20
OPENERS = {"en": "Hi, I need some help.", "zh": "你好，我需要一些帮助。"}
MULTI_STEP_POLICY = {
    "en": ("You are an assistant that completes a request by calling the tools, one step at a time, deciding each "
           "step from the results of the previous ones. No user is present to answer questions: use what the request "
           "and the tools give you. When the task is complete, reply with \"finish conversation\"."),
    "zh": ("你是一个通过调用工具完成请求的助手，一步一步执行，并根据上一步的结果决定下一步。没有用户可以回答问题："
           "请只使用请求和工具提供的信息。任务完成后，回复\"finish conversation\"。"),
}
_TYPES = {"dict": "object", "list": "array", "tuple": "array", "float": "number", "int": "integer", "bool": "boolean",
          "any": "string"}


def json_schema(spec: Any) -> Any:
    """An ACEBench (Gorilla-style) parameter schema as JSON schema: dict -> object, list -> array."""
    if not isinstance(spec, dict):
        return spec
    out = {k: json_schema(v) if k in ("items", "additionalProperties") else v for k, v in spec.items()}
    if isinstance(spec.get("type"), str):
        out["type"] = _TYPES.get(spec["type"], spec["type"])
    if isinstance(spec.get("properties"), dict):
        out["properties"] = {k: json_schema(v) for k, v in spec["properties"].items()}
    return out


def tool_schema(doc: dict[str, Any]) -> dict[str, Any]:
    params = json_schema(doc.get("parameters") or {"type": "dict", "properties": {}})
    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""),
                                             "parameters": params}}


def _kind(item: Item) -> str:
    return "BASE" if "BaseApi" in item.involved_classes else "TRAVEL"


class AceBenchEnvironment(Environment):
    """The Agent items of one checkout and language."""

    def __init__(self, root: str | None, language: str = "en"):
        self.checkout = Checkout(root, language)
        self.language = language
        self.name = DOMAIN
        self._items = {i.id: i for s in SUBSETS for i in self.checkout.items[s]}
        self._tasks = {s: [self._task(i) for i in self.checkout.items[s]] for s in SUBSETS}

    def policy(self) -> str:
        return ""

    def policy_for(self, task: Task) -> str:
        item = self._item(task)
        if item.subset == "multi_step":
            return MULTI_STEP_POLICY[self.language]
        kinds = [k for k, c in (("TRAVEL", "Travel"), ("BASE", "BaseApi")) if c in item.involved_classes]
        return "\n\n".join(self.checkout.agent_prompt(k) for k in kinds or ["BASE"])

    def tasks(self, split: str) -> list[Task]:
        if split == SPLIT:
            return [t for s in SUBSETS for t in self._tasks[s]]
        if split in SUBSETS:
            return list(self._tasks[split])
        if split == "train":
            raise ValueError("ACEBench has no train split: it is an evaluation benchmark; split 'test' holds its "
                             "multi-turn and multi-step Agent items")
        raise ValueError(f"ACEBench has no split {split!r}; expected 'test' (all), 'multi_turn' or 'multi_step'")

    def reset(self, task: Task) -> AceBenchSession:
        return AceBenchSession(self, task, self._item(task))

    def _item(self, task: Task) -> Item:
        if not isinstance(task, Task) or task.domain != DOMAIN or task.task_id not in self._items:
            raise ValueError(f"{getattr(task, 'task_id', task)!r} is not an ACEBench Agent item of this checkout")
        return self._items[task.task_id]

    def _task(self, item: Item) -> Task:
        first = alternatives(item.mile_stone)[0]
        gold, notes = [], {}
        for index, stone in enumerate(first):
            calls, note = parse_milestone(stone)
            if note is not None:
                notes[index] = f"milestone {index} {stone[:120]!r}: {note}"
            gold += calls or []
        multi_turn = item.subset == "multi_turn"
        return Task(
            task_id=item.id, domain=DOMAIN, split=SPLIT,
            first_user_message=OPENERS[self.language] if multi_turn else item.question,
            user_scenario=item.question, gold_actions=tuple(gold),
            metadata={"subset": item.subset, "language": self.language, "involved_classes": item.involved_classes,
                      "user_system_prompt": self.checkout.user_prompt(_kind(item), item.question) if multi_turn
                      else None, "milestone_notes": tuple(notes[i] for i in sorted(notes)),
                      "gold_unparsed": any(REPAIRED not in n for n in notes.values())})


class AceBenchSession(EnvSession):
    """One rollout of one item over its own sandbox instances. Thread-safe."""

    def __init__(self, owner: AceBenchEnvironment, task: Task, item: Item):
        self.task, self.item = task, item
        self._owner = owner
        self._lock = threading.Lock()
        classes = owner.checkout.classes[item.subset]
        self._instances: dict[str, Any] = {}
        base = item.initial_config.get("BaseApi", {})
        for name in item.involved_classes:
            instance = classes[name]()
            instance._load_scenario(copy.deepcopy(item.initial_config.get(name, {})), long_context=False)
            instance._load_scenario(copy.deepcopy(base), long_context=False)
            self._instances[name] = instance
        self._methods: dict[str, list[Any]] = {}
        for instance in self._instances.values():
            for method_name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not method_name.startswith("_"):
                    self._methods.setdefault(method_name, []).append(method)
        self._tools = [tool_schema(doc) for doc in item.functions]
        self._messages: list[list[ToolCall]] = []  # the agent's call messages, as ACEBench's milestones count them
        self._reached = False  # ACEBench records the state only once a call ran (see step_calls)

    def tools(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._tools)

    def step(self, call: ToolCall) -> Observation:
        return self.step_calls([call])[0]

    def step_calls(self, calls: list[ToolCall]) -> list[Observation]:
        """One call message. As ACEBench's executors: multi-turn stops a message at its first
        failing call and records the state only after a message whose calls all ran; multi-step
        runs every call and records it once any well-formed call was made."""
        multi_turn = self.item.subset == "multi_turn"
        with self._lock:
            self._messages.append([c for c in calls if call_shape_problem(c) is None])
            observations: list[Observation] = []
            for call in calls:
                if multi_turn and any(o.error for o in observations):
                    observations.append(Observation(f"Error: {getattr(call, 'name', '?')} did not run: an earlier "
                                                    "call of this message failed", error=True))
                    continue
                if not multi_turn and call_shape_problem(call) is None:
                    self._reached = True
                observations.append(self._run(call))
            if multi_turn and calls and not any(o.error for o in observations):
                self._reached = True
            return observations

    def _run(self, call: Any) -> Observation:
        problem = call_shape_problem(call)
        if problem is not None:
            return Observation(f"Error: {problem}", error=True)
        methods = self._methods.get(call.name)
        if not methods:
            names = ", ".join(t["function"]["name"] for t in self._tools)
            return Observation(f"Error: unknown tool {call.name[:80]!r}. Available tools: {names}", error=True)
        try:
            inspect.signature(methods[0]).bind(**call.arguments)
        except TypeError as exc:
            return Observation(f"Error: bad arguments for {call.name}: {exc}", error=True)
        try:
            for method in methods:
                result = method(**copy.deepcopy(call.arguments))
        except Exception as exc:  # noqa: BLE001 - a sandbox error is the agent's observation
            return Observation(f"Error during execution of {call.name}: {type(exc).__name__}: {exc}", error=True)
        if isinstance(result, str):
            return Observation(result)
        try:
            return Observation(json.dumps(result, ensure_ascii=False))
        except (TypeError, ValueError):
            return Observation(str(result))

    def state(self) -> list[dict[str, Any]]:
        """The state ACEBench would record now ([] before any call reached the sandbox)."""
        with self._lock:
            return snapshot(self._instances, self._owner.checkout.saved_attributes) if self._reached else []

    def evaluate(self, messages: list[dict[str, Any]], *, communicate_info: bool) -> Evaluation:
        """End-to-end accuracy as the reward, process accuracy as the partial score (the
        messages carry nothing ACEBench checks; `communicate_info` has no counterpart)."""
        errors, unchecked = compare_state(self.state(), self.item.ground_truth)
        with self._lock:
            messages_called = [list(m) for m in self._messages]
        reward = 0.0 if errors else 1.0
        partial = 1.0 if reward else process_accuracy(self.item.mile_stone, messages_called)
        details: dict[str, Any] = {"subset": self.item.subset, "call_messages": len(messages_called),
                                   "end_to_end": reward, "process": partial}
        if errors:
            details["state_errors"] = errors[:8]
        if unchecked:
            details["unchecked_classes"] = unchecked
        if self.task.metadata.get("milestone_notes"):
            details["milestone_notes"] = list(self.task.metadata["milestone_notes"])
        return Evaluation(reward, partial, details)
