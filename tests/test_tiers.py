"""The tiers' bookkeeping (tests/conftest.py, tests/tiers.py): which tests an entry marks
slow, and that an entry naming no test stops the run instead of silently marking nothing."""
from types import SimpleNamespace

import pytest

from tests import conftest
from tests.tiers import SLOW


def items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_an_entry_marks_its_file_its_test_or_its_parametrization_and_nothing_else(monkeypatch):
    monkeypatch.setattr(conftest, "SLOW", {"tests/a.py": 1, "tests/b.py::test_x": 1, "tests/c.py::test_y[p1]": 1})
    assert conftest._slow_entry("tests/a.py::test_anything[3]") == "tests/a.py"
    assert conftest._slow_entry("tests/b.py::test_x[2]") == "tests/b.py::test_x"
    assert conftest._slow_entry("tests/b.py::test_x_longer") is None  # a prefix of a name is not the test
    assert conftest._slow_entry("tests/c.py::test_y[p1]") == "tests/c.py::test_y[p1]"
    assert conftest._slow_entry("tests/c.py::test_y[p2]") is None


def test_an_entry_that_names_no_collected_test_stops_the_run(monkeypatch):
    monkeypatch.setattr(conftest, "SLOW", {"tests/b.py::test_renamed": 1, "tests/z.py::test_elsewhere": 1})
    with pytest.raises(pytest.UsageError, match="tests/b.py::test_renamed"):
        conftest._check_entries(items("tests/b.py::test_x", "tests/b.py::test_y"), ["tests"])
    conftest._check_entries(items("tests/a.py::test_x"), ["tests"])  # an uncollected file's entries are not judged
    # one test of a file asked for by its id: the file's other entries are not judged
    conftest._check_entries(items("tests/b.py::test_x"), ["tests/b.py::test_x"])


def test_every_slow_entry_is_a_path_under_tests_with_its_seconds():
    for entry, seconds in SLOW.items():
        assert entry.startswith("tests/") and entry.split("::")[0].endswith(".py"), entry
        assert isinstance(seconds, int) and seconds > 0, entry
