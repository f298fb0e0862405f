"""ACEBench Agent on a fixture checkout (tests/domains/acebench/fixture.py): loading, the
sandbox built with the checkout's own classes, tool errors, the state comparison and the
milestones as ACEBench scores them, the multi-step path, gold replay, and the errors for a
missing or wrong checkout."""
from __future__ import annotations

import sys

import pytest

from muajax.agent.gold import replay_gold
from muajax.config.schema import EnvConfig
from muajax.domains.acebench.checkout import AceBenchError
from muajax.domains.acebench.environment import OPENERS, AceBenchEnvironment
from muajax.domains.acebench.scoring import REPAIRED, compare_state, parse_milestone, process_accuracy, subset_figures
from muajax.domains.base import ToolCall
from muajax.domains.registry import make_environment
from muajax.settings.fields import ConfigError
from tests.domains.acebench.fixture import BASE_RULES, MULTI_STEP, USER_TEMPLATE, write_checkout


@pytest.fixture
def checkout(tmp_path):
    return write_checkout(tmp_path / "ACEBench")


@pytest.fixture
def env(checkout):
    return AceBenchEnvironment(str(checkout))


def _task(env, task_id):
    return next(t for t in env.tasks("test") if t.task_id == task_id)


def test_items_load_as_tasks_with_acebench_s_prompts(env):
    assert [t.task_id for t in env.tasks("test")] == ["agent_multi_turn_0", "agent_multi_turn_1", "agent_multi_step_0"]
    assert [t.task_id for t in env.tasks("multi_step")] == ["agent_multi_step_0"]
    turn, step = _task(env, "agent_multi_turn_0"), _task(env, "agent_multi_step_0")
    # multi-turn: muajax's fixed opening, the user plays the item under ACEBench's user prompt
    assert turn.first_user_message == OPENERS["en"] and turn.metadata["subset"] == "multi_turn"
    assert turn.metadata["user_system_prompt"] == USER_TEMPLATE.replace("{instruction}", turn.user_scenario)
    # the agent's rules are ACEBench's, without its [ApiName(...)] text-format section
    assert env.policy_for(turn) == BASE_RULES
    # multi-step: the whole instruction first, no user
    assert step.first_user_message == MULTI_STEP[0][0]["question"] and step.metadata["user_system_prompt"] is None
    assert "finish conversation" in env.policy_for(step)
    with pytest.raises(ValueError, match="no train split"):
        env.tasks("train")
    assert make_environment(EnvConfig(domain="acebench", acebench_dir=str(env.checkout.root))).tasks("test")


def test_tools_are_the_item_s_functions_as_json_schema(env):
    tools = env.reset(_task(env, "agent_multi_turn_0")).tools()
    assert [t["function"]["name"] for t in tools] == ["turn_on_wifi", "add_note", "delete_note"]
    assert tools[1]["function"]["parameters"] == {
        "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "description": "The note."}}}
    assert [t["function"]["name"] for t in env.reset(_task(env, "agent_multi_turn_1")).tools()] == ["turn_on_wifi"]


def test_calls_run_on_the_checkout_s_classes_and_sessions_are_isolated(env):
    task = _task(env, "agent_multi_turn_0")
    one, two = env.reset(task), env.reset(task)
    assert one.step(ToolCall("add_note", {"text": "x"})).content == '{"status": false, "message": "Wi-Fi is off"}'
    # the inherited method runs on every involved instance, as ACEBench's executor does
    assert one.step(ToolCall("turn_on_wifi", {})).content == '{"status": true, "message": "Wi-Fi is on"}'
    assert all(i.wifi for i in one._instances.values())
    assert one.step(ToolCall("add_note", {"text": "buy milk"})).content == '{"status": true, "note_id": 2}'
    assert one.state()[1] == {"NoteApi": {"notes": {"1": {"text": "old note"}, "2": {"text": "buy milk"}}}}
    assert two.state() == [] and not any(i.wifi for i in two._instances.values())
    assert one.evaluate([], communicate_info=True).reward == 1.0
    # the checkout's package is gone from sys.modules once its classes are loaded
    assert not any(k == "model_inference" or k.startswith("model_inference.") for k in sys.modules)


def test_bad_calls_answer_with_an_error_the_agent_can_read(env):
    session = env.reset(_task(env, "agent_multi_turn_0"))
    cases = [(ToolCall("send_fax", {}), "unknown tool 'send_fax'. Available tools: turn_on_wifi, add_note"),
             (ToolCall("add_note", {}), "bad arguments for add_note: missing a required argument: 'text'"),
             (ToolCall("add_note", {"text": "a", "when": 1}), "bad arguments for add_note"),
             (ToolCall("add_note", ["a"]), "arguments of 'add_note' must be a JSON object"),
             (ToolCall("delete_note", {"note_id": 99}), "Error during execution of delete_note: KeyError: 99")]
    for call, expected in cases:
        observation = session.step(call)
        assert observation.error and expected in observation.content, observation
    assert session.state() == []  # multi-turn: no message ran without an error, so ACEBench records no state
    # multi-turn stops a message at its first failing call, as ACEBench's executor does
    first, second, third = session.step_calls([ToolCall("turn_on_wifi", {}), ToolCall("delete_note", {"note_id": 7}),
                                               ToolCall("add_note", {"text": "never"})])
    assert not first.error and second.error and third.error and "did not run" in third.content
    assert session.state() == [] and len(session._instances["NoteApi"].notes) == 1
    step = env.reset(_task(env, "agent_multi_step_0"))
    assert step.step(ToolCall("delete_note", {"note_id": 7})).error and step.state() != []  # multi-step: recorded


def test_state_comparison_is_acebench_s_checker():
    truth = [{"BaseApi": {"wifi": True}}, {"NoteApi": {"notes": {"2": {"text": "a"}}}}]
    right = [{"BaseApi": {"wifi": True}}, {"NoteApi": {"notes": {"1": {"text": "old"}, "2": {"text": "a"}}}}]
    assert compare_state(right, truth) == ([], [])  # a key only the sandbox has is not checked, as in ACEBench
    errors, _ = compare_state([{"BaseApi": {"wifi": False}}, right[1]], truth)
    assert errors == ["BaseApi.wifi: expected True, got False"]
    errors, _ = compare_state([right[0], {"NoteApi": {"notes": {"2": {"text": "b"}}}}], truth)
    assert errors == ["NoteApi.notes['2']: expected {'text': 'a'}, got {'text': 'b'}"]
    errors, _ = compare_state([{"BaseApi": {"wifi": True, "extra": 1}}, right[1]], truth)
    assert errors == ["BaseApi.extra: not in the ground truth"]
    # a ground-truth class no state entry matches (ACEBench's data has typos like "ReminderAPI") is not checked
    assert compare_state(right, [truth[0], {"NoteAPI": {"notes": {}}}]) == ([], ["NoteAPI"])
    errors, _ = compare_state([], truth)
    assert "no call ran" in errors[0]


def test_milestones_match_in_order_by_calls_and_the_best_alternative_counts():
    stones = ["[turn_on_wifi()]", "[add_note(text='a', tag='x')]", "[delete_note(note_id=1)]"]
    wifi, note, delete = [ToolCall("turn_on_wifi", {})], [ToolCall("add_note", {"tag": "x", "text": "a"})], \
        [ToolCall("delete_note", {"note_id": 1})]
    assert process_accuracy(stones, [wifi, note, delete]) == 1.0  # argument order does not matter
    assert process_accuracy(stones, [delete, wifi, note]) == 0.667  # in order: the delete came first
    assert process_accuracy(stones, [wifi, [ToolCall("add_note", {"text": "b", "tag": "x"})]]) == 0.333
    assert process_accuracy([stones, stones[:1]], [wifi]) == 1.0  # the best of the alternatives
    assert process_accuracy([], []) == 1.0
    calls, note_text = parse_milestone("[add_note(text='Ann's list')]")
    assert calls == [ToolCall("add_note", {"text": "Ann's list"})] and note_text == REPAIRED
    calls, why = parse_milestone("[add_note(text=')]")
    assert calls is None and "not a Python call" in why
    assert process_accuracy(["[add_note(text=')]"], [[ToolCall("add_note", {"text": "'"})]]) == 0.0


def test_scores_are_end_to_end_and_process_and_the_multi_step_path_runs_without_a_user(env):
    task = _task(env, "agent_multi_step_0")
    session = env.reset(task)
    session.step_calls([ToolCall("turn_on_wifi", {})])
    session.step_calls([ToolCall("delete_note", {"note_id": 1})])
    result = session.evaluate([], communicate_info=True)
    assert (result.reward, result.partial) == (0.0, 0.667)  # the second order's first two milestones
    assert result.details["state_errors"] == ["NoteApi.notes['2']: missing, expected {'text': \"Ann's list\"}"]
    session.step_calls([ToolCall("add_note", {"text": "Ann's list"})])
    assert (session.evaluate([], communicate_info=True).reward, session.evaluate([], communicate_info=True).partial) \
        == (1.0, 1.0)
    assert env.reset(task).evaluate([], communicate_info=True).details["state_errors"][0].startswith(
        "wrong number of classes: no call ran")


def test_gold_replays_every_fixture_item_to_its_ground_truth(env):
    replays = replay_gold(env, env.tasks("test"))
    assert [(r.task_id, r.reward, r.partial, r.errors) for r in replays] == [
        ("agent_multi_turn_0", 1.0, 1.0, 0), ("agent_multi_turn_1", 1.0, 1.0, 0), ("agent_multi_step_0", 1.0, 1.0, 0)]
    figures = subset_figures(replays)
    assert figures["multi_turn"]["items"] == 2 and figures["overall"]["end_to_end"] == 1.0


def test_a_missing_or_wrong_checkout_is_a_clear_error(tmp_path, checkout):
    with pytest.raises(AceBenchError, match=r"env.acebench_dir \(--acebench-dir\): not set; expected the path of an "
                                            r"ACEBench checkout \(git clone https://github.com/ACEBench/ACEBench\)"):
        AceBenchEnvironment(None)
    with pytest.raises(AceBenchError, match="is not a directory"):
        AceBenchEnvironment(str(tmp_path / "nowhere"))
    (checkout / "model_inference/apimodel_inference.py").unlink()
    with pytest.raises(AceBenchError, match="not an ACEBench checkout of the expected layout: it lacks "
                                            "model_inference/apimodel_inference.py"):
        AceBenchEnvironment(str(checkout))
    with pytest.raises(AceBenchError, match="env.acebench_language"):
        AceBenchEnvironment(str(checkout), "fr")
    with pytest.raises(ConfigError, match="acebench_dir"):
        EnvConfig(domain="acebench").validate()


def test_an_item_whose_class_cannot_be_imported_is_named(tmp_path):
    root = write_checkout(tmp_path / "a", classes={"NoteApi": "model_inference.multi_turn.scenariosen.gone"})
    with pytest.raises(AceBenchError, match="item 'agent_multi_turn_0' involves class 'NoteApi', which cannot be "
                                            "imported from model_inference.multi_turn.scenariosen.gone"):
        AceBenchEnvironment(str(root))
    root = write_checkout(tmp_path / "b")
    mapping = root / "model_inference/multi_step/multi_step_utils.py"
    mapping.write_text(mapping.read_text().replace("'NoteApi'", "'NotesApi'"))
    with pytest.raises(AceBenchError, match="item 'agent_multi_step_0' involves class 'NoteApi', which "
                                            "model_inference/multi_step/multi_step_utils.py does not map"):
        AceBenchEnvironment(str(root))
