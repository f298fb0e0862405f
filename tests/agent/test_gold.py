"""Gold replay (`muajax.agent.gold`): every task's gold actions through the environment and
its evaluator; a wrong gold shows up in the histogram; BFCL-style turns and MCP servers."""
from __future__ import annotations

import dataclasses

import pytest

from muajax.agent.gold import gold_summary, gold_turns, replay_gold
from muajax.domains.base import Task, ToolCall
from muajax.domains.builtin import BuiltinEnvironment
from muajax.domains.mcp.environment import McpEnvironment
from tests.domains.mcp.test_mcp import SCENARIO, _write


def test_builtin_gold_scores_one_and_a_wrong_gold_does_not():
    env = BuiltinEnvironment(seed=0)
    tasks = env.tasks("test")
    cancel = next(t for t in tasks if t.metadata["kind"] == "cancel")
    # a gold that cancels an order that does not exist: the domain's evaluator cannot build
    # the gold database, which the replay reports as a 0 instead of stopping
    bogus = ToolCall("cancel_order", {"order_id": "#nope"})
    broken = dataclasses.replace(cancel, task_id="broken", gold_actions=(*cancel.gold_actions[:-1], bogus))
    replays = replay_gold(env, [*tasks, broken])
    summary = gold_summary(replays)
    assert summary["n"] == len(tasks) + 1 and summary["not_one"] == ["broken"]
    assert summary["histogram"] == {"1.0": len(tasks), "0.0": 1}
    assert summary["reward_mean"] == pytest.approx(len(tasks) / (len(tasks) + 1))
    assert "gold action cancel_order" in replays[-1].details["evaluate_error"]
    assert replays[-1].calls == len(cancel.gold_actions) and replays[-1].errors == 1 == summary["call_errors"]
    assert gold_summary([]) == {"n": 0, "reward_mean": 0.0, "partial_mean": 0.0, "histogram": {}, "not_one": [],
                                "call_errors": 0}


def test_gold_turns_follow_the_tasks_turn_lengths():
    calls = tuple(ToolCall(f"f{i}", {}) for i in range(4))
    plain = Task("t", "d", "hi", "", gold_actions=calls)
    assert gold_turns(plain) == [[[c] for c in calls]]  # one message per call, one user turn
    turned = dataclasses.replace(plain, metadata={"gold_turn_lengths": (2, 0, 2)})
    assert gold_turns(turned) == [[list(calls[:2])], [], [list(calls[2:])]]  # a turn's calls in one message
    with pytest.raises(ValueError, match="sum to 3"):
        gold_turns(dataclasses.replace(plain, metadata={"gold_turn_lengths": (1, 2)}))


def test_mcp_scenario_gold_through_a_real_server(tmp_path):
    with McpEnvironment(_write(tmp_path, SCENARIO)) as env:
        (replay,) = replay_gold(env, env.tasks("train"))
    assert replay.task_id == "groceries" and (replay.reward, replay.partial, replay.calls) == (1.0, 1.0, 1)
    assert replay.details == {"expected_calls_met": [True], "state_checks_met": [True, True]}
