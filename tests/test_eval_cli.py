"""`python -m muajax.eval`: pass^k, the per-task report, and the CLI on the built-in domain."""
import json
from collections import Counter

import pytest

from muajax.agent.evaluation import pass_hat_k, summarize
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
    from muajax.agent.evaluation import task_records

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


def test_eval_cli_on_the_builtin_domain(tmp_path, tmp_path_factory, capsys):
    """A model that is right on some tasks, so pass^k compares values that are not all 0.

    Greedy, the chain model answers ANSWER every turn. On the built-in test split's first
    four tasks that is: 000 a cancellation (needs a write: fails), 001 a question whose
    answer is 76 (fails), 002 a question whose answer is "cancelled" (succeeds: the
    database is untouched and the answer was told), 003 a cancellation the user calls off
    (succeeds: nothing must be written)."""
    from muajax.eval import main
    from tests.serving.test_serve import chain_model

    checkpoint = chain_model(tmp_path_factory, text=ANSWER)
    out = tmp_path / "report" / "eval.json"
    code = main(["--checkpoint", checkpoint, "--domain", "builtin", "--split", "test", "--trials", "2",
                 "--max-tasks", "4", "--max-turns", "3", "--max-new-tokens", "16", "--max-context", "2048",
                 "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert "pass^1:" in stdout and "partial (TCR)" in stdout and "calls per tool" in stdout
    assert (figures["domain"], figures["split"], figures["tasks"], figures["trials"]) == ("builtin", "test", 4, 2)
    assert figures["calls_per_tool"] == {} and figures["terminations"] == {"user_stop": 8}

    report = json.loads(out.read_text())
    assert report["summary"]["temperature"] == 0.0 and report["options"]["n_per_task"] == 2
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


def test_eval_cli_reports_bad_input(tmp_path, capsys):
    from muajax.eval import main

    assert main(["--checkpoint", str(tmp_path), "--domain", "builtin", "--out", str(tmp_path / "x.json")]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(tmp_path), "--domain", "retail", "--user", "scripted"])
    assert exc.value.code == 2
    assert "only for --domain builtin" in capsys.readouterr().err
