"""τ1-bench's tasks on τ2's retail and airline environments (`env.domain: tau1-retail`,
`tau1-airline`; `env.tau1_dir` names the tau-bench checkout).

The environment is τ2's (`Tau2Environment`: its database, policy, tools and evaluator, the
same code path a τ2 run takes); only the tasks come from τ1's files
(`muajax.domains.tau1.tasks`). Splits: τ1's own (retail `train` 500, `dev` 20, `test` 115;
airline `test` 50), task ids `tau1-<split>-<index in the file>`; and τ2's own splits of the
same domain as `tau2-train`, `tau2-test`, `tau2-base` (a run trains on τ1's `train` and
evaluates on `tau2-test`, one environment serving both).

How a τ1 task becomes a τ2 `Task` (`to_tau2_task`):
* `instruction` -> `user_scenario.instructions`, kept whole as the plain string τ2's model
  allows. τ2's own retail/airline tasks split the instruction by hand into reason for call,
  known info, unknown info and task instructions; that split is an editor's reading and is
  not derived here. The simulated user gets τ2's guidelines with τ1's instruction.
* `actions` -> `evaluation_criteria.actions` (requestor "assistant", every argument
  compared; action ids `<task id>_<k>`), and the gold calls muajax's `--policy gold` replays.
* `outputs` -> `evaluation_criteria.communicate_info`, as τ2 itself carried τ1's outputs
  over (e.g. τ2 retail task 2: ["10"]); `nl_assertions` stays empty: τ1 has none.
* the reward basis is τ2's default for these domains, DB + COMMUNICATE: τ1's own reward was
  the database after the gold actions plus the outputs said to the user, the same two checks.
* `user_id` and `annotator` have no τ2 field: they go in `description.notes` and the
  task's metadata.

Where τ1 does not map onto τ2 (reported, never fixed up):
* τ2 revised some tools, records and tasks. A τ1 task whose gold actions name a tool τ2's
  agent lacks, arguments that tool does not take, or break a rule τ2's tool added (retail's
  `modify_pending_order_items` refuses an item whose new id is its old one; τ1's kept the
  item as it was) is flagged at load: `metadata["tau1_unmapped"]`, and one warning per split
  naming the tasks. Its gold call fails on τ2, so τ2's evaluator, which compares the
  database with the one the gold actions leave, expects the call's changes not to happen.
  Other gold calls that fail on τ2's database (e.g. a gift card short of the amount, as it
  is in τ1's own database too) only show when they run: `python -m muajax.eval --policy gold`
  counts them (`call_errors`, and per task in its JSON). docs/tau1.md gives the figures
  measured on tau-bench's head.
* A task with no gold actions (τ1 has a few: the agent should refuse) scores on the
  database alone, as in τ1.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

from tau2.data_model.tasks import Action as Tau2Action
from tau2.data_model.tasks import Description, EvaluationCriteria, RewardType, UserScenario
from tau2.data_model.tasks import Task as Tau2Task

from muajax.domains.base import Task
from muajax.domains.tau1.tasks import Tau1Task, check_checkout, load_tau1_tasks, tau1_splits
from muajax.domains.tau2.environment import Tau2Environment, Tau2Session

TAU1_DOMAINS = {"tau1-retail": "retail", "tau1-airline": "airline"}
TAU2_SPLIT_PREFIX = "tau2-"


def tau1_task_id(task: Tau1Task) -> str:
    return f"tau1-{task.split}-{task.index}"


def to_tau2_task(task: Tau1Task) -> Tau2Task:
    """The τ2 `Task` a τ1 task maps onto (see the module docstring)."""
    task_id = tau1_task_id(task)
    notes = f"τ1-bench {task.domain} {task.split} task {task.index}; user_id {task.user_id}"
    if "annotator" in task.extra:
        notes += f"; annotator {task.extra['annotator']!r}"
    actions = [Tau2Action(action_id=f"{task_id}_{k}", requestor="assistant", name=a.name, arguments=dict(a.kwargs))
               for k, a in enumerate(task.actions)]
    criteria = EvaluationCriteria(actions=actions, communicate_info=list(task.outputs), nl_assertions=None,
                                  reward_basis=[RewardType.DB, RewardType.COMMUNICATE])
    return Tau2Task(id=task_id, description=Description(notes=notes),
                    user_scenario=UserScenario(persona=None, instructions=task.instruction),
                    evaluation_criteria=criteria)


def unmapped_actions(task: Tau1Task, tools: Mapping[str, dict]) -> list[str]:
    """Why the task's gold actions cannot run as τ2's tools take them (`tools`: name ->
    the function's JSON-schema parameters), one line per problem."""
    problems = []
    for k, action in enumerate(task.actions):
        params = tools.get(action.name)
        if params is None:
            problems.append(f"action {k}: τ2's agent has no tool {action.name!r}")
            continue
        if action.name == "modify_pending_order_items":
            old, new = action.kwargs.get("item_ids") or [], action.kwargs.get("new_item_ids") or []
            kept = [a for a, b in zip(old, new) if a == b]
            if kept:  # τ1's tool kept such an item as it was; τ2's refuses the whole call
                problems.append(f"action {k}: modify_pending_order_items keeps item {', '.join(kept)} as it is, which "
                                "τ2's tool refuses (the call fails on τ2, so its gold database is the unmodified one)")
        known, required = set(params.get("properties", {})), set(params.get("required", ()))
        extra, missing = sorted(set(action.kwargs) - known), sorted(required - set(action.kwargs))
        if extra:
            problems.append(f"action {k}: {action.name} takes no {', '.join(extra)}")
        if missing:
            problems.append(f"action {k}: {action.name} needs {', '.join(missing)}")
    return problems


class Tau1Environment(Tau2Environment):
    """τ2's `domain` environment with τ1's tasks from the checkout at `tau1_dir`."""

    def __init__(self, domain: str, tau1_dir: str | None, *, tools: str = "muajax",
                 first_user_messages: Mapping[str, str] | None = None):
        if domain not in TAU1_DOMAINS.values():
            raise ValueError(f"τ1 tasks run on τ2 retail or airline, not {domain!r}")
        self.tau1_dir = check_checkout(tau1_dir, domain)  # before τ2 loads anything
        super().__init__(domain, tools=tools, first_user_messages=first_user_messages)
        self._tau1: dict[str, list[Tau2Task]] = {}  # split -> mapped tasks, loaded on first use
        self._tau1_index: dict[str, Tau2Task] = {}
        self._tau1_meta: dict[str, dict] = {}  # task id -> τ1's fields τ2 has no place for, and what did not map

    def splits(self) -> dict[str, int]:
        own = {split: len(self._tau1_split(split)) for split in tau1_splits(self.name)}
        return {**own, **{TAU2_SPLIT_PREFIX + name: n for name, n in super().splits().items()}}

    def tasks(self, split: str) -> list[Task]:
        if split.startswith(TAU2_SPLIT_PREFIX) and split[len(TAU2_SPLIT_PREFIX):] in self._splits:
            tau2_split = split[len(TAU2_SPLIT_PREFIX):]
            return [self._convert(self._tau2_task(i, tau2_split), split) for i in self._splits[tau2_split]]
        if split not in tau1_splits(self.name):
            raise ValueError(f"tau1-{self.name} has no split {split!r}; available: {', '.join(self.split_names())}")
        return [self._mapped(t, split) for t in self._tau1_split(split)]

    def split_names(self) -> list[str]:
        return [*tau1_splits(self.name), *(TAU2_SPLIT_PREFIX + s for s in self._splits)]

    def reset(self, task: Task) -> Tau2Session:
        if not isinstance(task, Task) or not task.task_id.startswith("tau1-"):
            return super().reset(task)  # one of τ2's own tasks (or not a Task: τ2 says so)
        if task.domain != self.name:
            raise ValueError(f"task {task.task_id!r} is from domain {task.domain!r}, not {self.name!r}")
        split = task.task_id.split("-")[1]
        if split in tau1_splits(self.name):
            self._tau1_split(split)
        with self._lock:
            tau2_task = self._tau1_index.get(task.task_id)
        if tau2_task is None:
            raise ValueError(f"unknown τ1 {self.name} task id {task.task_id!r}")
        return Tau2Session(self, task, tau2_task)

    # --- internals -----------------------------------------------------------------------
    def _tau1_split(self, split: str) -> list[Tau2Task]:
        with self._lock:
            if split in self._tau1:
                return self._tau1[split]
        loaded = load_tau1_tasks(self.tau1_dir, self.name, split)
        tools = {s["function"]["name"]: s["function"].get("parameters", {}) for s in self._tool_schemas}
        mapped, flagged = [], []
        for t in loaded:
            task = to_tau2_task(t)
            problems = unmapped_actions(t, tools)
            if problems:
                flagged.append(task.id)
            mapped.append((task, t, problems))
        if flagged:
            warnings.warn(f"τ1 {self.name} {split}: {len(flagged)} of {len(loaded)} tasks have gold actions τ2's "
                          f"tools do not take as given ({', '.join(flagged[:10])}{' ...' if len(flagged) > 10 else ''}"
                          "); see their metadata['tau1_unmapped']", stacklevel=2)
        with self._lock:
            for task, t, problems in mapped:
                self._tau1_index[task.id] = task
                self._tau1_meta[task.id] = {"split": t.split, "index": t.index, "user_id": t.user_id,
                                            **t.extra, "unmapped": problems}
            self._tau1[split] = [task for task, _, _ in mapped]
            return self._tau1[split]

    def _mapped(self, tau2_task: Tau2Task, split: str) -> Task:
        task = self._convert(tau2_task, split)
        meta = self._tau1_meta[tau2_task.id]
        task.metadata.update(source="tau1", tau1={k: v for k, v in meta.items() if k != "unmapped"},
                             tau1_unmapped=tuple(meta["unmapped"]))
        return task
