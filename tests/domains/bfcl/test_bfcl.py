"""BFCL-v3 multi-turn: gold replay through BFCL's own checker, wrong and malformed calls,
the scripted user, isolation, and `python -m muajax.eval --domain bfcl` end to end.

Replaying the ground truth of all 800 tasks of the four categories takes about 4 s, so
every run replays them all. Skips only when `bfcl` is not installed (CI installs it).
"""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("bfcl", reason="BFCL-v3 is not installed: pip install --no-deps nvidia-bfcl==26.3 && "
                                   "pip install -e '.[bfcl]'")

from bfcl.eval_checker.multi_turn_eval import multi_turn_utils

from muajax.domains.base import Task, ToolCall
from muajax.domains.bfcl.environment import CATEGORIES, BfclEnvironment, format_call, normalize_category
from muajax.domains.base import STOP
from muajax.domains.bfcl.user import BfclUser

# Its ground truth calls `tail` in turn 1, but miss_func holds `tail` out until turn 3:
# with the held-out function really unavailable, no agent (and not the gold) can pass it.
GOLD_UNSOLVABLE = {"multi_turn_miss_func_49"}


@pytest.fixture(scope="module")
def envs():
    return {c: BfclEnvironment(c) for c in CATEGORIES}


@pytest.fixture(scope="module")
def base(envs):
    return envs["multi_turn_base"]


def _task(env, task_id: str) -> Task:
    return next(t for t in env.tasks("test") if t.task_id == task_id)


def _gold_turns(task: Task) -> list[list[ToolCall]]:
    turns, i = [], 0
    for n in task.metadata["gold_turn_lengths"]:
        turns.append(list(task.gold_actions[i:i + n]))
        i += n
    return turns


def _replay(env, task: Task, turns: list[list[ToolCall]]):
    """Run `turns` through a session, each turn's calls as one step (parallel calls, as
    BFCL's ground truth is one list per turn), the scripted user moving to the next turn
    after each (as an agent answering in plain text would); returns (session, evaluation)."""
    session = env.reset(task)
    user = BfclUser().start(task, session)
    for calls in turns:
        if calls:
            session.step_calls(calls)
        last = user.respond("Done.")
    assert last.end == STOP and last.text == STOP
    evaluation = session.evaluate([], communicate_info=True)
    session.close()
    return session, evaluation


def _own_globals() -> list[str]:
    """BFCL executor instances muajax sessions left in BFCL's module globals."""
    return sorted(name for name in vars(multi_turn_utils) if name.startswith("muajax_"))


@pytest.mark.parametrize("category", CATEGORIES)
def test_gold_replay_scores_one_on_every_task(envs, category):
    env = envs[category]
    before = _own_globals()
    tasks = env.tasks("test")
    assert len(tasks) == 200 and len({t.task_id for t in tasks}) == 200
    failures = {}
    for task in tasks:
        _, evaluation = _replay(env, task, _gold_turns(task))
        assert evaluation.partial == evaluation.reward
        if evaluation.reward != 1.0:
            failures[task.task_id] = evaluation.details
    assert set(failures) == GOLD_UNSOLVABLE & {t.task_id for t in tasks}, failures
    if failures:  # the checker names the turn whose results the gold could not produce
        assert "turn 1" in failures["multi_turn_miss_func_49"]["error"]
    assert _own_globals() == before  # every session and evaluation freed BFCL's instances


def test_tasks_and_schemas(base):
    task = _task(base, "multi_turn_base_0")
    assert task.domain == "bfcl" and task.split == "test"
    assert task.first_user_message == task.metadata["user_turns"][0]
    assert task.first_user_message.startswith("Move 'final_report.pdf' within document directory")
    assert set(task.metadata["involved_classes"]) == {"GorillaFileSystem", "TwitterAPI"}
    assert len(task.metadata["user_turns"]) == 4 == len(task.metadata["gold_turn_lengths"])
    # a positional ground-truth argument ("sort('final_report.pdf')") is named from the method
    assert ToolCall("sort", {"file_name": "final_report.pdf"}, "turn2-0") in task.gold_actions
    session = base.reset(task)
    tools = {t["function"]["name"]: t["function"] for t in session.tools()}
    assert {"cd", "mkdir", "mv", "grep", "post_tweet"} <= set(tools) and "logarithm" not in tools
    for fn in tools.values():  # BFCL's 'dict'/'float' types are JSON schema here
        assert fn["parameters"]["type"] == "object"
        assert all(p["type"] in ("string", "integer", "number", "boolean", "array", "object")
                   for p in fn["parameters"]["properties"].values())
    assert tools["mv"]["parameters"]["required"] == ["source", "destination"]
    assert base.policy() == ""  # BFCL's function-calling prompt: no system text, only the tools
    session.close()


def test_the_rollout_prompt_is_bfcls_function_calling_prompt(base):
    from tests.agent.test_rollout import shared_engine, tokenizer
    from muajax.agent.rollout import run_rollouts_sync

    task = _task(base, "multi_turn_base_0")
    (record,) = run_rollouts_sync(shared_engine(), tokenizer(), base, BfclUser(), [task], n_per_task=1, max_turns=1,
                                  max_new_tokens_per_turn=4, max_context=2048)
    text = tokenizer().decode(record.tokens[: record.prompt_len], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '{"type": "function", "function": {"name": "cd"' in text and "composing functions" not in text
    assert text.endswith(f"<|im_start|>user\n{task.first_user_message}<|im_end|>\n<|im_start|>assistant\n"
                         "<think>\n\n</think>\n\n")


def test_a_wrong_call_or_a_skipped_turn_scores_zero(base):
    task = _task(base, "multi_turn_base_0")
    gold = _gold_turns(task)
    wrong = [list(calls) for calls in gold]
    wrong[0][1] = ToolCall("mkdir", {"dir_name": "tmp"})  # gold: mkdir(dir_name='temp')
    _, evaluation = _replay(base, task, wrong)
    assert evaluation.reward == 0.0 and evaluation.partial == 0.0
    assert evaluation.details["error_type"] == "multi_turn:instance_state_mismatch"
    assert evaluation.details["state_differences"] == ["root"]

    skipped = [list(calls) for calls in gold]
    skipped[1] = []  # turn 1 asks for a grep the agent never runs
    _, evaluation = _replay(base, task, skipped)
    assert evaluation.reward == 0.0
    assert evaluation.details["error_type"] == "multi_turn:empty_turn_model_response"

    # the right calls but a stop before the last turn: BFCL's force-terminated case
    session = base.reset(task)
    for call in gold[0]:
        session.step(call)
    evaluation = session.evaluate([], communicate_info=False)
    assert evaluation.reward == 0.0 and evaluation.details["error_type"] == "multi_turn:force_terminated"
    assert evaluation.details["turns_reached"] == 1 and evaluation.details["turns"] == 4
    session.close()


def test_bad_calls_get_clear_error_observations(base):
    task = _task(base, "multi_turn_base_0")
    session = base.reset(task)
    obs = session.step(ToolCall("rm_rf_everything", {}))
    assert obs.error and "unknown tool 'rm_rf_everything'" in obs.content and "mkdir" in obs.content
    obs = session.step(ToolCall("eval", {"x": "__import__('os')"}))  # never reaches BFCL's eval()
    assert obs.error and "unknown tool 'eval'" in obs.content
    obs = session.step(ToolCall("cd", ["document"]))
    assert obs.error and "must be a JSON object" in obs.content
    obs = session.step(ToolCall("cd", {"folder) or print(1": "x"}))
    assert obs.error and "not a valid parameter name" in obs.content
    obs = session.step(ToolCall("cd", {"lambda": "x"}))
    assert obs.error and "not a valid parameter name" in obs.content
    obs = session.step(ToolCall("cd", {"folder": math.nan}))
    assert obs.error and "not a finite number" in obs.content
    obs = session.step(ToolCall("", {}))
    assert obs.error and "no name" in obs.content
    obs = session.step("cd(folder='document')")
    assert obs.error and "expected a ToolCall" in obs.content
    # a bad argument reaches BFCL, whose own error text the agent sees
    obs = session.step(ToolCall("cd", {"directory": "document"}))
    assert obs.error and obs.content.startswith("Error during execution:") and "directory" in obs.content
    obs = session.step(ToolCall("cd", {"folder": "no_such_folder"}))  # a tool-level error is an answer
    assert not obs.error and "No such directory" in obs.content
    # only the calls that reached BFCL are logged (and replayed by the checker)
    assert session.executed_calls() == [["cd(directory='document')", "cd(folder='no_such_folder')"]]
    session.close()
    assert session.step(ToolCall("ls", {})).content == "Error: this session is closed"


def test_sessions_are_isolated_and_outputs_are_bfcls(base):
    task = _task(base, "multi_turn_base_0")
    before = _own_globals()
    a, b = base.reset(task), base.reset(task)
    assert a.step(ToolCall("cd", {"folder": "document"})).content == '{"current_working_directory": "document"}'
    assert not a.step(ToolCall("mkdir", {"dir_name": "temp"})).error
    assert "temp" in json.loads(a.step(ToolCall("ls", {})).content)["current_directory_content"]
    b.step(ToolCall("cd", {"folder": "document"}))
    assert "temp" not in json.loads(b.step(ToolCall("ls", {})).content)["current_directory_content"]
    a.close()
    assert "temp" not in json.loads(b.step(ToolCall("ls", {})).content)["current_directory_content"]
    assert len(_own_globals()) == len(before) + 2  # b's GorillaFileSystem and TwitterAPI
    b.close()
    assert _own_globals() == before
    assert format_call("mv", {"source": "a'b", "n": [1, 2.5, None, True]}) == \
        "mv(source=\"a'b\",n=[1, 2.5, None, True])"


def test_miss_func_unlocks_the_held_out_function_at_its_turn(envs):
    env = envs["multi_turn_miss_func"]
    task = _task(env, "multi_turn_miss_func_0")
    (turn, names), = task.metadata["held_out"].items()
    session = env.reset(task)
    user = BfclUser().start(task, session)
    before = [t["function"]["name"] for t in session.tools()]
    assert all(n not in before for n in names) and session.tools_revision == 0
    obs = session.step(ToolCall(names[0], {}))
    assert obs.error and f"unknown tool {names[0]!r}" in obs.content
    for _ in range(turn):
        reply = user.respond("ok")
    # BFCL's function-calling turn: the prompt, and the functions in the tool list, appended
    assert reply.text == "I have updated some more functions you can choose from. What about now?"
    assert [t["function"]["name"] for t in session.tools()] == before + list(names)
    assert session.tools_revision == 1
    assert "unknown tool" not in session.step(ToolCall(names[0], {})).content
    session.close()


def test_more_steps_than_bfcl_allows_in_a_turn_force_quit(base):
    task = _task(base, "multi_turn_base_0")
    session = base.reset(task)
    for _ in range(20):
        assert not session.step(ToolCall("pwd", {})).done
    obs = session.step(ToolCall("pwd", {}))
    assert obs.done and "more than 20 steps" in obs.content
    assert session.step(ToolCall("pwd", {})).done
    user = BfclUser().start(task, session)
    assert user.respond("I'm done").end == STOP  # no further turns after a force-quit
    evaluation = session.evaluate([], communicate_info=True)
    assert evaluation.reward == 0.0 and evaluation.details["error_type"] == "multi_turn:force_terminated"
    session.close()


def test_gold_replay_through_the_rollout_conversation(base, tokenizer):
    """The same routing a real rollout uses: parsed <tool_call> texts go to the session,
    plain text to the BFCL user, and the finished trajectory is scored by BFCL."""
    from muajax.models.tokenizer import IM_END_ID
    from muajax.agent.calls import execute_tools, tool_schemas
    from muajax.agent.conversation import Conversation
    from muajax.agent.rollout_config import RolloutConfig

    tok = tokenizer
    for task_id in ("multi_turn_base_1", "multi_turn_base_7"):
        task = _task(base, task_id)
        session = base.reset(task)
        user = BfclUser().start(task, session)
        conv = Conversation(tok, RolloutConfig(max_turns=200, execute_all_calls=True), task, group_id=0,
                            rollout_index=0, seed=0, session=session, user_session=user, system_ids=[1, 2, 3],
                            schemas=tool_schemas(session), max_context=10**6)

        def say(text, conv=conv, session=session, user=user):
            ids = tok.encode(text, add_special_tokens=False) + [IM_END_ID]
            route = conv.on_generation(ids, [0.0] * len(ids), "stop")
            if route.kind == "tool":
                return conv.on_tool_results(execute_tools(session, route.calls))
            return conv.on_user_turn(user.respond(route.user_text), 0.0)

        turns = _gold_turns(task)
        for calls in turns:  # each turn's calls in one message: BFCL's parallel calls
            if calls:
                assert say("".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n"
                                   "</tool_call>" for c in calls)) is not None
            say("All done.")
        record = conv.trajectory()
        assert record.termination == "user_stop" and record.reward == 1.0, record.details
        users = [m["content"] for m in record.messages if m["role"] == "user"]
        assert users == [*task.metadata["user_turns"], STOP]
        # one step per turn, its calls in order (BFCL's [turn][step][call] layout)
        steps = session.executed_steps()
        assert [len(turn) for turn in steps] == [1 if calls else 0 for calls in turns]
        assert [call for turn in steps for step in turn for call in step] == \
            [format_call(c.name, c.arguments) for calls in turns for c in calls]
        assert max(len(calls) for calls in turns) > 1  # the task really has parallel calls


def test_bad_input_is_refused_clearly(base, envs):
    with pytest.raises(ValueError, match="no train split"):
        base.tasks("train")
    with pytest.raises(ValueError, match="only split is 'test'"):
        base.tasks("dev")
    with pytest.raises(ValueError, match="unknown BFCL multi-turn category 'composite'"):
        BfclEnvironment("composite")
    assert normalize_category("miss_param") == "multi_turn_miss_param"
    other = _task(envs["multi_turn_miss_param"], "multi_turn_miss_param_0")
    with pytest.raises(ValueError, match="is not a BFCL multi_turn_base task"):
        base.reset(other)
    task = _task(base, "multi_turn_base_0")
    with pytest.raises(ValueError, match="needs the task's BFCL environment session"):
        BfclUser().start(task, None)
    foreign = Task("x", "retail", "hi", "")
    with pytest.raises(ValueError, match="plays only BFCL tasks"):
        BfclUser().start(foreign, base.reset(task))


def test_config_and_registry_wiring():
    from muajax.config.schema import ConfigError, EnvConfig, UserConfig, load_config
    from muajax.domains.bfcl.user import BfclUser as User
    from muajax.domains.registry import DomainConfigError, make_domain

    domain = make_domain(EnvConfig(domain="bfcl", bfcl_category="multi_turn_long_context"), UserConfig())
    assert domain.env.category == "multi_turn_long_context" and isinstance(domain.user, User)
    with pytest.raises(DomainConfigError, match="user.kind: .*scripted user turns"):
        make_domain(EnvConfig(domain="bfcl"), UserConfig(kind="openai", model="m"))
    with pytest.raises(ConfigError, match="no train split"):
        load_config(overrides=["env.domain=bfcl"])


def test_eval_cli_on_bfcl(tmp_path, tmp_path_factory, capsys):
    from muajax.eval import main
    from tests.serving.test_serve import chain_model

    checkpoint = chain_model(tmp_path_factory)  # greedy, it calls `calculate` (not a BFCL tool) every turn
    out = tmp_path / "bfcl.json"
    code = main(["--checkpoint", checkpoint, "--domain", "bfcl", "--trials", "2", "--max-tasks", "2",
                 "--max-turns", "3", "--max-new-tokens", "32", "--max-context", "8192", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    result = json.loads(stdout.strip().splitlines()[-1])
    assert (result["split"], result["trials"]) == ("test", 2)
    figures = result["domains"]["bfcl"]
    assert figures["tasks"] == 2 and figures["bfcl_category"] == "multi_turn_base"
    assert figures["pass^1"] == figures["pass^2"] == 0.0 and figures["terminations"] == {"max_turns": 4}
    assert figures["calls_per_tool"] == {"<unknown>": 3.0}
    report = json.loads(out.read_text())
    assert [t["task_id"] for t in report["tasks"]] == ["multi_turn_base_0", "multi_turn_base_1"]
    for task in report["tasks"]:
        for rollout in task["rollouts"]:
            assert rollout["details"]["error_type"] == "multi_turn:force_terminated"
            messages = rollout["messages"]
            assert messages[0]["role"] == "user" and messages[2]["role"] == "tool"
            assert messages[2]["content"].startswith("Error: unknown tool 'calculate'. Available tools:")

    assert main(["--checkpoint", checkpoint, "--domain", "bfcl", "--split", "train", "--out",
                 str(tmp_path / "x.json")]) == 2
    assert "no train split" in capsys.readouterr().err
    for bad in (["--user", "openai", "--user-model", "m"], ["--bfcl-category", "composite"]):
        with pytest.raises(SystemExit):
            main(["--checkpoint", checkpoint, "--domain", "bfcl", *bad])
    with pytest.raises(SystemExit):
        main(["--checkpoint", checkpoint, "--domain", "builtin", "--bfcl-category", "miss_func"])
    assert "applies only to --domain bfcl" in capsys.readouterr().err


def test_gold_policy_on_bfcl_scores_one_but_the_unsolvable_task(tmp_path, capsys):
    from muajax.eval import main

    out = tmp_path / "gold.json"
    assert main(["--policy", "gold", "--domain", "bfcl", "--bfcl-category", "miss_func", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert (summary["policy"], summary["domain"], summary["split"], summary["n"]) == ("gold", "bfcl", "test", 200)
    assert summary["reward_mean"] == pytest.approx(199 / 200) and summary["histogram"] == {"1.0": 199, "0.0": 1}
    assert summary["not_one"] == sorted(GOLD_UNSOLVABLE) and "reward 0.0: 1 tasks" in stdout
    tasks = json.loads(out.read_text())["tasks"]
    assert len(tasks) == 200 and all(t["calls"] > 0 for t in tasks)
