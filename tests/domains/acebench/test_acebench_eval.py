"""`python -m muajax.eval --domain acebench` on the fixture checkout: the gold replay, a saved
policy against a local fake user endpoint (both subsets' end-to-end and process accuracy and
their mean, ending with one JSON line), and the errors."""
from __future__ import annotations

import json

import pytest

from tests.domains.acebench.fixture import write_checkout
from tests.support.openai_server import ScriptedOpenAIServer

WIFI_CALL = 'Sure.<tool_call>{"name":"turn_on_wifi","arguments":{}}</tool_call>'  # greedy, every turn


def _main(argv, capsys):
    from muajax.eval import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gold_prints_both_subsets_and_the_overall_mean(tmp_path, capsys):
    root = write_checkout(tmp_path / "ACEBench")
    code, stdout, _ = _main(["--policy", "gold", "--domain", "acebench", "--acebench-dir", str(root),
                             "--out", str(tmp_path / "g.json")], capsys)
    assert code == 0, stdout
    assert "Multi-turn    2 items,    2 rollouts: end-to-end 1.0000  process 1.0000" in stdout
    assert "Multi-step    1 items,    1 rollouts: end-to-end 1.0000" in stdout
    assert "Overall (unweighted mean of the subsets): end-to-end 1.0000  process 1.0000" in stdout
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert figures["n"] == 3 and figures["acebench"]["failures"] == {}
    assert json.loads((tmp_path / "g.json").read_text())["summary"]["acebench"]["language"] == "en"


def test_bad_acebench_input_is_named(tmp_path, capsys):
    code, stdout, err = _main(["--policy", "gold", "--domain", "acebench", "--acebench-dir", str(tmp_path / "none")],
                              capsys)
    assert code == 2 and "env.acebench_dir (--acebench-dir)" in err and json.loads(stdout.splitlines()[-1])["error"]
    code, _, err = _main(["--policy", "gold", "--domain", "acebench"], capsys)
    assert code == 2 and "env.acebench_dir (--acebench-dir): not set" in err
    with pytest.raises(SystemExit):
        _main(["--policy", "gold", "--domain", "builtin", "--acebench-dir", str(tmp_path)], capsys)


def test_a_saved_policy_against_a_fake_user_endpoint(tmp_path, tmp_path_factory, capsys):
    """The chain model calls turn_on_wifi every turn: right on agent_multi_turn_1 (Wi-Fi on is
    its whole ground truth), half the milestones of agent_multi_turn_0, one of three of
    agent_multi_step_0. It never speaks to the user, so every episode runs to the cap; the
    state is scored anyway, as ACEBench scores it. A plain-text model then meets the user."""
    from tests.serving.test_serve import chain_model

    root = write_checkout(tmp_path / "ACEBench")
    with ScriptedOpenAIServer(lambda req: "Thanks! finish conversation") as server:
        common = ["--domain", "acebench", "--acebench-dir", str(root), "--trials", "1", "--max-new-tokens", "24",
                  "--max-context", "4096", "--user-model", "fake-user", "--user-base-url", server.url]
        code, stdout, _ = _main(["--checkpoint", chain_model(tmp_path_factory, text=WIFI_CALL), *common,
                                 "--max-turns", "3", "--out", str(tmp_path / "e.json")], capsys)
        assert code == 0, stdout
        figures = json.loads(stdout.strip().splitlines()[-1])["domains"]["acebench"]
        assert figures["terminations"] == {"max_turns": 3} and not server.chat_requests
        ace = figures["acebench"]
        assert (ace["multi_turn"]["end_to_end"], ace["multi_turn"]["process"]) == (0.5, 0.75)
        assert (ace["multi_step"]["end_to_end"], ace["multi_step"]["process"]) == (0.0, 0.333)
        assert ace["overall"]["end_to_end"] == 0.25 and ace["overall"]["process"] == pytest.approx((0.75 + 0.333) / 2)
        assert "Overall (unweighted mean of the subsets): end-to-end 0.2500" in stdout

        code, stdout, _ = _main(["--checkpoint", chain_model(tmp_path_factory, text="Done."), *common,
                                 "--out", str(tmp_path / "p.json")], capsys)
        assert code == 0, stdout
        figures = json.loads(stdout.strip().splitlines()[-1])["domains"]["acebench"]
        # multi-turn: the user ends both dialogues; multi-step: no user, reminders until ACEBench's cap (20)
        assert figures["terminations"] == {"user_stop": 2, "max_turns": 1}
        assert len(server.chat_requests) == 2 and figures["acebench"]["overall"]["end_to_end"] == 0.0
    step = json.loads((tmp_path / "p.json").read_text())["tasks"][2]["rollouts"][0]
    assert step["messages"][0]["content"].startswith("Turn on the Wi-Fi") and step["turns"] == 20
