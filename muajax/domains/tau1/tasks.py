"""τ1-bench's task files, read from a checkout the user points at (`env.tau1_dir`,
`--tau1-dir`): `git clone https://github.com/sierra-research/tau-bench`.

τ1 keeps its tasks as Python modules (`tau_bench/envs/retail/tasks_train.py`, ...), each
one module-level list of `Task(user_id=..., instruction=..., actions=[Action(name=...,
kwargs={...})], outputs=[...])` calls (some files add `annotator=...`, which τ1's own
pydantic model ignores). Importing them would pull in τ1's package and its dependencies,
so they are parsed with `ast` and only literals and the `Task(...)` / `Action(...)` calls
are evaluated: nothing in the file runs, and a plain checkout suffices. Nothing of τ1 is
copied into muajax.
"""
from __future__ import annotations

import ast
import dataclasses
import os
from typing import Any

CLONE = "git clone https://github.com/sierra-research/tau-bench"
# (τ2 domain, τ1 split) -> (file in the checkout, the list it assigns), as τ1's env.py picks them
TASK_FILES: dict[tuple[str, str], tuple[str, str]] = {
    ("retail", "train"): ("tau_bench/envs/retail/tasks_train.py", "TASKS_TRAIN"),
    ("retail", "dev"): ("tau_bench/envs/retail/tasks_dev.py", "TASKS_DEV"),
    ("retail", "test"): ("tau_bench/envs/retail/tasks_test.py", "TASKS_TEST"),
    ("airline", "test"): ("tau_bench/envs/airline/tasks_test.py", "TASKS"),
}
TASK_FIELDS = ("user_id", "instruction", "actions", "outputs")  # τ1's Task model; all required


class Tau1CheckoutError(ValueError):
    """`env.tau1_dir` is unset, missing, not a tau-bench checkout, or holds a task file muajax
    cannot read (`muajax.domains.registry` raises it as a `DomainConfigError`)."""


@dataclasses.dataclass(frozen=True)
class Tau1Action:
    name: str
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Tau1Task:
    """One τ1 task as its file states it; `index` is its place in the file's list."""

    domain: str  # the τ2 domain whose environment it runs on: retail or airline
    split: str
    index: int
    user_id: str
    instruction: str
    actions: tuple[Tau1Action, ...]
    outputs: tuple[str, ...]
    extra: dict[str, Any]  # other keywords of the call (annotator), kept as metadata


def tau1_splits(domain: str) -> tuple[str, ...]:
    return tuple(split for (d, split) in TASK_FILES if d == domain)


def check_checkout(tau1_dir: str | os.PathLike | None, domain: str) -> str:
    """The checkout's path, once it is a directory holding `domain`'s task files; else a
    `Tau1CheckoutError` naming the variable and what was expected."""
    what = f"a checkout of sierra-research/tau-bench ({CLONE})"
    if tau1_dir is None or not os.fspath(tau1_dir):
        raise Tau1CheckoutError(f"env.tau1_dir (--tau1-dir): env.domain tau1-{domain} reads τ1's tasks from {what}; "
                                "set it to that directory")
    path = os.path.abspath(os.path.expanduser(os.fspath(tau1_dir)))
    if not os.path.isdir(path):
        raise Tau1CheckoutError(f"env.tau1_dir (--tau1-dir): {path} is not a directory; expected {what}")
    files = [f for (d, _), (f, _) in TASK_FILES.items() if d == domain]
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise Tau1CheckoutError(f"env.tau1_dir (--tau1-dir): {path} is not a tau-bench checkout of the expected "
                                f"layout: it lacks {', '.join(missing)} (expected {what})")
    return path


def load_tau1_tasks(tau1_dir: str, domain: str, split: str) -> list[Tau1Task]:
    """The tasks of τ1's `split` for `domain`, in the file's order."""
    if (domain, split) not in TASK_FILES:
        raise ValueError(f"τ1 {domain} has no split {split!r}; available: {', '.join(tau1_splits(domain))}")
    relative, name = TASK_FILES[domain, split]
    path = os.path.join(check_checkout(tau1_dir, domain), relative)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise Tau1CheckoutError(f"env.tau1_dir (--tau1-dir): {path} is not valid Python: {exc}") from None
    reader = _Reader(path)
    value = reader.task_list(tree, name)
    return [reader.task(node, domain, split, i) for i, node in enumerate(value.elts)]


class _Reader:
    """Evaluates a task file's literals and Task/Action calls; anything else is an error."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, node: ast.AST, why: str) -> Tau1CheckoutError:
        return Tau1CheckoutError(f"env.tau1_dir (--tau1-dir): {self.path}:{getattr(node, 'lineno', '?')}: {why} "
                                 "(expected τ1's format: a list of Task(...) calls with literal arguments)")

    def task_list(self, tree: ast.Module, name: str) -> ast.List:
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if not isinstance(node.value, ast.List):
                    raise self.fail(node, f"{name} is not a list literal")
                return node.value
        raise self.fail(tree, f"assigns no {name}")

    def task(self, node: ast.AST, domain: str, split: str, index: int) -> Tau1Task:
        fields = self.call(node, "Task")
        absent = [k for k in TASK_FIELDS if k not in fields]
        if absent:
            raise self.fail(node, f"task {index} lacks {', '.join(absent)}")
        actions = fields["actions"]
        if not isinstance(actions, list) or not all(isinstance(a, Tau1Action) for a in actions):
            raise self.fail(node, f"task {index}: actions is not a list of Action(...)")
        outputs = fields["outputs"]
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise self.fail(node, f"task {index}: outputs is not a list of strings")
        if not isinstance(fields["instruction"], str) or not isinstance(fields["user_id"], str):
            raise self.fail(node, f"task {index}: instruction and user_id must be strings")
        extra = {k: v for k, v in fields.items() if k not in TASK_FIELDS}
        return Tau1Task(domain, split, index, fields["user_id"], fields["instruction"], tuple(actions),
                        tuple(outputs), extra)

    def call(self, node: ast.AST, name: str) -> dict[str, Any]:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name):
            raise self.fail(node, f"expected a {name}(...) call")
        if node.args or any(k.arg is None for k in node.keywords):
            raise self.fail(node, f"{name}(...) takes keyword arguments only")
        return {k.arg: self.value(k.value) for k in node.keywords}

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Call):
            fields = self.call(node, "Action")
            if set(fields) != {"name", "kwargs"} or not isinstance(fields["name"], str) or not isinstance(
                    fields["kwargs"], dict):
                raise self.fail(node, "Action(...) takes name (a string) and kwargs (a dict)")
            return Tau1Action(fields["name"], fields["kwargs"])
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise self.fail(node, "a dict with ** unpacking")
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}
        try:
            return ast.literal_eval(node)  # constants, negative numbers, sets
        except ValueError:
            raise self.fail(node, f"{type(node).__name__} is not a literal") from None
