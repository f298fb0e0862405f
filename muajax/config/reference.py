"""The config reference (docs/config.md), generated from the typed schema.

`python -m muajax.config.reference` prints it, `--write` writes docs/config.md, `--check`
exits 1 when that file differs from what the classes say now. Every key of `TrainConfig`
gets a row: its dotted name (nested dataclasses recursed; a mapping of them as `<name>`),
type, default and description. The description is the field's own comment in its class:
the `#` comment block on the lines just above the field, then the comment on the field's
line(s), joined into one line. A section's heading carries its class docstring's first line.
A field with no comment (or a section class with no docstring) is an error naming it.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import pathlib
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal

from muajax.config.schema import TrainConfig

DOC_PATH = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m muajax.config.reference --write"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    description: str
    where: str  # Class.field (module), for error messages


@dataclasses.dataclass(frozen=True)
class ClassSource:
    docstring: str  # its first line; "" when the class has none
    comments: dict[str, str]  # field name -> its comment text, one line


def _comment_lines(source: str) -> dict[int, str]:
    """Line number (1-based) -> the text of the `#` comment on it."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@functools.cache
def class_source(cls: type) -> ClassSource:
    """The docstring and the field comments of a dataclass, read from its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines, comments = source.splitlines(), _comment_lines(source)
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    found = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        after = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        found[stmt.target.id] = " ".join(t for t in above + after if t)
    doc = (ast.get_docstring(node) or "").strip()
    return ClassSource(" ".join(doc.split("\n\n")[0].split()), found)


def type_name(tp: Any) -> str:
    """A readable annotation: `float | None`, `'std' | 'none'`, `tuple[int, ...]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"tuple[{type_name(args[0])}, ...]"
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def literal(value: Any) -> str:
    """A default as a YAML-ish literal."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value).replace("e-0", "e-").replace("e+", "e")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {literal(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return "{}"  # the mapping of its fields' defaults, listed below it
    return repr(value)


def _default(field: dataclasses.Field, base: Any) -> Any:
    if base is not None:
        return getattr(base, field.name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _nested(tp: Any) -> tuple[type, str] | None:
    """The dataclass under a field's type (itself, optional, or a mapping's values) and the
    key part it adds ("" or ".<name>")."""
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    for arg in typing.get_args(tp) if optional else (tp,):
        if dataclasses.is_dataclass(arg):
            return arg, ""
        if typing.get_origin(arg) is dict and dataclasses.is_dataclass(typing.get_args(arg)[-1]):
            return typing.get_args(arg)[-1], ".<name>"
    return None


def rows(cls: type, prefix: str, base: Any = None) -> list[Row]:
    """One row per field of `cls` under `prefix`, nested dataclasses recursed.
    `base` is the default instance the defaults come from (None: the class's own)."""
    out, hints, comments = [], typing.get_type_hints(cls), class_source(cls).comments
    for field in dataclasses.fields(cls):
        key, tp, default = f"{prefix}.{field.name}", hints[field.name], _default(field, base)
        where = f"{cls.__name__}.{field.name} ({cls.__module__})"
        out.append(Row(key, type_name(tp), literal(default), comments.get(field.name, ""), where))
        nested = _nested(tp)
        if nested is not None:
            sub, part = nested
            out += rows(sub, key + part, default if isinstance(default, sub) else None)
    return out


def sections(root: type = TrainConfig) -> list[tuple[str, type, list[Row]]]:
    """(name, class, rows) for each section of `root`; raises ValueError naming every
    field without a comment and every section class without a docstring."""
    out, missing = [], []
    for field in dataclasses.fields(root):
        cls = typing.get_type_hints(root)[field.name]
        found = rows(cls, field.name, _default(field, None))
        out.append((field.name, cls, found))
        if not class_source(cls).docstring:
            missing.append(f"section '{field.name}': {cls.__name__} ({cls.__module__}) has no docstring")
        missing += [f"'{r.key}': {r.where} has no comment" for r in found if not r.description]
    if missing:
        raise ValueError("config fields need a description (a `#` comment on the field's line or the "
                         "lines just above it; a docstring for a section class):\n  " + "\n  ".join(missing))
    return out


def _cell(text: str, code: bool = False) -> str:
    """Table-cell text: `|` escaped; outside code spans `<` too (it would open an HTML tag)."""
    if code:
        return f"`{text.replace('|', chr(92) + '|')}`"
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "\\<") for i, p in enumerate(parts))


def render(root: type = TrainConfig) -> str:
    """The whole reference as Markdown."""
    found = sections(root)
    total = sum(len(r) for _, _, r in found)
    lines = ["# Config reference", "",
             f"<!-- Generated from the config classes by `{COMMAND}`; do not edit by hand. -->", "",
             (f"Every key of a run config ({total} in all), by section: its type, default and what it does. "
              "Set them in a YAML file (`python -m muajax.train --config RUN.yaml`) or as dotted overrides "
              "(`grpo.kl_coef=0.01`); `<name>` stands for a key of a mapping. The descriptions are the "
              "comments on the fields in the config classes."), ""]
    for name, cls, section_rows in found:
        heading = f"{_cell(class_source(cls).docstring)} (`{cls.__module__}.{cls.__name__}`)"
        lines += [f"## `{name}`", "", heading, "",
                  "| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
        lines += [f"| {_cell(r.key, True)} | {_cell(r.type, True)} | {_cell(r.default, True)} | "
                  f"{_cell(r.description)} |" for r in section_rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None, root: type = TrainConfig) -> int:
    p = argparse.ArgumentParser(prog="python -m muajax.config.reference", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} (docs/config.md)")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the schema")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text = render(root)
    except ValueError as e:
        print(f"muajax.config.reference: {e}", file=sys.stderr)
        return 1
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
    elif args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"muajax.config.reference: docs/config.md is out of date; run `{COMMAND}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
