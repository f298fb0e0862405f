"""Rollout profiles: their file format, their producers (a run's metrics.jsonl, τ2's data)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from muajax.planning.rollout_profile import Distribution, ProfileError, RolloutProfile, main


def _profile(**overrides) -> RolloutProfile:
    values = dict(name="hand", system_tokens=800, first_user_tokens=Distribution(20.0),
                  agent_turns=Distribution.of([4, 6, 8, 10]), tool_turns=Distribution(3.0),
                  agent_turn_tokens=Distribution.of([10, 30, 50]), user_turn_tokens=Distribution(12.0),
                  tool_result_tokens=Distribution.of([40, 60, 200]), user_latency_s=Distribution(0.5),
                  sequence_tokens=Distribution.of([900, 1100, 1500]), turn_overhead_tokens=9,
                  tool_calls_per_turn=1.0, conversations=4, sources={"agent_turns": "hand-written"})
    return RolloutProfile(**{**values, **overrides})


def test_a_profile_survives_a_save_and_a_load(tmp_path):
    profile = _profile()
    path = tmp_path / "p.json"
    profile.save(str(path))
    loaded = RolloutProfile.load(str(path))
    assert loaded.to_json() == profile.to_json()
    assert loaded.agent_turns.percentiles[100.0] == 10 and loaded.sources == {"agent_turns": "hand-written"}
    assert loaded.tool_share == pytest.approx(3.0 / 7.0)


@pytest.mark.parametrize("text, words", [
    ("{not json", "not a JSON rollout profile"),
    (json.dumps({"version": 1, "name": "x"}), "missing system_tokens"),
    (json.dumps({"version": 99}), "version 99"),
])
def test_a_bad_file_names_itself_and_what_is_wrong(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=words) as info:
        RolloutProfile.load(str(path))
    assert str(path) in str(info.value)


def test_a_bad_distribution_is_refused(tmp_path):
    data = _profile().to_json()
    data["agent_turns"] = {"mean": 5, "percentiles": {"0": 9, "100": 3}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="agent_turns.percentiles must not decrease"):
        RolloutProfile.load(str(path))
    with pytest.raises(ProfileError, match="no such rollout profile"):
        RolloutProfile.load(str(tmp_path / "missing.json"))


def test_distributions_draw_their_quantiles_and_a_uniform_spread_has_the_asked_largest_draw():
    d = Distribution.of([1, 2, 3, 4, 5])
    assert d.mean == 3 and d.quantile(0.5) == 3 and d.quantile(1.0) == 5
    assert Distribution(7.0).quantile(0.9) == 7.0  # only a mean: every draw is the mean
    u = Distribution.uniform(10.0, 18.0, draws=32)
    rng = np.random.default_rng(0)
    largest = np.mean([u.draw(rng, 32).max() for _ in range(2000)])
    assert largest == pytest.approx(18.0, rel=0.02)
    assert np.mean(u.draw(rng, 20000)) == pytest.approx(10.0, rel=0.02)


def _run_dir(tmp_path, records):
    (tmp_path / "config.yaml").write_text("env: {domain: builtin, builtin_terse_tools: true}\nuser: {kind: scripted}\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(tmp_path)


def test_from_run_reads_the_means_the_longest_rows_and_the_domain_prompt(tmp_path):
    from muajax.planning.run_profile import prompt_tokens

    records = [{"step": s, "assistant_turns": a, "turns": a - 0.5, "response_tokens": 25.0 * a,
                "sequence_tokens": seq, "num_seqs": 32, "user_latency_s": 0.25, "calls/find_user": 1.0,
                "calls/get_order": 2.0, "longest/assistant_turns": a + 6, "longest/sequence_tokens": 1536,
                "time/rollout_s": 9.0, "time/update_s": 3.0}
               for s, a, seq in ((1, 6.0, 1200.0), (2, 8.0, 1400.0))]
    run = _run_dir(tmp_path, records)
    profile = RolloutProfile.from_run(run)
    system, firsts, overhead = prompt_tokens(str(tmp_path / "config.yaml"))
    assert profile.system_tokens == system and profile.turn_overhead_tokens == overhead
    assert profile.first_user_tokens.mean == pytest.approx(np.mean(firsts))
    assert profile.agent_turns.mean == 7.0 and profile.tool_turns.mean == 3.0
    assert profile.agent_turn_tokens.mean == pytest.approx(25.0)
    # the context beyond the prompt, the samples and the turn template, over the 6 replies
    context = 1300.0 - 175.0 - system - np.mean(firsts) - 7 * overhead
    assert profile.tool_result_tokens.mean == pytest.approx(context / 6.0)
    assert profile.user_latency_s.mean == 0.25 and profile.conversations == 64
    # the longest conversation of 32 (the median step's: 13.0 of 12 and 14) is the uniform spread's expected largest
    top = profile.agent_turns.percentiles[100.0]
    assert top - (top - profile.agent_turns.percentiles[0.0]) / 33 == pytest.approx(13.0)
    assert "metrics.jsonl" in profile.sources["agent_turns"]
    assert RolloutProfile.load(run).to_json() == profile.to_json()  # a run directory loads as its profile


def test_from_run_takes_the_spread_and_the_tool_user_split_from_the_run_s_conversations(tmp_path):
    records = [{"step": 1, "assistant_turns": 5.0, "turns": 4.0, "response_tokens": 100.0, "sequence_tokens": 1400.0,
                "num_seqs": 8, "calls/find_user": 2.0}]
    run = _run_dir(tmp_path, records)
    call = {"id": "c", "type": "function", "function": {"name": "find_user", "arguments": '{"name": "A B"}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Your name?"},
                {"role": "user", "content": "A B, zip 12345, and please hurry up"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": '{"user_id": "u01", "orders": ["#o1", "#o2"]}'},
                {"role": "assistant", "content": "Done."}]
    plain = RolloutProfile.from_run(run)  # no conversations: one mean for every reply
    (tmp_path / "sft.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    profile = RolloutProfile.from_run(run)
    share = profile.tool_share  # 2 tool turns of 5
    mixed = share * profile.tool_result_tokens.mean + (1 - share) * profile.user_turn_tokens.mean
    assert mixed == pytest.approx(plain.tool_result_tokens.mean)  # the run's mean, split as its conversations
    assert profile.tool_result_tokens.mean > profile.user_turn_tokens.mean  # the tool result is the longer
    assert profile.agent_turn_tokens.mean == pytest.approx(20.0) and plain.agent_turn_tokens.percentiles == {}
    assert profile.agent_turn_tokens.percentiles[0.0] < profile.agent_turn_tokens.percentiles[100.0]
    assert "sft.jsonl" in profile.sources["tool_result_tokens"]


def test_from_run_without_grpo_records_says_so(tmp_path):
    run = _run_dir(tmp_path, [{"step": 1, "loss": 0.5}])
    with pytest.raises(ProfileError, match="no GRPO step records"):
        RolloutProfile.from_run(run)


def test_the_tau2_command_measures_airline_from_its_gold_actions(tmp_path):
    from muajax.domains.tau2.environment import Tau2Environment

    out = tmp_path / "airline.json"
    assert main(["--tau2", "airline", "--turns", "20", "--out", str(out)]) == 0
    profile = RolloutProfile.load(str(out))
    tasks = Tau2Environment("airline").tasks("train")
    agent_calls = [sum(1 for who in t.metadata["gold_action_requestors"] if who != "user") for t in tasks]
    assert profile.conversations == len(tasks) == 30
    assert profile.tool_turns.mean == pytest.approx(np.mean(agent_calls))
    assert profile.agent_turns.mean == pytest.approx(np.mean(agent_calls) + round(20 - np.mean(agent_calls)))
    assert profile.system_tokens > 3000  # the policy and the tools' schemas
    assert profile.tool_result_tokens.percentiles[0.0] > 5  # real tool outputs, not empty ones
    assert "--turns 20" in profile.sources["agent_turns"] and "gold" in profile.sources["tool_turns"]
