"""The README is a front door that works: every `python -m muajax.<cmd> ...` it shows names a
module that exists, `--help` of each distinct command (bench subcommands included) exits 0,
every `--flag` a command uses appears in that command's `--help`, every relative link points
at a file (and at a heading, for `file#anchor`), the quick-start commands are there, and it
stays under 250 lines. The docs/ pages the README links to get the same command and link
checks: that is where the longer examples went.
"""
from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
QUICK_START = (
    'python -m pip install -e ".[test]" && python -m muajax.train',
    'python -m pip install -e ".[test]" && python -m pytest -q',
)
HELP_TIMEOUT_S = 180

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"python -m (muajax(?:\.[A-Za-z_]\w*)*)((?:[^\S\n]+[^\s|&;#`]+)*)")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def commands_in(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(module, bench subcommand or "", flags) of every `python -m muajax...` command in the
    fenced code blocks and inline code spans of `text`. A shell comment ends a command; a
    trailing backslash continues it on the next line."""
    pieces = []
    for block in _FENCE.findall(text):
        block = re.sub(r"\\\n", " ", block)
        pieces += [line.split(" #", 1)[0] for line in block.splitlines()]
    pieces += _SPAN.findall(_FENCE.sub("", text))
    found = []
    for piece in pieces:
        for match in _COMMAND.finditer(piece):
            module, args = match.group(1), match.group(2).split()
            sub = ""
            if module == "muajax.bench" and args and not args[0].startswith("-"):
                sub = args[0]
            flags = tuple(f for f in _FLAG.findall(" ".join(args)) if f != "--help")
            found.append((module, sub, flags))
    return found


def module_path(module: str) -> pathlib.Path | None:
    """The file `python -m module` runs, from the repository (a module or a package's __main__)."""
    parts = module.split(".")
    for path in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__main__.py")):
        if path.is_file():
            return path
    return None


def help_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_help(key: tuple[str, str]) -> subprocess.CompletedProcess:
    module, sub = key
    argv = [sys.executable, "-m", module] + ([sub] if sub else []) + ["--help"]
    return subprocess.run(argv, cwd=ROOT, env=help_env(), capture_output=True, text=True, timeout=HELP_TIMEOUT_S)


def linked_pages(page: pathlib.Path) -> list[pathlib.Path]:
    """The docs/*.md pages `page` links to."""
    out = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if path.suffix == ".md" and path.parent == ROOT / "docs" and path.is_file() and path not in out:
            out.append(path)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {f"{base}-{i}" if i else base for base, n in seen.items() for i in range(n)}


TEXT = README.read_text(encoding="utf-8")
PAGES = [README] + linked_pages(README)
PAGE_COMMANDS = {page: commands_in(page.read_text(encoding="utf-8")) for page in PAGES}
COMMANDS = PAGE_COMMANDS[README]
ALL_COMMANDS = [c for page in PAGES for c in PAGE_COMMANDS[page]]
DISTINCT = sorted({(module, sub) for module, sub, _ in ALL_COMMANDS} | {(m, "") for m, _, _ in ALL_COMMANDS})


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def _id(key: tuple[str, str]) -> str:
    return " ".join(filter(None, key))


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """`--help` of every distinct command, run side by side (each is a fresh interpreter)."""
    runnable = [key for key in DISTINCT if module_path(key[0]) is not None]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(runnable, pool.map(run_help, runnable)))


def test_readme_is_short():
    lines = TEXT.count("\n") + (not TEXT.endswith("\n"))
    assert lines < MAX_LINES, f"README.md has {lines} lines; keep it under {MAX_LINES} (details go in docs/)"


def test_quick_start_commands_are_there():
    for command in QUICK_START:
        assert command in TEXT, f"README.md lost its quick-start command: {command}"


def test_readme_shows_the_commands():
    shown = {module for module, _, _ in COMMANDS}
    for name in ("train", "eval", "serve", "export", "plan", "parity", "synth", "pretrain", "report", "ablation",
                 "bench"):
        assert f"muajax.{name}" in shown, f"README.md shows no `python -m muajax.{name}` command"


@pytest.mark.parametrize("module", sorted({m for m, _, _ in ALL_COMMANDS}))
def test_command_module_exists(module):
    where = [_rel(page) for page in PAGES if any(m == module for m, _, _ in PAGE_COMMANDS[page])]
    assert module_path(module) is not None, (
        f"{', '.join(where)} run(s) `python -m {module}`, but neither {module.replace('.', '/')}.py nor "
        f"{module.replace('.', '/')}/__main__.py exists")


@pytest.mark.parametrize("key", DISTINCT, ids=_id)
def test_help_exits_0(key, helps):
    if key not in helps:
        pytest.fail(f"`python -m {_id(key)}`: no such module")
    done = helps[key]
    assert done.returncode == 0, (
        f"`python -m {_id(key)} --help` exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


@pytest.mark.parametrize("key", DISTINCT, ids=_id)
def test_flags_exist(key, helps):
    done = helps.get(key)
    if done is None or done.returncode != 0:
        pytest.skip("no --help to read (test_help_exits_0 says why)")
    known = set(_FLAG.findall(done.stdout))
    unknown = sorted({(_rel(page), flag) for page in PAGES for module, sub, flags in PAGE_COMMANDS[page]
                      if (module, sub) == key for flag in flags if flag not in known})
    assert not unknown, f"`python -m {_id(key)}` is given flags its --help does not list: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_exist(page):
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading in {file.name})")
    assert not broken, f"{_rel(page)} has broken links: {broken}"


def test_the_extractor_finds_commands():
    # the checks above are only as good as the extraction: it must see fenced and inline commands
    text = ("```bash\npython -m muajax.bench generate --max-len 8192   # --not-a-flag\n"
            "python -m muajax.synth --config X \\\n    --out Y\n```\nRun `python -m muajax.eval --domain bfcl`.\n")
    assert commands_in(text) == [("muajax.bench", "generate", ("--max-len",)),
                                 ("muajax.synth", "", ("--config", "--out")),
                                 ("muajax.eval", "", ("--domain",))]
