"""Reading the commands a tpu/ or gpu/ script prints with --dry-run (scripts/dry_run.sh), and
the Python they would run: `python -c CODE`, `python - <<EOF` heredocs and `python -m MODULE`,
wherever they sit (a remote `--command`, ssh's standard input, `bash -c`), so that
tests/scripts/test_scripts.py can check that every name they use exists."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import shlex

SEPARATORS = set(";&|\n()")
PUNCTUATION = ";&|<>()\n"
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$|^\$\{?PYTHON")
HEREDOC = re.compile(r"(?P<head>[^\n]*\bpython[\w.]*(?:\s+-\w+)*\s+-\s+<<-?\s*(?P<q>['\"]?)(?P<tag>\w+)(?P=q)[^\n]*)\n"
                     r"(?P<body>.*?)\n\s*(?P=tag)[ \t]*(?=\n|$)", re.DOTALL)


@dataclasses.dataclass
class PythonRun:
    """One Python invocation: `kind` "-c" (also a heredoc) or "-m"; `code` the program or
    the module; `args` what follows; `env` the NAME=value words before it."""
    kind: str
    code: str
    args: list[str]
    env: dict[str, str]


def parse_dry_run(output: str) -> list[list[str]]:
    """The `+ ` commands of a dry run's output, each as its words (a quoted word may span
    lines); other lines (the script's own messages, `#` notes) are skipped."""
    commands, pending = [], None
    for line in output.splitlines(keepends=True):
        if pending is None:
            if not line.startswith("+ "):
                continue
            pending = line[2:]
        else:
            pending += line
        try:
            commands.append(shlex.split(pending))
        except ValueError:  # a quote still open: the word goes on on the next line
            continue
        pending = None
    if pending is not None:
        raise ValueError(f"unterminated command in the dry run's output: {pending[:200]!r}")
    return commands


def shell_texts(words: list[str]) -> list[str]:
    """The shell scripts a command carries for another shell to run: gcloud's `--command`,
    ssh's command words, `bash -c` (with its "$@" filled in) and standard input (`<<<`)."""
    texts = []
    if "<<<" in words:
        at = words.index("<<<")
        texts.append(words[at + 1])
        words = words[:at]
    for i, word in enumerate(words[:-1]):
        if word == "--command":
            texts.append(words[i + 1])
        if word == "-c" and i > 0 and os.path.basename(words[i - 1]) in ("bash", "sh"):
            texts.append(words[i + 1].replace('"$@"', shlex.join(words[i + 3:])))
    if words and words[0] == "ssh":
        command = [w for w in words[1:] if not w.startswith("-")][1:]
        if command and command != ["bash", "-s"]:
            texts.append(" ".join(command))
    return texts


def heredoc_runs(text: str) -> tuple[list[PythonRun], str]:
    """`python - <<TAG ... TAG` programs in a shell text, and the text without their bodies."""
    runs = []
    for match in HEREDOC.finditer(text):
        head = simple_commands(match["head"].split("<<")[0])[-1]
        env = dict(w.split("=", 1) for w in head if re.match(r"^\w+=", w))
        runs.append(PythonRun("-c", match["body"], [], env))
    return runs, HEREDOC.sub(lambda m: m["head"].split("<<")[0], text)


def simple_commands(text: str) -> list[list[str]]:
    """A shell text's simple commands as words (split at ; & | newlines and parentheses)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=PUNCTUATION)
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if set(token) <= SEPARATORS:
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def python_runs(words: list[str]) -> list[PythonRun]:
    """The Python invocation a simple command makes, if any (after NAME=value words, nohup, exec)."""
    env = {}
    i = 0
    while i < len(words) and (re.match(r"^\w+=", words[i]) or words[i] in ("nohup", "exec", "env")):
        if "=" in words[i]:
            name, value = words[i].split("=", 1)
            env[name] = value
        i += 1
    if i >= len(words) or not PYTHON.search(words[i]):
        return []
    rest = words[i + 1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-c", "-m", "-"):
        rest = rest[1:]  # interpreter options (-u, -X ...)
    if len(rest) < 2 or rest[0] not in ("-c", "-m"):
        return []
    args = []
    for word in rest[2:]:
        if set(word) <= set(PUNCTUATION):
            if args and args[-1].isdigit() and word[0] in "<>":
                args.pop()  # the file descriptor of a redirect (2>&1)
            break
        args.append(word)
    return [PythonRun(rest[0], rest[1], args, env)]


def runs_in(text: str) -> list[PythonRun]:
    """Every Python invocation in a shell text (heredocs first)."""
    runs, rest = heredoc_runs(text)
    for command in simple_commands(rest):
        runs += python_runs(command)
    return runs


def unresolved_names(code: str) -> list[str]:
    """The names a program imports, and the attributes it reads off what it imported
    (`jax.process_index`, `module.function`), that do not exist in the installed packages."""
    tree = ast.parse(code)
    bound, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as exc:
                    missing.append(f"import {alias.name}: {exc}")
                    continue
                top = alias.asname or alias.name.split(".")[0]
                bound[top] = importlib.import_module(alias.name if alias.asname else top)
        elif isinstance(node, ast.ImportFrom):
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                missing.append(f"from {node.module} import ...: {exc}")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"from {node.module} import {alias.name}: {node.module} has no {alias.name}")
                        continue
                bound[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in bound:
            value, path = bound[node.id], node.id
            for attr in chain:
                path += f".{attr}"
                if not hasattr(value, attr):
                    missing.append(f"{path}: no such attribute")
                    break
                value = getattr(value, attr)
    return missing
