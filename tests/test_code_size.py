"""Size limits on the code: no Python file over 400 lines, no function over 80.

A module that outgrows 400 lines has usually taken on a second job, and a function past 80
lines no longer reads in one sitting; both are split by what they do (see how qwen3 or the
bench `run`s were). The limits hold for the package and for the tests alike. A function's
length runs from its `def` line to its last line (decorators not counted), so a nested
function counts inside its parent as well as on its own.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED_DIRS = ("muajax", "tests")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def size_problems(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    """One line per limit that `path` breaks: the file's length, or each over-long function's."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(root).as_posix()
    problems = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        problems.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{name}:{node.lineno} {node.name}(): {length} lines (at most {MAX_FUNCTION_LINES})")
    return problems


def python_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path for top in CHECKED_DIRS for path in (root / top).rglob("*.py"))


def test_no_file_over_400_lines_and_no_function_over_80():
    files = python_files(ROOT)
    assert len(files) > 100  # the walk found the package and its tests
    problems = [problem for path in files for problem in size_problems(path, ROOT)]
    assert not problems, "split these by what they do:\n" + "\n".join(problems)


def _function(name: str, body_lines: int, *, indent: str = "", is_async: bool = False) -> str:
    """A function of exactly 1 + body_lines lines."""
    head = f"{indent}{'async ' if is_async else ''}def {name}():\n"
    return head + "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))


@pytest.mark.parametrize("source, expected", [
    (_function("short", MAX_FUNCTION_LINES - 1), []),
    (_function("too_long", MAX_FUNCTION_LINES), ["mod.py:1 too_long(): 81 lines (at most 80)"]),
    (_function("too_long", MAX_FUNCTION_LINES, is_async=True), ["mod.py:1 too_long(): 81 lines (at most 80)"]),
    ("@staticmethod\n" + _function("short", MAX_FUNCTION_LINES - 1), []),  # decorators are not counted
    ("class Holder:\n" + _function("method", MAX_FUNCTION_LINES, indent="    "),
     ["mod.py:2 method(): 81 lines (at most 80)"]),
    ("x = 0\n" * MAX_FILE_LINES, []),
    ("x = 0\n" * (MAX_FILE_LINES + 1), ["mod.py: 401 lines (at most 400)"]),
], ids=["80-line function", "81-line function", "81-line async function", "decorated 80-line function",
        "81-line method", "400-line file", "401-line file"])
def test_the_check_names_what_breaks_a_limit(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert size_problems(path, tmp_path) == expected
