"""BFCL-v3 multi-turn as a muajax `Environment` (evaluation only: BFCL has no train split).

Everything benchmark-specific comes from the installed `bfcl` package (nvidia-bfcl 26.3,
installed `--no-deps`, see the README): the task entries and their ground truth, the
function docs, the executable API classes (GorillaFileSystem, MathAPI, MessageAPI,
TwitterAPI, TicketAPI, TradingBot, TravelAPI, VehicleControlAPI), the executor that runs
a call string against them, and the multi-turn checker (state check + response check).

A BFCL task is a script of user turns. Within a turn the agent calls tools until it
answers in plain text; the scripted user (`muajax.domains.bfcl.user`) then asks the session for
the next turn (`next_user_turn`), and ends the episode after the last one. That is
BFCL's own inference loop (an empty, call-free response ends the turn), with its per-turn
limit of `MAXIMUM_STEP_LIMIT` (20) steps: the step past it force-quits the episode, which
BFCL scores 0. A BFCL step is one model response, which may hold parallel calls: they run
in order as one step (`step_calls`; the evaluation runs every call of a message), and the
checker gets them grouped by step, as BFCL's harness records them.

The prompt is BFCL's function-calling one for Qwen (its FC handler): no system text of its
own (`policy()` is empty), only the tools in Qwen's `# Tools` block of the system turn.

Execution: each agent call is formatted the way BFCL's function-calling handlers decode
a call (`name(k=repr(v),...)`) and run through BFCL's own `execute_multi_turn_func_call`,
so the agent sees exactly the outputs (and "Error during execution: ..." messages) BFCL's
harness would show. Only names of available tools and identifier keys get into the
string, and values go in as `repr` of JSON values (literals), so nothing but the tool
runs under BFCL's `eval`.

BFCL keeps the API instances in its executor module's globals, keyed by model name and
task id, and never frees them (fine for its one-shot CLI, a leak in a long eval). Every
session therefore uses a unique model name and deletes its own instances on close, and
every evaluation deletes the checker's right after scoring.

Scoring (as BFCL's `multi_turn_runner`): an episode that did not reach the last turn, or
was force-quit, is "multi_turn:force_terminated" (0); otherwise the executed calls,
grouped per turn, one call per step, go to `multi_turn_checker`, which re-executes them
and the ground truth on fresh instances and compares states and results after every turn.
The reward is binary; `partial` equals it (BFCL defines no partial credit).

Categories: multi_turn_base (default), multi_turn_miss_param, multi_turn_long_context,
multi_turn_miss_func. In miss_func some functions are held out until a given turn, whose
user message is BFCL's function-calling prompt "I have updated some more functions you can
choose from. What about now?"; the functions join the tool list at that turn (the
session's `tools_revision` changes, and the rollout renders the longer list into the
system prompt), as BFCL's FC mode recompiles its tools, and calls to them run from then on.
"""
from __future__ import annotations

import copy
import json
import keyword
import threading
import uuid
from typing import Any

try:
    from bfcl.constant import (
        MULTI_TURN_FUNC_DOC_FILE_MAPPING,
        MULTI_TURN_FUNC_DOC_PATH,
        POSSIBLE_ANSWER_PATH,
        PROMPT_PATH,
        TEST_FILE_MAPPING,
    )
    from bfcl.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    from bfcl.model_handler.constant import (
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
        MAXIMUM_STEP_LIMIT,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the package
    raise ImportError(
        "BFCL-v3 needs the `bfcl` package: pip install --no-deps nvidia-bfcl==26.3 && pip install -e '.[bfcl]' "
        f"(it pins numpy 1.26, hence --no-deps; see the README). Import failed: {exc}") from exc

from muajax.domains.base import Environment, call_shape_problem, EnvSession, Evaluation, Observation, Task, ToolCall
from muajax.domains.bfcl.functions import bad_value, format_call, parse_ground_truth_call, tool_schema

__all__ = ["CATEGORIES", "DOMAIN", "SPLIT", "BfclEnvironment", "BfclSession", "format_call", "normalize_category",
           "parse_ground_truth_call", "tool_schema"]

DOMAIN = "bfcl"
CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
SPLIT = "test"

# BFCL's FC handler for Qwen gives the model no system text of its own: the system turn
# holds only the tools (an empty policy renders no text, see `Environment.policy`).
POLICY = ""

# BFCL's executor runs in, and keeps state in, one module's globals; this lock makes the
# insert (inside the executor) and the delete (cleanup) of those entries never interleave.
_EXEC_LOCK = threading.RLock()


def normalize_category(category: str) -> str:
    """'base' or 'multi_turn_base' -> 'multi_turn_base'; anything else is a clear error."""
    full = category if category.startswith("multi_turn_") else f"multi_turn_{category}"
    if full not in CATEGORIES:
        short = ", ".join(c.removeprefix("multi_turn_") for c in CATEGORIES)
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; expected one of {short} "
                         "(with or without the 'multi_turn_' prefix)")
    return full


def _read_jsonl(path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _drop_instances(prefix: str) -> None:
    """Delete BFCL's executor instances whose global name starts with `prefix`."""
    namespace = vars(multi_turn_utils)
    with _EXEC_LOCK:
        for name in [n for n in namespace if n.startswith(prefix)]:
            del namespace[name]


class BfclEnvironment(Environment):
    """One BFCL-v3 multi-turn category; all its entries are the `test` split."""

    def __init__(self, category: str = "multi_turn_base"):
        self.category = normalize_category(category)
        self.name = DOMAIN
        entries = _read_jsonl(PROMPT_PATH / TEST_FILE_MAPPING[self.category])
        gold_file = POSSIBLE_ANSWER_PATH / TEST_FILE_MAPPING[self.category]
        answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(gold_file)}
        missing = [e["id"] for e in entries if e["id"] not in answers]
        if missing:
            raise RuntimeError(f"BFCL ships no ground truth for {len(missing)} {self.category} entries, "
                               f"e.g. {missing[0]}")
        # class -> its function docs, read up front: sessions start from several threads
        self._docs = {c: _read_jsonl(MULTI_TURN_FUNC_DOC_PATH / f) for c, f in MULTI_TURN_FUNC_DOC_FILE_MAPPING.items()}
        self._entries: dict[str, dict[str, Any]] = {}
        self._tasks: list[Task] = []
        for entry in entries:
            entry = {**entry, "ground_truth": answers[entry["id"]]}
            if len(entry["ground_truth"]) != len(entry["question"]):
                raise RuntimeError(f"BFCL entry {entry['id']}: {len(entry['question'])} turns but ground truth for "
                                   f"{len(entry['ground_truth'])}")
            self._entries[entry["id"]] = entry
            self._tasks.append(self._task(entry))

    # --- Environment API -------------------------------------------------------------
    def policy(self) -> str:
        return POLICY

    def tasks(self, split: str) -> list[Task]:
        if split == "train":
            raise ValueError(f"BFCL-v3 has no train split: it is an evaluation benchmark; split {SPLIT!r} holds all "
                             f"{len(self._tasks)} tasks of {self.category}")
        if split != SPLIT:
            raise ValueError(f"BFCL-v3 has no split {split!r}; the only split is {SPLIT!r} (all tasks of the category)")
        return list(self._tasks)

    def reset(self, task: Task) -> BfclSession:
        if not isinstance(task, Task):
            raise TypeError(f"reset() needs a muajax Task, got {type(task).__name__}")
        if task.domain != DOMAIN or task.task_id not in self._entries:
            raise ValueError(f"task {task.task_id!r} (domain {task.domain!r}) is not a BFCL {self.category} task")
        return BfclSession(self, task, self._entries[task.task_id])

    # --- internals -----------------------------------------------------------------------
    def docs(self, class_name: str) -> list[dict[str, Any]]:
        return self._docs[class_name]

    def _task(self, entry: dict[str, Any]) -> Task:
        classes = entry["involved_classes"]
        unknown = [c for c in classes if c not in multi_turn_utils.CLASS_FILE_PATH_MAPPING]
        if unknown:
            raise RuntimeError(f"BFCL entry {entry['id']} involves unknown classes {unknown}")
        turns = [self._turn_text(entry, i) for i in range(len(entry["question"]))]
        if not entry["question"][0]:
            raise RuntimeError(f"BFCL entry {entry['id']} has no user message in its first turn")
        gold = [[parse_ground_truth_call(c, classes) for c in calls] for calls in entry["ground_truth"]]
        return Task(
            task_id=entry["id"], domain=DOMAIN, first_user_message=turns[0],
            user_scenario="\n".join(f"turn {i}: {t}" for i, t in enumerate(turns)),
            gold_actions=tuple(ToolCall(c.name, c.arguments, call_id=f"turn{t}-{i}")
                               for t, calls in enumerate(gold) for i, c in enumerate(calls)),
            split=SPLIT,
            metadata={"category": self.category, "involved_classes": tuple(classes), "user_turns": tuple(turns),
                      "gold_turn_lengths": tuple(len(calls) for calls in gold),
                      "ground_truth": entry["ground_truth"],
                      "held_out": {int(k): tuple(v) for k, v in entry.get("missed_function", {}).items()}},
        )

    def _turn_text(self, entry: dict[str, Any], turn: int) -> str:
        held = entry.get("missed_function", {}).get(str(turn))
        if held:
            if entry["question"][turn]:
                raise RuntimeError(f"BFCL entry {entry['id']}: turn {turn} adds functions and also has user messages")
            for name in held:
                self._schemas(entry, name)  # a held-out function no class documents is a data error
            return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        messages = entry["question"][turn]
        if any(m.get("role") != "user" for m in messages):
            raise RuntimeError(f"BFCL entry {entry['id']}: turn {turn} has non-user messages")
        return "\n\n".join(m["content"] for m in messages)

    def _schemas(self, entry: dict[str, Any], name: str) -> dict[str, Any]:
        for class_name in entry["involved_classes"]:
            for doc in self.docs(class_name):
                if doc["name"] == name:
                    return tool_schema(doc)
        raise RuntimeError(f"BFCL entry {entry['id']} holds out {name!r}, which no involved class documents")

    def all_tools(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        return [tool_schema(d) for c in entry["involved_classes"] for d in self.docs(c)]


class BfclSession(EnvSession):
    """One rollout of one BFCL task over its own API instances. Thread-safe."""

    def __init__(self, owner: BfclEnvironment, task: Task, entry: dict[str, Any]):
        self.task = task
        self._owner = owner
        self._entry = entry
        self._lock = threading.Lock()
        self._model = f"muajax_{uuid.uuid4().hex}"  # unique: BFCL keys its instances by it
        self._long_context = "long_context" in owner.category
        held = {name for names in entry.get("missed_function", {}).values() for name in names}
        tools = owner.all_tools(entry)
        self._schemas = {t["function"]["name"]: t for t in tools}
        self._available = [n for n in self._schemas if n not in held]
        self._turn = 0
        self._steps = 0  # steps (model responses with calls) in the current turn
        self._step_serial = 0  # steps of the whole episode: groups the log by step
        self._log: list[tuple[int, int, str]] = []  # (turn, step, call string) of every executed call
        self._force_quit = False
        self._closed = False
        self._checks = 0

    @property
    def num_turns(self) -> int:
        return len(self._entry["question"])

    @property
    def turn(self) -> int:
        return self._turn

    def tools(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(self._schemas[n]) for n in self._available]

    def next_user_turn(self) -> str | None:
        """Advance to the next scripted turn and return its user text (None after the
        last turn). Held-out functions of that turn become callable."""
        with self._lock:
            if self._turn + 1 >= self.num_turns or self._force_quit:
                return None
            self._turn += 1
            self._steps = 0
            added = [name for name in self._entry.get("missed_function", {}).get(str(self._turn), ())
                     if name not in self._available]
            if added:
                self._available.extend(added)  # appended, as BFCL extends its function list
                self.tools_revision += 1
            return self.task.metadata["user_turns"][self._turn]

    def step(self, call: ToolCall) -> Observation:
        return self.step_calls([call])[0]

    def step_calls(self, calls: list[ToolCall]) -> list[Observation]:
        """The calls of one model response, in order, as one BFCL step."""
        problems = [self._check(call) for call in calls]
        with self._lock:
            if self._closed:
                return [Observation("Error: this session is closed", error=True)]
            if self._force_quit:
                return [Observation("Error: the episode was stopped: too many steps in one turn", error=True,
                                    done=True)]
            self._steps += 1
            self._step_serial += 1
            observations = [Observation(f"Error: {problem}", error=True) if problem else self._execute(call)
                            for call, problem in zip(calls, problems)]
            if self._steps > MAXIMUM_STEP_LIMIT:  # BFCL force-quits after this many steps in a turn
                self._force_quit = True
                last = observations[-1]
                observations[-1] = Observation(f"{last.content}\nThe episode is over: more than "
                                               f"{MAXIMUM_STEP_LIMIT} steps in one turn.", error=last.error, done=True)
            return observations

    def _execute(self, call: ToolCall) -> Observation:
        """Run one checked call through BFCL's executor (the session lock is held)."""
        text = format_call(call.name, call.arguments)
        with _EXEC_LOCK:
            try:
                results, _ = multi_turn_utils.execute_multi_turn_func_call(
                    [text], self._entry["initial_config"], self._entry["involved_classes"], self._model,
                    self._entry["id"], long_context=self._long_context, is_evaL_run=False)
            except Exception as exc:  # noqa: BLE001 - step() must never raise
                return Observation(f"Error: BFCL could not execute {call.name}: {type(exc).__name__}: {exc}",
                                   error=True)
        self._log.append((self._turn, self._step_serial, text))
        result = results[0] if results else ""
        return Observation(result, error=result.startswith("Error during execution"))

    def _check(self, call: Any) -> str | None:
        problem = call_shape_problem(call)
        if problem is not None:
            return problem
        with self._lock:
            available = list(self._available)
        if call.name not in available:
            return f"unknown tool {call.name[:80]!r}. Available tools: {', '.join(sorted(available))}"
        for key, value in call.arguments.items():
            if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
                return f"{call.name}: argument name {str(key)[:40]!r} is not a valid parameter name"
            bad = bad_value(value)
            if bad:
                return f"{call.name}: argument {key!r}: {bad}"
        return None

    def executed_calls(self) -> list[list[str]]:
        """The call strings executed so far, per turn (turns not reached are empty)."""
        with self._lock:
            log, reached = list(self._log), self._turn
        return [[text for t, _, text in log if t == turn] for turn in range(reached + 1)]

    def executed_steps(self) -> list[list[list[str]]]:
        """The executed call strings as BFCL's harness records them: [turn][step][call]."""
        with self._lock:
            log = list(self._log)
        steps: list[dict[int, list[str]]] = [{} for _ in range(self.num_turns)]
        for turn, step, text in log:
            steps[turn].setdefault(step, []).append(text)
        return [list(by_step.values()) for by_step in steps]

    def evaluate(self, messages: list[dict[str, Any]], *, communicate_info: bool) -> Evaluation:
        """BFCL's verdict on the executed calls (the messages carry nothing BFCL checks;
        `communicate_info` has no BFCL counterpart). Usable after close()."""
        with self._lock:
            log, reached, force_quit = list(self._log), self._turn + 1, self._force_quit
            self._checks += 1
            checker_model = f"{self._model}_check{self._checks}"
        details: dict[str, Any] = {"category": self._owner.category, "turns": self.num_turns,
                                   "turns_reached": reached, "calls": len(log)}
        if force_quit or reached < self.num_turns:
            why = (f"more than {MAXIMUM_STEP_LIMIT} steps in turn {reached - 1}" if force_quit
                   else f"the episode ended at turn {reached - 1} of {self.num_turns}")
            return Evaluation(0.0, 0.0, {**details, "error_type": "multi_turn:force_terminated", "error": why})
        result = self.executed_steps()
        entry = {k: self._entry[k] for k in ("id", "initial_config", "involved_classes")}
        try:
            with _EXEC_LOCK:
                verdict = multi_turn_checker(result, self._entry["ground_truth"], entry, self._owner.category,
                                             checker_model)
        except Exception as exc:  # noqa: BLE001 - a checker crash scores 0, not a failed eval
            return Evaluation(0.0, 0.0, {**details, "error_type": "checker_error",
                                         "error": f"{type(exc).__name__}: {exc}"})
        finally:
            _drop_instances(f"{checker_model}_")  # the "_" keeps check1 from matching check10
        if verdict.get("valid"):
            return Evaluation(1.0, 1.0, details)
        details.update(error_type=verdict.get("error_type"), error=verdict.get("error_message"))
        extra = verdict.get("details") or {}
        # The checker's details hold whole instance states (megabytes in long_context):
        # keep what names the failure.
        if "differences" in extra:
            details["state_differences"] = sorted(extra["differences"])
        if "missing_items" in extra:
            details["missing_results"] = [str(m)[:300] for m in extra["missing_items"][:5]]
        return Evaluation(0.0, 0.0, details)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        _drop_instances(f"{self._model}_{self._entry['id']}_")
