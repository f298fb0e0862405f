"""The test tiers, and the environment every test runs in.

`python -m pytest -q` runs the default tier: every test not marked `slow`. The slow ones are
named in `tests/tiers.py` (each with its measured time and the test that represents its
family in the default tier) and marked here, so that the test files stay free of tier
bookkeeping. `-m slow` runs just them, `--all` runs both tiers, and any `-m` expression
chooses for itself.
"""
from __future__ import annotations

import os

# The tests are written for the CPU (tiny models, fake CPU devices); libtpu (the tpu extra,
# for the planner's tests) would otherwise try, and loudly fail, to start a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm (under tau2) would use the network

import pytest  # noqa: E402

from tests.tiers import SLOW  # noqa: E402

pytest_plugins = ["tests.support.fixtures"]  # the session-scoped tiny model and tokenizer


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", default=False,
                     help="run both tiers: the default tier and the tests marked slow (tests/tiers.py)")


def _slow_entry(nodeid: str) -> str | None:
    """The tests/tiers.py entry that names this test: its node id, or a prefix of it that
    ends at a file, a test, or a parametrization."""
    for entry in SLOW:
        if nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "["):
            return entry
    return None


def _check_entries(items, args) -> None:
    """Every entry of tests/tiers.py whose file was collected whole names at least one test:
    a renamed or deleted test must not leave a stale line that marks nothing. (A file the
    command line names tests of, `file::test`, is collected in part: not checked.)"""
    partial = {os.path.normpath(a.split("::")[0]) for a in args if "::" in a}
    files = {f for f in (item.nodeid.split("::")[0] for item in items) if os.path.normpath(f) not in partial}
    used = {_slow_entry(item.nodeid) for item in items}
    stale = [entry for entry in SLOW if entry.split("::")[0] in files and entry not in used]
    if stale:
        raise pytest.UsageError("tests/tiers.py names tests that do not exist: " + ", ".join(stale))


def pytest_collection_modifyitems(config, items):
    _check_entries(items, config.args)
    for item in items:
        if _slow_entry(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--all") or config.option.markexpr or config.option.keyword:
        return
    named = {arg.replace(os.sep, "/") for arg in config.args if "::" in arg}  # a test asked for by its id runs

    def runs(item) -> bool:
        return "slow" not in item.keywords or item.nodeid in named or item.nodeid.split("[")[0] in named

    kept = [item for item in items if runs(item)]
    deselected = [item for item in items if not runs(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_report_header(config):
    if config.getoption("--all") or config.option.markexpr:
        return None
    return "tier: default (not slow); `-m slow` runs the slow tier, `--all` both (tests/tiers.py)"
