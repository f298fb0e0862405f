"""The asynchronous GRPO step (grpo.max_staleness >= 1) in the step model: the rollout of the
next batch overlaps this batch's update, so a step is the longer of the two streams, less
what the engine and the update contend for on their shared devices, not their sum."""
from __future__ import annotations

import os

import pytest

from muajax.planning.calibration import step_settings
from muajax.planning.report import summary_lines
from muajax.planning.rollout_profile import Distribution
from muajax.planning.step_time import predict_step, step_seconds
from muajax.planning.sweep import SweepRow, _rank, table, write_outputs
from muajax.rl.grpo import GRPOConfig
from tests.planning.test_step_time import RATES, _plan, _profile, _rollout


@pytest.mark.parametrize("rollout, wait, sync, update, expected", [
    # the update fits in the rollout's waits: a step is the rollout
    (10.0, 6.0, 1.0, 3.0, (14.0, 10.0, 10.0)),
    # the update outgrows the waits: the devices' work, engine calls + sync + update
    (10.0, 2.0, 1.0, 5.0, (16.0, 14.0, 10.0)),
    # no waits (every reply at once): the devices run everything in turn, nothing is gained
    (10.0, 0.0, 1.0, 5.0, (16.0, 16.0, 10.0)),
    # a long update: bound by it and the sync, plus the engine's calls
    (2.0, 0.5, 0.5, 8.0, (10.5, 10.0, 8.5)),
])
def test_the_step_formulas(rollout, wait, sync, update, expected):
    got = step_seconds(rollout, wait, sync, update)
    assert (got["step_s"], got["async_step_s"], got["async_bound_s"]) == pytest.approx(expected)
    assert got["async_bound_s"] <= got["async_step_s"] <= got["step_s"]


def _predict(grpo: GRPOConfig, latency: float, copy_bytes: int = 10**9):
    plan = _plan(copy_bytes, grpo=grpo)
    profile = _profile(4.0, user_latency_s=Distribution(latency))
    return predict_step(plan, profile, RATES, step_settings(plan, _rollout()), samples=2)


def test_an_asynchronous_step_hides_the_update_in_the_rollout_s_waits_for_its_users():
    sync_cfg, async_cfg = GRPOConfig(kl_coef=0.001), GRPOConfig(kl_coef=0.001, max_staleness=1)
    slow_users = _predict(async_cfg, latency=2.0)
    rollout, sync_s, update_s = (slow_users[k] for k in ("rollout_s", "sync_s", "update_s"))
    wait = slow_users["rollout"]["wait_s"]
    assert wait > 0 and slow_users["max_staleness"] == 1
    assert slow_users["step_s"] == pytest.approx(rollout + sync_s + update_s)
    assert slow_users["async_step_s"] < slow_users["step_s"]
    assert slow_users["async_step_s"] >= max(rollout, sync_s + update_s, rollout - wait + sync_s + update_s) - 1e-9
    assert slow_users["async_bound_s"] == pytest.approx(max(rollout, sync_s + update_s), rel=0.05)
    # the config runs the asynchronous step: its throughput is over it
    assert slow_users["run_step_s"] == slow_users["async_step_s"]
    assert slow_users["tokens_per_s_per_chip"] == pytest.approx(
        slow_users["rollout"]["sampled_tokens"] / slow_users["async_step_s"])
    # the same plan synchronous: the same phases, the sum run
    same = _predict(sync_cfg, latency=2.0)
    assert (same["rollout_s"], same["update_s"], same["async_step_s"]) == (rollout, update_s,
                                                                           slow_users["async_step_s"])
    assert same["max_staleness"] == 0 and same["run_step_s"] == same["step_s"] > same["async_step_s"]
    assert same["tokens_per_s_per_chip"] < slow_users["tokens_per_s_per_chip"]


def test_without_waits_the_shared_devices_gain_nothing_but_the_bound_does():
    p = _predict(GRPOConfig(kl_coef=0.001, max_staleness=2), latency=0.0)
    assert p["rollout"]["wait_s"] == 0.0
    assert p["async_step_s"] == pytest.approx(p["step_s"])
    assert p["async_bound_s"] == pytest.approx(max(p["rollout_s"], p["sync_s"] + p["update_s"]))
    assert p["async_bound_s"] < p["step_s"]


def test_the_report_shows_both_steps_and_marks_the_config_s():
    async_lines = "\n".join(summary_lines(_predict(GRPOConfig(kl_coef=0.001, max_staleness=1), 2.0)))
    sync_lines = "\n".join(summary_lines(_predict(GRPOConfig(kl_coef=0.001), 2.0)))
    for text in (async_lines, sync_lines):
        assert "(synchronous)" in text and "async step" in text and "max(rollout, sync + update)" in text
    assert "on shared devices" in async_lines.splitlines()[1] and async_lines.splitlines()[1].endswith(
        "<- grpo.max_staleness 1")
    assert sync_lines.splitlines()[0].endswith("<- grpo.max_staleness 0")


def test_a_sweep_ranks_by_the_step_the_config_runs_and_shows_the_async_one(tmp_path):
    def row(name, step_s, async_s, run_s):
        return SweepRow({"data": name, "fsdp": 1, "tensor": 1, "sequence": 1}, "full", 1, "fits", 1 << 30,
                        roofline={"serial_s": 1.0, "estimate_s": 1.0}, step={
                            "rollout_s": 1.0, "sync_s": 0.0, "update_s": 1.0, "step_s": step_s,
                            "async_step_s": async_s, "run_step_s": run_s, "max_staleness": int(run_s == async_s)})

    ranked = _rank([row(1, 90.0, 50.0, 50.0), row(2, 80.0, 70.0, 70.0)])
    assert [r.mesh["data"] for r in ranked] == [1, 2]  # by the async step, not the synchronous one
    text = table(ranked, None)
    assert "async" in text.splitlines()[0] and "ranked by async" in text
    assert ranked[0].flat()["async_step_s"] == 50.0
    out = write_outputs(ranked, str(tmp_path), "tiny", "cpu:1", None)  # the chart marks the async step
    assert os.path.getsize(out["png"]) > 0 and "async_step_s" in open(out["csv"]).readline()
