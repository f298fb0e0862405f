"""`BuiltinEnvironment`: the small shop domain used for CPU runs and the embedded default.

Reward: 1.0 iff sha256(sorted JSON of the final DB) equals that of a fresh DB after
replaying the task's gold actions (and, with communicate_info, the required facts were
said to the user). Partial score (TCR): the share of criteria met: each gold write done,
no extra writes, facts communicated.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import random
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from muajax.domains.base import Environment, EnvSession, Evaluation, Observation, Task, ToolCall
from muajax.domains.builtin.confirm import message_text, write_calls
from muajax.domains.builtin.database import db_hash, generate_database
from muajax.domains.builtin.expert import never_write_floor
from muajax.domains.builtin.policy import POLICY
from muajax.domains.builtin.tasks import DOMAIN, KIND_WEIGHTS, generate_tasks
from muajax.domains.builtin.tools import WRITE_TOOLS, Shop, ToolError, short, tool_schemas
from muajax.domains.general_tools import GENERAL_TOOL_NAMES, GENERAL_TOOL_SCHEMAS, TRANSFER_TOOL, run_general_tool

SPLITS = ("train", "test", "validation")


@dataclasses.dataclass
class WriteRecord:
    """One attempted write. `confirmed` stays None until `evaluate` reads it from the
    conversation (the session never sees the user's words)."""

    name: str
    arguments: dict[str, Any]
    ok: bool
    error: str | None = None
    confirmed: bool | None = None


def _args_key(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps([name, arguments], sort_keys=True)


def _mentions(text: str, fact: str) -> bool:
    # Word boundaries so the total "25" is not found inside "125" or "#o250".
    return re.search(rf"(?<![\w#.]){re.escape(fact)}(?![\w])", text.replace(",", ""), re.IGNORECASE) is not None


class BuiltinSession(EnvSession):
    def __init__(self, env: BuiltinEnvironment, task: Task):
        self.task = task
        self._env = env
        self.shop = Shop(env.fresh_db())
        self.writes: list[WriteRecord] = []
        self.n_calls = 0
        self.n_errors = 0
        self.transferred = False

    @property
    def db(self) -> dict[str, Any]:
        return self.shop.db

    def tools(self) -> list[dict[str, Any]]:
        schemas = tool_schemas() + json.loads(json.dumps(GENERAL_TOOL_SCHEMAS))
        return [_terse(s) for s in schemas] if self._env.terse_tools else schemas

    def step(self, call: ToolCall) -> Observation:
        self.n_calls += 1
        if not isinstance(call, ToolCall):
            self.n_errors += 1
            return Observation(f"Error: expected a tool call, got {type(call).__name__}", error=True)
        if isinstance(call.name, str) and call.name in GENERAL_TOOL_NAMES:
            obs = run_general_tool(call) if isinstance(call.arguments, dict) else Observation(
                f"Error: {call.name} arguments must be a JSON object", error=True)
            self.transferred |= call.name == TRANSFER_TOOL and obs.done
            self.n_errors += obs.error
            return obs
        try:
            content, args = self.shop.call(call.name, call.arguments)
        except ToolError as exc:
            self.n_errors += 1
            if isinstance(call.name, str) and call.name in WRITE_TOOLS:
                raw = call.arguments if isinstance(call.arguments, dict) else {}
                self.writes.append(WriteRecord(call.name, {str(k): short(v, 60) for k, v in raw.items()},
                                               ok=False, error=str(exc)))
            return Observation(f"Error: {exc}", error=True)
        if call.name in WRITE_TOOLS:
            self.writes.append(WriteRecord(call.name, args, ok=True))
        return Observation(content)

    def all_writes_confirmed(self) -> bool | None:
        """True/False over the successful writes (None if there were none); read after evaluate."""
        done = [w for w in self.writes if w.ok]
        if not done or any(w.confirmed is None for w in done):
            return None
        return all(w.confirmed for w in done)

    def _annotate_confirmations(self, messages: list[dict[str, Any]]) -> bool:
        """Copy each write's confirmation from the conversation; False if it can't be aligned."""
        calls = write_calls(messages, WRITE_TOOLS)
        for record in self.writes:
            record.confirmed = None
        if len(calls) == len(self.writes):
            for record, (confirmed, _) in zip(self.writes, calls, strict=True):
                record.confirmed = confirmed
            return True
        # A rollout may answer unparseable calls itself without calling step; those show up
        # as errored calls in the messages only, so align the successful writes alone.
        ok_flags = [confirmed for confirmed, failed in calls if not failed]
        ok_writes = [w for w in self.writes if w.ok]
        if len(ok_flags) != len(ok_writes):
            return False  # guessing which write was confirmed would corrupt the metric
        for record, confirmed in zip(ok_writes, ok_flags, strict=True):
            record.confirmed = confirmed
        return True

    def evaluate(self, messages: list[dict[str, Any]], *, communicate_info: bool) -> Evaluation:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("evaluate needs a list of message dicts (OpenAI style)")
        aligned = self._annotate_confirmations(messages)
        db_match = db_hash(self.shop.db) == self._env.gold_hash(self.task)

        gold = Counter(_args_key(c.name, c.arguments) for c in self.task.gold_actions if c.name in WRITE_TOOLS)
        done = Counter(_args_key(w.name, w.arguments) for w in self.writes if w.ok)
        matched = sum((gold & done).values())
        extra = sum((done - gold).values())
        criteria = [1.0] * matched + [0.0] * (sum(gold.values()) - matched) + [float(extra == 0)]

        info_ok = None
        outputs = self.task.metadata.get("outputs") or []
        if communicate_info and outputs:
            said = " ".join(message_text(m) for m in messages if m.get("role") == "assistant")
            hits = [_mentions(said, fact) for fact in outputs]
            info_ok = all(hits)
            criteria += [float(h) for h in hits]
        reward = float(db_match and info_ok is not False)
        ok_writes = [w for w in self.writes if w.ok]
        return Evaluation(reward=reward, partial=sum(criteria) / len(criteria), details={
            "db_match": db_match,
            "info_ok": info_ok,
            "gold_writes": sum(gold.values()),
            "gold_writes_matched": matched,
            "extra_writes": extra,
            "writes": [dataclasses.asdict(w) for w in self.writes],
            "writes_confirmed": [w.confirmed for w in ok_writes] if aligned else None,
            "all_writes_confirmed": self.all_writes_confirmed(),
            "tool_calls": self.n_calls,
            "tool_errors": self.n_errors,
            "transferred": self.transferred,
            "kind": self.task.metadata.get("kind"),
        })


def _terse(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema with only the first sentence of its description and no parameter
    descriptions: the same tools in a third of the system-prompt tokens, for tiny CPU runs
    whose cost is dominated by attention over the prompt."""
    function = schema["function"]
    params = function["parameters"]
    return {"type": "function", "function": {
        "name": function["name"],
        "description": function["description"].split(". ")[0].rstrip(".") + ".",
        "parameters": {"type": "object", "properties": {k: {"type": v["type"]} for k, v in params["properties"].items()},
                       "required": list(params.get("required", []))}}}


class BuiltinEnvironment(Environment):
    """The built-in shop. Same arguments → same database and tasks, on every machine."""

    name = DOMAIN

    def __init__(self, seed: int = 0, n_users: int = 60, n_test_users: int = 12,
                 n_train_tasks: int = 200, n_test_tasks: int = 50, terse_tools: bool = False,
                 kind_weights: Mapping[str, float] | None = None, n_validation_tasks: int = 0):
        """`n_validation_tasks` > 0 adds a "validation" split: tasks of the train users that no
        train task duplicates, for tuning without touching the held-out test split."""
        if not isinstance(n_test_users, int) or not 0 <= n_test_users < n_users:
            raise ValueError(f"n_test_users must be in [0, n_users), got {n_test_users!r} with n_users={n_users!r}")
        self.seed = seed
        self.terse_tools = terse_tools
        self._db = generate_database(seed, n_users)
        self._db_bytes = pickle.dumps(self._db, protocol=pickle.HIGHEST_PROTOCOL)
        users = sorted(self._db["users"])
        order = random.Random(f"{seed}:users").sample(users, len(users))
        # n_test_users=0 shares every user between the splits: test tasks are then held out
        # as tasks (no train task's signature), not as customers.
        self.test_users = tuple(sorted(order[:n_test_users])) if n_test_users else tuple(users)
        self.train_users = tuple(sorted(order[n_test_users:]))
        seen: set[tuple] = set()
        # Generated in this order, each seeing the ones before: train and test are the same
        # whether or not there is a validation split.
        splits = [("train", self.train_users, n_train_tasks), ("test", self.test_users, n_test_tasks)]
        if n_validation_tasks:
            splits.append(("validation", self.train_users, n_validation_tasks))
        weights = KIND_WEIGHTS if kind_weights is None else kind_weights
        self._tasks = {split: generate_tasks(self._db, users, split, n, seed, seen, weights)
                       for split, users, n in splits}
        self._gold_hashes: dict[str, str] = {}

    def policy(self) -> str:
        return POLICY

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            hint = " (set env.builtin_validation_tasks for a validation split)" if split == "validation" else ""
            raise ValueError(f"unknown split {split!r}; this built-in domain has {', '.join(self._tasks)}{hint}")
        return list(self._tasks[split])

    def never_write_floor(self, tasks: list[Task], *, communicate_info: bool) -> float:
        return never_write_floor(self, tasks, communicate_info=communicate_info)

    def fresh_db(self) -> dict[str, Any]:
        """A private copy of the initial database (unpickling is the cheapest deep copy:
        measured 2x faster than a JSON round trip, and every rollout makes one)."""
        return pickle.loads(self._db_bytes)

    def reset(self, task: Task) -> BuiltinSession:
        if not isinstance(task, Task) or task.domain != DOMAIN:
            raise ValueError(f"BuiltinEnvironment cannot run task {getattr(task, 'task_id', task)!r} "
                             f"of domain {getattr(task, 'domain', None)!r}")
        return BuiltinSession(self, task)

    def gold_hash(self, task: Task) -> str:
        """Hash of the DB after the gold actions, replayed through the same tools on a fresh copy."""
        key = task.task_id + json.dumps([[c.name, c.arguments] for c in task.gold_actions], sort_keys=True)
        if key not in self._gold_hashes:
            shop = Shop(self.fresh_db())
            for call in task.gold_actions:
                try:
                    shop.call(call.name, call.arguments)
                except ToolError as exc:
                    raise ValueError(f"gold action {call.name} of task {task.task_id} fails: {exc}") from exc
            self._gold_hashes[key] = db_hash(shop.db)
        return self._gold_hashes[key]
