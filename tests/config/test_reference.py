"""docs/config.md is generated from the config classes' field comments and cannot drift."""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Literal

import pytest

from muajax.config import reference as R
from muajax.config.schema import TrainConfig
from muajax.settings.fields import Checked, bounded, config_to_dict, from_dict

ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| `.*` \| `.*` \| (?P<desc>.*) \|$")


def doc_rows(text: str) -> dict[str, str]:
    return {m["key"]: m["desc"].strip() for m in map(ROW.match, text.splitlines()) if m}


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key under `cls`, walked independently of the generator."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        keys.append(key)
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
        for arg in typing.get_args(tp) if optional else (tp,):
            if dataclasses.is_dataclass(arg):
                keys += schema_keys(arg, key + ".")
            elif typing.get_origin(arg) is dict and dataclasses.is_dataclass(typing.get_args(arg)[1]):
                keys += schema_keys(typing.get_args(arg)[1], key + ".<name>.")
    return keys


def test_docs_config_md_is_current():
    assert R.DOC_PATH.is_file(), f"docs/config.md is missing: run `{R.COMMAND}`"
    assert R.DOC_PATH.read_text() == R.render(), (
        f"docs/config.md differs from the config classes: run `{R.COMMAND}` and commit the result")


def test_every_key_has_a_description():
    rows = doc_rows(R.DOC_PATH.read_text())
    keys = schema_keys(TrainConfig)
    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    expected = [k for k in keys if k not in sections]  # the sections are headings
    assert sorted(rows) == sorted(expected)
    assert len(expected) > 150
    assert all(rows[k] for k in expected), [k for k in expected if not rows[k]]
    for name in sections:
        assert f"## `{name}`" in R.DOC_PATH.read_text()


def test_check_flag(tmp_path, monkeypatch, capsys):
    assert R.main(["--check"]) == 0
    stale = tmp_path / "config.md"
    stale.write_text(R.render().replace("| `grpo.kl_coef` |", "| `grpo.kl_weight` |"))
    monkeypatch.setattr(R, "DOC_PATH", stale)
    assert R.main(["--check"]) == 1
    assert R.COMMAND in capsys.readouterr().err
    assert R.main(["--write"]) == 0 and stale.read_text() == R.render()


# --- the convention, on small configs built with the same machinery ---------------------

@dataclasses.dataclass(frozen=True)
class Server(Checked):
    """A server."""

    url: str = "http://x"  # where it listens
    timeout_s: float = bounded(30.0, gt=0)  # seconds per call


@dataclasses.dataclass(frozen=True)
class Section(Checked):
    """A documented section.

    More text that stays out of the heading."""

    steps: int | None = bounded(None, ge=1)  # caps the run
    # A block above the field,
    # joined into one line.
    scale: Literal["std", "none"] = "std"
    betas: tuple[float, float] = (0.9, 0.999)  # a pair | with a pipe
    servers: dict[str, Server] = dataclasses.field(default_factory=dict)  # by name

    lr: float = 1e-6  # a comment two fields up does not leak down:
    plain: bool = True  # its own


@dataclasses.dataclass(frozen=True)
class Root:
    sec: Section = dataclasses.field(default_factory=Section)


@dataclasses.dataclass(frozen=True)
class Undocumented(Checked):
    """Has one field without a comment."""

    fine: int = 1  # documented
    bare: int = bounded(2, ge=0)
    # a comment separated from the field by a blank line does not describe it

    spaced: str = "x"


@dataclasses.dataclass(frozen=True)
class NoDocstring:
    fine: int = 1  # documented


@dataclasses.dataclass(frozen=True)
class BadRoot:
    good: Section = dataclasses.field(default_factory=Section)
    bad: Undocumented = dataclasses.field(default_factory=Undocumented)
    nodoc: NoDocstring = dataclasses.field(default_factory=NoDocstring)


def test_synthetic_config_renders_its_comments():
    assert from_dict(Root, {"sec": {"servers": {"a": {"url": "http://a"}}}}).sec.servers["a"].url == "http://a"
    assert config_to_dict(Root())["sec"]["scale"] == "std"
    text = R.render(Root)
    assert "## `sec`\n\nA documented section. (`" in text and "More text" not in text
    rows = doc_rows(text)
    assert list(rows) == ["sec.steps", "sec.scale", "sec.betas", "sec.servers", "sec.servers.<name>.url",
                          "sec.servers.<name>.timeout_s", "sec.lr", "sec.plain"]
    assert rows["sec.scale"] == "A block above the field, joined into one line."
    assert rows["sec.betas"] == r"a pair \| with a pipe"
    assert rows["sec.plain"] == "its own"
    assert "| `sec.scale` | `'std' \\| 'none'` | `\"std\"` |" in text
    assert "| `sec.steps` | `int \\| None` | `null` |" in text
    assert "| `sec.betas` | `tuple[float, float]` | `[0.9, 0.999]` |" in text
    assert "| `sec.servers.<name>.timeout_s` | `float` | `30.0` |" in text
    assert "| `sec.lr` | `float` | `1e-6` |" in text


def test_a_field_without_a_comment_is_reported(capsys):
    with pytest.raises(ValueError) as err:
        R.render(BadRoot)
    message = str(err.value)
    assert "'bad.bare': Undocumented.bare" in message
    assert "'bad.spaced': Undocumented.spaced" in message
    assert "section 'nodoc': NoDocstring" in message
    assert "bad.fine" not in message and "good." not in message
    assert R.main([], root=BadRoot) == 1  # the command names it too, and writes nothing
    assert "'bad.bare'" in capsys.readouterr().err


@pytest.mark.parametrize("tp, shown", [
    (int, "int"), (float | None, "float | None"), (Literal["std", "none"], "'std' | 'none'"),
    (tuple[int, ...], "tuple[int, ...]"), (tuple[Literal["a", "b"], ...], "tuple['a' | 'b', ...]"),
    (dict[str, float] | None, "dict[str, float] | None"), (typing.Optional[Section], "Section | None"),  # noqa: UP045
])
def test_type_names(tp, shown):
    assert R.type_name(tp) == shown


@pytest.mark.parametrize("value, shown", [
    (None, "null"), (True, "true"), (3, "3"), (1e-6, "1e-6"), (0.001, "0.001"), ("a\"b", '"a\\"b"'),
    (("grpo",), '["grpo"]'), ({}, "{}"), ({"a": 1.0}, "{a: 1.0}"), (Section(), "{}"),
])
def test_literals(value, shown):
    assert R.literal(value) == shown
