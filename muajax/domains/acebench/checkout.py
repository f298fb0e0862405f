"""An ACEBench checkout on disk (`env.acebench_dir`, `--acebench-dir`): its Agent items, their
answers, and the sandbox classes, read from the checkout at run time (nothing of ACEBench
is copied into muajax: `git clone https://github.com/ACEBench/ACEBench`).

What is read, and from where (ACEBench's layout at its current head):
- items: `data_all/data_<lang>/data_agent_multi_turn.json` and `data_agent_multi_step.json`
  (one JSON object a line: `id`, `question`, `initial_config`, `function`, `involved_classes`);
  answers: the same names under `possible_answer/` (`ground_truth`, `mile_stone`);
- which module holds each class: the `CLASS_FILE_PATH_MAPPING_<LANG>` dict of
  `model_inference/multi_turn/multi_turn_utils.py` and `model_inference/multi_step/multi_step_utils.py`;
- which attributes are a class's state (what the checker compares): `SAVED_CLASS` in
  `model_inference/apimodel_inference.py`;
- the agent's rules (`BASE_PROMPT_<LANG>`, `TRAVEL_PROMPT_<LANG>` of `model_inference/prompt_<lang>.py`)
  and the simulated user's (`SYSTEM_PROMPT_BASE_<LANG>`, `SYSTEM_PROMPT_TRAVEL_<LANG>` of
  `model_inference/multi_turn/APIModel_user.py`).
The constants are read with `ast` (module-level literals), without running those modules (they
import ACEBench's API clients). Only the sandbox classes' modules run, imported under a private
`model_inference` package rooted at the checkout (`load_classes`), and `sys.modules` is put back
as it was afterwards, so two checkouts (a fixture and a real one) can be loaded in one process.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import sys
import threading
import types
from pathlib import Path
from typing import Any

SUBSETS = ("multi_turn", "multi_step")
LANGUAGES = ("en", "zh")
PACKAGE = "model_inference"
CLONE = "git clone https://github.com/ACEBench/ACEBench"
WHERE = "env.acebench_dir (--acebench-dir)"
_IMPORT_LOCK = threading.Lock()


class AceBenchError(ValueError):
    """The checkout is missing, not ACEBench's layout, or an item cannot be built."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One Agent item with its answer."""

    id: str
    subset: str  # "multi_turn" | "multi_step"
    question: str
    initial_config: dict[str, Any]
    functions: list[dict[str, Any]]
    involved_classes: tuple[str, ...]
    ground_truth: list[dict[str, Any]]
    mile_stone: list[Any]


def data_file(language: str, subset: str, answer: bool = False) -> str:
    base = f"data_all/data_{language}/"
    return base + ("possible_answer/" if answer else "") + f"data_agent_{subset}.json"


def required_files(language: str) -> list[str]:
    data = [data_file(language, s, a) for s in SUBSETS for a in (False, True)]
    return data + ["model_inference/multi_turn/multi_turn_utils.py", "model_inference/multi_step/multi_step_utils.py",
                   "model_inference/apimodel_inference.py", f"model_inference/prompt_{language}.py",
                   "model_inference/multi_turn/APIModel_user.py"]


def check_layout(root: str | Path | None, language: str) -> Path:
    """The checkout's root, after checking it has every file muajax reads; else a clear error."""
    if language not in LANGUAGES:
        raise AceBenchError(f"env.acebench_language (--language): {language!r}; expected one of {', '.join(LANGUAGES)}")
    if not root:
        raise AceBenchError(f"{WHERE}: not set; expected the path of an ACEBench checkout ({CLONE})")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise AceBenchError(f"{WHERE}: {str(path)!r} is not a directory; expected an ACEBench checkout ({CLONE})")
    missing = [f for f in required_files(language) if not (path / f).is_file()]
    if missing:
        raise AceBenchError(f"{WHERE}: {str(path)!r} is not an ACEBench checkout of the expected layout: it lacks "
                            f"{', '.join(missing)} ({CLONE})")
    return path.resolve()


def read_records(path: Path) -> list[dict[str, Any]]:
    """ACEBench's data files: one JSON object a line (a JSON list is accepted too)."""
    text = path.read_text(encoding="utf-8")
    try:
        whole = json.loads(text)
        return whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        pass
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise AceBenchError(f"{WHERE}: {path} line {number} is not JSON: {exc}") from None
    return records


def module_constants(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """Module-level literal assignments `NAME = <literal>` of a Python file, read without running it."""
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in names:
                try:
                    found[name] = ast.literal_eval(node.value)
                except ValueError:
                    raise AceBenchError(f"{WHERE}: {path}: {name} is not a literal") from None
    missing = [n for n in names if n not in found]
    if missing:
        raise AceBenchError(f"{WHERE}: {path} defines no {', '.join(missing)} (ACEBench's layout changed?)")
    return found


def load_items(root: Path, language: str, subset: str) -> list[Item]:
    """A subset's items joined with their answers by id, in the data file's order."""
    items = read_records(root / data_file(language, subset))
    answers = {a.get("id"): a for a in read_records(root / data_file(language, subset, answer=True))}
    out = []
    for raw in items:
        where = f"{WHERE}: {data_file(language, subset)}: item {raw.get('id', '?')!r}"
        missing = [k for k in ("id", "question", "function", "involved_classes") if k not in raw]
        if missing:
            raise AceBenchError(f"{where} lacks {', '.join(missing)}")
        answer = answers.get(raw["id"])
        if answer is None or "ground_truth" not in answer or "mile_stone" not in answer:
            raise AceBenchError(f"{where} has no answer with ground_truth and mile_stone in "
                                f"{data_file(language, subset, answer=True)}")
        truth = answer["ground_truth"]
        out.append(Item(id=raw["id"], subset=subset, question=raw["question"],
                        initial_config=raw.get("initial_config") or {}, functions=list(raw["function"]),
                        involved_classes=tuple(raw["involved_classes"]),
                        ground_truth=truth if isinstance(truth, list) else [truth],
                        mile_stone=list(answer["mile_stone"])))
    return out


def class_mapping(root: Path, language: str, subset: str) -> dict[str, str]:
    rel = f"model_inference/{subset}/{subset}_utils.py"
    name = f"CLASS_FILE_PATH_MAPPING_{language.upper()}"
    return module_constants(root / rel, (name,))[name]


def _is_ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def load_classes(root: Path, language: str, subset: str, items: list[Item]) -> dict[str, type]:
    """The sandbox classes the subset's items involve, imported from the checkout (see the
    module docstring); an item whose class is not mapped or does not import is named."""
    mapping = class_mapping(root, language, subset)
    needed: dict[str, str] = {}
    for item in items:
        for name in item.involved_classes:
            if name not in mapping:
                raise AceBenchError(f"{WHERE}: item {item.id!r} involves class {name!r}, which "
                                    f"model_inference/{subset}/{subset}_utils.py does not map to a module "
                                    f"(it maps {', '.join(sorted(mapping))})")
            needed.setdefault(name, item.id)
    classes: dict[str, type] = {}
    with _IMPORT_LOCK:
        saved = {k: sys.modules.pop(k) for k in [k for k in sys.modules if _is_ours(k)]}
        try:
            package = types.ModuleType(PACKAGE)
            package.__path__ = [str(root / PACKAGE)]  # a namespace rooted at this checkout only
            sys.modules[PACKAGE] = package
            for name, first_item in needed.items():
                try:
                    classes[name] = getattr(importlib.import_module(mapping[name]), name)
                except Exception as exc:  # noqa: BLE001 - any failure names the item and the class
                    raise AceBenchError(f"{WHERE}: item {first_item!r} involves class {name!r}, which cannot be "
                                        f"imported from {mapping[name]} in {root}: {type(exc).__name__}: {exc}"
                                        ) from None
        finally:
            for k in [k for k in sys.modules if _is_ours(k)]:
                del sys.modules[k]
            sys.modules.update(saved)
    return classes


class Checkout:
    """One checkout in one language: items, answers, classes, state attributes and prompts."""

    def __init__(self, root: str | Path | None, language: str = "en"):
        self.root = check_layout(root, language)
        self.language = language
        self.items = {s: load_items(self.root, language, s) for s in SUBSETS}
        self.classes = {s: load_classes(self.root, language, s, self.items[s]) for s in SUBSETS}
        self.saved_attributes: dict[str, list[str]] = module_constants(
            self.root / "model_inference/apimodel_inference.py", ("SAVED_CLASS",))["SAVED_CLASS"]
        lang = language.upper()
        self.agent_prompts = module_constants(self.root / f"model_inference/prompt_{language}.py",
                                              (f"BASE_PROMPT_{lang}", f"TRAVEL_PROMPT_{lang}"))
        self.user_prompts = module_constants(self.root / "model_inference/multi_turn/APIModel_user.py",
                                             (f"SYSTEM_PROMPT_BASE_{lang}", f"SYSTEM_PROMPT_TRAVEL_{lang}"))

    def agent_prompt(self, kind: str) -> str:
        """ACEBench's multi-turn rules for `kind` ("BASE" or "TRAVEL"), without its closing section
        on the `[ApiName(...)]` text format: muajax's agent calls tools through its chat template."""
        text = self.agent_prompts[f"{kind}_PROMPT_{self.language.upper()}"]
        marker = {"en": "Function Calls:", "zh": "函数调用："}[self.language]
        return text.split(marker, 1)[0].rstrip()

    def user_prompt(self, kind: str, question: str) -> str:
        """ACEBench's simulated-user system prompt with the item's instruction filled in."""
        return self.user_prompts[f"SYSTEM_PROMPT_{kind}_{self.language.upper()}"].replace("{instruction}", question)
