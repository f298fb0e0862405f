"""`python -m muajax.eval`: pass^k, the per-task report, and the CLI on the built-in domain."""
import json
from collections import Counter

import pytest

from muajax.agent.pass_k import pass_hat_k, summarize
from muajax.agent.trajectory import Trajectory


def test_pass_hat_k_is_the_mean_of_c_choose_k_over_n_choose_k():
    counts = [(4, 4), (0, 4), (2, 4), (3, 4)]
    assert pass_hat_k(counts, 1) == pytest.approx((1 + 0 + 0.5 + 0.75) / 4)
    assert pass_hat_k(counts, 2) == pytest.approx((1 + 0 + 1 / 6 + 3 / 6) / 4)
    assert pass_hat_k(counts, 3) == pytest.approx((1 + 0 + 0 + 1 / 4) / 4)
    assert pass_hat_k(counts, 4) == pytest.approx(1 / 4)  # only the task that never failed
    values = [pass_hat_k(counts, k) for k in range(1, 5)]
    assert values == sorted(values, reverse=True)
    assert pass_hat_k([(1, 1)], 1) == 1.0 and pass_hat_k([], 2) == 0.0
    with pytest.raises(ValueError, match="at least 3 trials"):
        pass_hat_k([(2, 2)], 3)


def _trajectory(task, index, reward, partial, calls=()):
    return Trajectory(task_id=task, group_id=0, rollout_index=index, seed=0, tokens=[], loss_mask=[], logprobs=[],
                      prompt_len=0, messages=[{"role": "user", "content": "hi"}], termination="user_stop",
                      reward=reward, partial=partial, turns=2, tool_calls=Counter(calls))


def test_per_task_records_agree_with_the_summary():
    from muajax.agent.pass_k import task_records

    rewards = {"a": [1, 1, 0], "b": [0, 0, 0], "c": [1, 1, 1]}
    trajectories = [_trajectory(t, i, r, 0.5 + 0.5 * r, ["find_user"] * (i + 1))
                    for t, rs in rewards.items() for i, r in enumerate(rs)]
    summary = summarize(trajectories, 3)
    records = {r["task_id"]: r for r in task_records(trajectories, 3)}
    assert records["a"]["successes"] == 2 and records["a"]["pass_hat"]["2"] == pytest.approx(1 / 3)
    for k in (1, 2, 3):
        mean = sum(r["pass_hat"][str(k)] for r in records.values()) / 3
        assert summary[f"pass^{k}"] == pytest.approx(mean)
    assert summary["pass^1"] == pytest.approx(5 / 9) and summary["pass^3"] == pytest.approx(1 / 3)
    assert summary["calls_per_tool"] == {"find_user": pytest.approx(2.0)}
    assert summary["partial"] == pytest.approx(sum(0.5 + 0.5 * r for rs in rewards.values() for r in rs) / 9)


ANSWER = "It is cancelled."  # right for an order whose status is "cancelled", and it never writes


ANSWER = "It is cancelled."  # right for an order whose status is "cancelled", and it never writes


def run_eval(checkpoint, out, *extra):
    from muajax.eval import main

    code = main(["--checkpoint", checkpoint, "--domain", "builtin", "--split", "test", "--trials", "2",
                 "--max-turns", "3", "--max-context", "2048", "--out", str(out), *extra])
    return code


def test_eval_cli_on_the_builtin_domain(tmp_path, tmp_path_factory, capsys):
    """A model that is right on some tasks, so pass^k compares values that are not all 0.

    Greedy, the chain model answers ANSWER every turn. On the built-in test split's first
    four tasks that is: 000 a cancellation (needs a write: fails), 001 a question whose
    answer is 76 (fails), 002 a question whose answer is "cancelled" (succeeds: the
    database is untouched and the answer was told), 003 a cancellation the user calls off
    (succeeds: nothing must be written)."""
    from tests.serving.test_serve import chain_model

    out = tmp_path / "report" / "eval.json"
    code = run_eval(chain_model(tmp_path_factory, text=ANSWER), out, "--max-tasks", "4", "--max-new-tokens", "16")
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    result = json.loads(stdout.strip().splitlines()[-1])
    assert "pass^1:" in stdout and "partial (TCR)" in stdout and "calls per tool" in stdout
    assert (result["protocol"], result["split"], result["trials"]) == ("muajax", "test", 2)
    (figures,) = result["domains"].values()
    assert list(result["domains"]) == ["builtin"] and figures["tasks"] == 4
    assert figures["calls_per_tool"] == {} and figures["terminations"] == {"user_stop": 8}

    report = json.loads(out.read_text())
    assert report["summary"]["temperature"] == 0.0 and report["options"]["n_per_task"] == 2
    assert report["options"]["execute_all_calls"] and report["options"]["zero_unfinished"]
    tasks = report["tasks"]
    assert [t["task_id"] for t in tasks] == [f"builtin-test-00{i}" for i in range(4)]
    assert [t["successes"] for t in tasks] == [0, 0, 2, 2]
    for task in tasks:
        assert task["trials"] == 2 and len(task["rollouts"]) == 2
        assert task["successes"] == sum(r["reward"] >= 1.0 for r in task["rollouts"])
        messages = task["rollouts"][0]["messages"]
        assert messages[0]["role"] == "user" and messages[1] == {"role": "assistant", "content": ANSWER}
    successes = [(t["successes"], t["trials"]) for t in tasks]
    for k in (1, 2):
        assert figures[f"pass^{k}"] == pytest.approx(pass_hat_k(successes, k)) == pytest.approx(0.5)
    assert figures["success"] == pytest.approx(0.5)


def test_a_cut_off_rollout_scores_0_whatever_the_database_says(tmp_path, tmp_path_factory, capsys):
    """τ2's rule: only an agent or user stop counts. Greedy, this model calls `calculate`
    every turn until max_turns; the database is untouched (right for a question whose
    answer the agent never gave, and for a change of mind), yet every rollout scores 0."""
    from tests.serving.test_serve import chain_model

    out = tmp_path / "eval.json"
    assert run_eval(chain_model(tmp_path_factory), out, "--max-tasks", "2", "--max-new-tokens", "32") == 0
    (figures,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["domains"].values()
    assert figures["calls_per_tool"] == {"calculate": 3.0}
    assert figures["terminations"] == {"max_turns": 4} and figures["turns"] == 3.0
    assert figures["pass^1"] == figures["pass^2"] == figures["success"] == 0.0
    for task in json.loads(out.read_text())["tasks"]:
        assert all(r["details"]["unfinished"] == "max_turns" for r in task["rollouts"])
        messages = task["rollouts"][0]["messages"]
        assert messages[1]["tool_calls"][0]["function"]["name"] == "calculate"
        assert messages[2] == {"role": "tool", "content": messages[2]["content"], "tool_call_id": "call_1_0",
                               "name": "calculate"} and "5" in messages[2]["content"]


def test_eval_cli_reports_bad_input(tmp_path, capsys):
    from muajax.eval import main

    assert main(["--checkpoint", str(tmp_path), "--domain", "builtin", "--out", str(tmp_path / "x.json")]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(tmp_path), "--domain", "retail", "--user", "scripted"])
    assert exc.value.code == 2
    assert "only for --domain builtin" in capsys.readouterr().err


def test_domains_are_summarized_apart_and_twins_dropped_from_dedup():
    from muajax.agent.pass_k import summarize_domains

    def rollout(domain, task, index, reward):
        t = _trajectory(task, index, reward, reward)
        t.domain = domain
        return t

    # τ2's domains reuse task ids: retail "42" and airline "42" are different tasks
    trajectories = [rollout("retail", "42", i, 1) for i in range(2)] + [rollout("retail", "5", i, 0) for i in range(2)]
    trajectories += [rollout("airline", "42", 0, 0), rollout("airline", "42", 1, 1)]
    parts = summarize_domains(trajectories, 2, twins=lambda d: {"42"} if d == "retail" else set())
    assert list(parts) == ["retail", "airline"]
    assert parts["retail"]["tasks"] == 2 and parts["retail"]["pass^1"] == 0.5 and parts["retail"]["pass^2"] == 0.5
    assert parts["retail"]["dedup"] == {"tasks": 1, "removed": ["42"], "success": 0.0, "pass^1": 0.0, "pass^2": 0.0}
    assert parts["airline"]["tasks"] == 1 and parts["airline"]["pass^1"] == 0.5 and parts["airline"]["pass^2"] == 0
    assert "dedup" not in parts["airline"]
    pooled = summarize(trajectories, 2)
    assert pooled["tasks"] == 3  # (domain, task id) pairs, never merged across domains


def _run(argv, capsys):
    from muajax.eval import main

    code = main(argv)
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    return json.loads(stdout.strip().splitlines()[-1]), stdout


def test_muajax_protocol_reports_each_tau2_domain_and_the_twin_free_score(tmp_path, tmp_path_factory, capsys,
                                                                           monkeypatch):
    from tests.serving.test_serve import chain_model

    monkeypatch.chdir(tmp_path)  # the second run writes its report to the default place

    checkpoint = chain_model(tmp_path_factory)  # greedy, it answers every turn with a `calculate` call
    user = ["--user-model", "never-asked", "--user-base-url", "http://127.0.0.1:9/v1"]
    common = ["--checkpoint", checkpoint, "--trials", "1", "--max-turns", "2", "--max-new-tokens", "32",
              "--max-context", "8192", *user]
    result, stdout = _run([*common, "--domain", "retail", "airline", "--max-tasks", "1",
                           "--out", str(tmp_path / "e.json")], capsys)
    assert list(result["domains"]) == ["retail", "airline"] and "retail: tasks 1" in stdout
    for name, figures in result["domains"].items():
        assert figures["tasks"] == 1 and figures["terminations"] == {"max_turns": 1}
        assert figures["calls_per_tool"] == {"calculate": 2.0} and figures["pass^1"] == 0.0
        report = json.loads((tmp_path / f"e-{name}.json").read_text())
        rollout = report["tasks"][0]["rollouts"][0]
        assert rollout["messages"][2] == {"role": "tool", "content": "5.0", "tool_call_id": "call_1_0",
                                          "name": "calculate"}
        assert rollout["details"]["unfinished"] == "max_turns"

    result, stdout = _run([*common, "--domain", "airline", "--task-ids", "26", "16"], capsys)
    assert (tmp_path / "eval-airline-test.json").is_file()
    figures = result["domains"]["airline"]
    assert figures["tasks"] == 2 and figures["dedup"]["removed"] == ["16"] and figures["dedup"]["tasks"] == 1
    assert "without the split twins (16)" in stdout


def test_gold_policy_prints_the_histogram_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary, stdout = _run(["--policy", "gold", "--domain", "builtin"], capsys)
    assert (summary["policy"], summary["domain"], summary["split"], summary["n"]) == ("gold", "builtin", "test", 50)
    assert summary["reward_mean"] == 1.0 and summary["histogram"] == {"1.0": 50} and "reward 1.0: 50 tasks" in stdout
    assert (tmp_path / "gold-builtin-test.json").is_file()
    # telecom: the user's own phone actions run on their side, τ2's evaluator scores the result
    summary, _ = _run(["--policy", "gold", "--domain", "telecom", "--split", "train", "--max-tasks", "12"], capsys)
    assert summary["n"] == 12 and summary["reward_mean"] == 1.0
    from muajax.eval import main

    with pytest.raises(SystemExit):
        main(["--policy", "gold", "--domain", "builtin", "--checkpoint", str(tmp_path)])
    assert "give --checkpoint DIR, or --policy gold" in capsys.readouterr().err
