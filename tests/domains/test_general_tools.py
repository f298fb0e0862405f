"""think / calculate / transfer_to_human_agents: MUA-RL's general tools."""
from __future__ import annotations

import pytest

from muajax.domains.base import ToolCall
from muajax.domains.general_tools import (
    GENERAL_TOOL_NAMES, GENERAL_TOOL_SCHEMAS, MAX_EXPRESSION_CHARS, calculate, run_general_tool,
)


def calc(expression):
    return run_general_tool(ToolCall("calculate", {"expression": expression}))


def test_schemas_name_the_three_tools():
    assert GENERAL_TOOL_NAMES == {"think", "calculate", "transfer_to_human_agents"}
    for schema in GENERAL_TOOL_SCHEMAS:
        params = schema["function"]["parameters"]
        assert schema["type"] == "function" and len(params["required"]) == 1
        assert params["required"][0] in params["properties"]


def test_think_returns_empty_and_changes_nothing():
    obs = run_general_tool(ToolCall("think", {"thought": "the user wants red"}))
    assert (obs.content, obs.done, obs.error) == ("", False, False)


@pytest.mark.parametrize("expression, expected", [
    ("2 + 2", "4.0"), ("2 * (3 + 4)", "14.0"), ("10 / 4", "2.5"), ("1 / 3", "0.33"), ("-3 + +5", "2.0"),
    ("((1))", "1.0"), (".5 * 4", "2.0"), ("25 - 47", "-22.0"),
])
def test_calculate_arithmetic(expression, expected):
    obs = calc(expression)
    assert not obs.error and obs.content == expected


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('ls')", "invalid characters"),
    ("2**3", "unexpected '*'"),
    ("1 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("(" * 100 + "1" + ")" * 100, "nested too deeply"),
    ("-" * 200 + "1", "nested too deeply"),
    ("1+" * 200 + "1", "longer than"),
    ("1.2.3", "malformed number"),
    ("2 3", "unexpected '3'"),
    ("(1 + 2", "end of expression"),
    ("", "end of expression"),
    (".", "could not convert"),
    ("1e5", "invalid characters"),
])
def test_calculate_rejects_bad_expressions(expression, reason):
    obs = calc(expression)
    assert obs.error and not obs.done and obs.content.startswith("Error: ")
    assert reason in obs.content, obs.content
    assert len(obs.content) < 200  # a huge input is never echoed back whole


def test_calculate_rejects_non_strings_and_bad_arguments():
    assert calc(12).error
    assert calc(None).error
    with pytest.raises(ValueError, match="string"):
        calculate(["1"])  # type: ignore[arg-type]
    assert len("9" * MAX_EXPRESSION_CHARS) == MAX_EXPRESSION_CHARS and not calc("9" * MAX_EXPRESSION_CHARS).error
    for args in ({}, {"expr": "1"}, {"expression": "1", "extra": "x"}):
        obs = run_general_tool(ToolCall("calculate", args))
        assert obs.error and "exactly one argument" in obs.content


def test_transfer_ends_the_episode():
    obs = run_general_tool(ToolCall("transfer_to_human_agents", {"summary": "user asks for a human"}))
    assert obs.content == "Transfer successful" and obs.done and not obs.error
    missing = run_general_tool(ToolCall("transfer_to_human_agents", {}))
    assert missing.error and not missing.done


def test_other_names_are_not_general_tools():
    assert run_general_tool(ToolCall("find_user", {"name": "x", "zip": "1"})) is None
