"""The package's layers: imports run one way, and no import closes a cycle.

    commands -> bench -> {serving, planning} -> {train, evaluation} -> runtime -> config -> {agent, rl}
             -> domains -> engine -> models -> {parallel, chips, settings}

Every `import` in every module counts, including those inside functions (an import
deferred to dodge a cycle is still a cycle). A module may import its own package and any
lower layer; two layers on one rung (agent and rl; serving and planning; parallel and chips) may not import
each other. Commands are `python -m muajax.X` entry points: nothing imports them.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "muajax"

# (module prefix, rung, layer name); the longest matching prefix wins.
LAYERS = (
    ("muajax.parallel", 0, "parallel"),
    # facts about accelerators (memory, peak FLOP/s, bandwidths): the planner's and the trainer's
    ("muajax.chips", 0, "chips"),
    # the typed-settings machinery: any layer may define its config class with it
    ("muajax.settings", 0, "settings"),
    ("muajax.models", 1, "models"),
    ("muajax.engine", 2, "engine"),
    ("muajax.domains", 3, "domains"),
    ("muajax.agent", 4, "agent"),
    ("muajax.rl", 4, "rl"),
    # the run's schema, assembled from the config classes of the layers below
    ("muajax.config", 5, "config"),
    # a policy on devices: build, load, checkpoint, rollout engine, host batches
    ("muajax.runtime", 6, "runtime"),
    ("muajax.train", 7, "train"),
    ("muajax.evaluation", 7, "evaluation"),
    ("muajax.serving", 8, "serving"),
    ("muajax.planning", 8, "planning"),
    ("muajax.bench", 9, "bench"),
)
COMMANDS = ("muajax.train.__main__", "muajax.eval", "muajax.serve", "muajax.export", "muajax.plan", "muajax.parity",
            "muajax.synth", "muajax.pretrain", "muajax.report", "muajax.ablation")
COMMAND_RUNG = 10
# Commands that only load, evaluate, serve or plan a policy: nothing of the trainer's.
NOT_TRAINING = ("muajax.eval", "muajax.serve", "muajax.export", "muajax.plan", "muajax.parity")


def module_files() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported_modules(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """Every muajax module `name` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        found.update(t for t in targets if t == "muajax" or t.startswith("muajax."))
    return found - {name, "muajax"}


def layer_of(module: str) -> tuple[int, str]:
    if module in COMMANDS:
        return COMMAND_RUNG, "commands"
    matches = [(len(prefix), rung, layer) for prefix, rung, layer in LAYERS
               if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS or COMMANDS in {__file__}")
    _, rung, layer = max(matches)
    return rung, layer


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, files) for name, path in files.items() if name != "muajax"}


def direction_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        rung, layer = layer_of(module)
        for target in sorted(targets):
            if target in COMMANDS:
                problems.append(f"{module} imports the command {target}: commands are entry points only")
                continue
            target_rung, target_layer = layer_of(target)
            if target_layer == layer:
                continue
            if target_rung >= rung:
                problems.append(f"{module} ({layer}) imports {target} ({target_layer}): against the direction")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_runs_with_the_declared_direction():
    problems = direction_problems(import_graph())
    assert not problems, "\n".join(problems)


def test_no_import_closes_a_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_what_only_loads_or_plans_a_policy_imports_nothing_of_the_trainer():
    """The server, the planner and the commands that load, evaluate or plan a policy stand on
    `muajax.runtime`: the trainer can change without them, and they without it."""
    graph = import_graph()

    def reaches_train(module: str, seen: set) -> list[str]:
        for target in sorted(graph.get(module, ())):
            if target.startswith("muajax.train"):
                return [module, target]
            if target not in seen:
                seen.add(target)
                path = reaches_train(target, seen)
                if path:
                    return [module] + path
        return []

    users = [m for m in graph if m in NOT_TRAINING or m.startswith(("muajax.serving", "muajax.planning"))]
    problems = [" -> ".join(p) for p in (reaches_train(m, set()) for m in sorted(users)) if p]
    assert not problems, "\n".join(problems)


def test_every_module_belongs_to_a_layer():
    for module in import_graph():
        layer_of(module)


@pytest.mark.parametrize("source, expected", [
    ({"muajax.models.qwen3": {"muajax.train.trainer"}, "muajax.train.trainer": set()}, "against the direction"),
    ({"muajax.agent.rollout": {"muajax.rl.step"}, "muajax.rl.step": set()}, "against the direction"),
    ({"muajax.train.trainer": {"muajax.eval"}, "muajax.eval": set()}, "the command"),
])
def test_the_checker_catches_what_it_should(source, expected):
    problems = direction_problems(source)
    assert problems and expected in problems[0]


def test_the_cycle_finder_sees_a_cycle_through_function_level_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from muajax.train import trainer\n")
    targets = imported_modules("muajax.runtime.build", mod, {"muajax.train.trainer": mod})
    assert targets == {"muajax.train.trainer"}
    graph = {"muajax.runtime.build": targets, "muajax.train.trainer": {"muajax.runtime.build"}}
    assert cycles(graph) == [["muajax.runtime.build", "muajax.train.trainer"]]
