"""Sweep meshes x remat policies on a v5p:2x2x1 slice with a tiny model."""
import csv
import json
import os

import pytest

from muajax import parallel
from muajax.chips import get_chip
from muajax.planning.planner import PlanSettings
from muajax.planning.sweep import lower_bound, mesh_candidates, run_sweep
from muajax.planning.topology import libtpu_available, parse_topology, tpu_devices
from muajax.rl.grpo import GRPOConfig
from tests.support.tiny_models import TINY_CONFIG

NEEDS_LIBTPU = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                  'pip install -e ".[tpu]" to run the TPU planning tests')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = TINY_CONFIG.replace(max_position_embeddings=512, dtype="bfloat16", remat="full")


def test_mesh_candidates_cover_every_factorization():
    axes = ("data", "fsdp", "tensor")
    meshes = mesh_candidates(4, axes)
    assert len(meshes) == 6 and all(list(m) == list(axes) for m in meshes)
    assert {tuple(m.values()) for m in meshes} == {(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)}
    assert len(mesh_candidates(32, axes)) == 21
    # the default: every axis of parallel.MESH_AXES (2^k over 5 axes: C(k + 4, 4) ways)
    assert len(parallel.MESH_AXES) == 5 and all(list(m) == list(parallel.MESH_AXES) for m in mesh_candidates(4))
    assert len(mesh_candidates(4)) == 15 and len(mesh_candidates(32)) == 126
    assert mesh_candidates(6, ("a", "b")) == [{"a": 1, "b": 6}, {"a": 2, "b": 3}, {"a": 3, "b": 2}, {"a": 6, "b": 1}]


def test_the_expert_axis_is_swept_for_a_mixture_of_experts_at_sizes_dividing_its_experts():
    dense = mesh_candidates(8, cfg=TINY)
    assert dense and all(m["expert"] == 1 for m in dense)  # on a dense model it is only fsdp renamed
    assert len(dense) == len(mesh_candidates(8, ("data", "fsdp", "tensor", "sequence")))
    moe = mesh_candidates(8, cfg=TINY.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    assert {m["expert"] for m in moe} == {1, 2, 4}  # 8 does not divide 4 experts
    assert len(moe) == len([m for m in mesh_candidates(8) if m["expert"] <= 4])


@pytest.fixture(scope="module")
def devices():
    return tpu_devices(parse_topology("v5p:2x2x1"))


@NEEDS_LIBTPU
def test_lower_bound_terms(devices):
    settings = PlanSettings(batch=8, seq=64, grpo=GRPOConfig(microbatch_size=4, length_buckets=(64,)))
    # the einsum attention ("xla") holds a layer's [T, T] scores; splash and chunked do not
    bound = lower_bound(TINY.replace(attention="xla"), {"data": 1, "fsdp": 4, "tensor": 1}, devices, settings)
    params = TINY.num_params() * 4
    assert bound["params"] + bound["reference"] + bound["optimizer state"] >= 4 * params / 4
    # a microbatch of 4 rows over fsdp=4 is 1 row per device; its scores: 4 heads x 64 x 64 float32,
    # more than its logits (64 x 256 bfloat16)
    assert bound["attention scores"] == 4 * 64 * 64 * 4 > 64 * 256 * 2
    assert "LM-head logits" not in bound  # only the larger of the two counts
    assert bound["saved layer inputs"] == 2 * 64 * 64 * 2  # 2 layers' [1 row, 64, 64] bfloat16 inputs
    assert "attention scores" not in lower_bound(TINY, {"data": 1, "fsdp": 4, "tensor": 1}, devices, settings)
    none = lower_bound(TINY.replace(remat="none", attention="xla"), {"data": 1, "fsdp": 4, "tensor": 1}, devices, settings)
    assert none["attention scores"] == 2 * bound["attention scores"]  # saved for each of the 2 layers


@NEEDS_LIBTPU
def test_lower_bound_of_a_mixture_of_experts_holds_a_layer_s_expert_token_copies(devices):
    settings = PlanSettings(batch=8, seq=64, grpo=GRPOConfig(microbatch_size=4, length_buckets=(64,)))
    moe = TINY.replace(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=32)
    bound = lower_bound(moe, {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 1, "expert": 2}, devices, settings)
    # 1 row of 64 tokens a device, each copied to its 8 experts: [512, 64] bfloat16, more than the
    # logits ([64, 256] bfloat16), which it replaces as the transient held at once
    assert bound["expert token copies"] == 64 * 8 * 64 * 2 > 64 * 256 * 2
    assert "LM-head logits" not in bound
    assert "expert token copies" not in lower_bound(TINY, {"data": 1, "fsdp": 4, "tensor": 1}, devices, settings)


@NEEDS_LIBTPU
def test_sweep_ranks_prunes_and_writes(devices, tmp_path):
    # 9M float32 params: weights, two moments and the reference are 142 MB per replica, more than
    # the 110 MB per device given, so data=4 (a whole replica per device) is pruned before
    # compiling; the fully sharded meshes (a quarter each, ~85 MB with the step's temporaries) fit.
    wide = TINY.replace(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4,
                        head_dim=64)
    meshes = [{"data": 4, "fsdp": 1, "tensor": 1}, {"data": 1, "fsdp": 4, "tensor": 1},
              {"data": 1, "fsdp": 2, "tensor": 2}]
    settings = PlanSettings(batch=8, seq=64, grpo=GRPOConfig(length_buckets=(64,)))
    out = run_sweep(wide, "wide", devices=devices, settings=settings, remats=("full",),
                    topology="v5p:2x2x1", chip=get_chip("v5p"), hbm_bytes=110 * 10**6, out_dir=str(tmp_path),
                    meshes=meshes)
    rows, summary = out["rows"], out["summary"]
    assert summary["configs"] == 3 and summary["compiler"] == "tpu" and summary["pruned"] == 1
    status = {(r["data"], r["fsdp"], r["tensor"]): r["status"] for r in rows}
    assert status == {(4, 1, 1): "pruned", (1, 4, 1): "fits", (1, 2, 2): "fits"}
    assert rows[-1]["note"].startswith("lower bound: params") and rows[-1]["lower_bound"] is True
    assert rows[0]["lower_bound"] is False  # compiled to the end: exact
    estimates = [r["estimate_s"] for r in rows[:2]]
    assert estimates == sorted(estimates) and estimates[0] > 0  # fitting ones first, by estimated step time
    assert summary["best"] == rows[0]
    assert all(r["microbatches"] == 8 // (r["data"] * r["fsdp"]) for r in rows)  # one row per batch device
    with open(os.path.join(tmp_path, "sweep.csv")) as f:
        assert len(list(csv.DictReader(f))) == 3
    with open(os.path.join(tmp_path, "sweep.json")) as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(rows))
    assert os.path.getsize(os.path.join(tmp_path, "sweep.png")) > 10_000


@NEEDS_LIBTPU
def test_a_stopped_sweep_resumes_where_it_was(devices, tmp_path, monkeypatch):
    from muajax.planning import sweep

    meshes = [{"data": 1, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 2, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 1}]
    real, calls = sweep._evaluate, []

    def dies_after_two(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the sweep is stopped during its third configuration
        calls.append(args[2])
        return real(*args)

    run = lambda: run_sweep(TINY, "tiny", devices=devices, settings=PlanSettings(batch=8, seq=64),
                            remats=("full",), topology="v5p:2x2x1", chip=get_chip("v5p"), hbm_bytes=None,
                            out_dir=str(tmp_path), meshes=meshes)
    monkeypatch.setattr(sweep, "_evaluate", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        run()
    journal = tmp_path / "sweep.partial.jsonl"
    assert len(journal.read_text().splitlines()) == 3  # its header and the two finished rows
    with open(journal, "a") as f:
        f.write('{"mesh": {"data": 2')  # a line cut short by kill -9
    resumed = []
    monkeypatch.setattr(sweep, "_evaluate", lambda *args: resumed.append(args[2]) or real(*args))
    out = run()
    assert resumed == [meshes[2]] and out["summary"]["configs"] == 3
    assert not journal.exists() and (tmp_path / "sweep.json").exists()
    fresh = tmp_path / "fresh"
    again = run_sweep(TINY, "tiny", devices=devices, settings=PlanSettings(batch=8, seq=64),
                      remats=("full",), topology="v5p:2x2x1", chip=get_chip("v5p"), hbm_bytes=None,
                      out_dir=str(fresh), meshes=meshes)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "compile_s"} for r in rows]
    assert strip(again["rows"]) == strip(out["rows"])


@NEEDS_LIBTPU
def test_other_remats_are_tried_on_the_fastest_meshes_only(devices, tmp_path, monkeypatch):
    from muajax.planning import sweep

    meshes = [{"data": 1, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 2, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 1}]
    real, calls = sweep._evaluate, []
    monkeypatch.setattr(sweep, "_evaluate", lambda *args: calls.append((args[2], args[0].remat)) or real(*args))
    run = lambda refine, out: run_sweep(TINY, "tiny", devices=devices, settings=PlanSettings(batch=8, seq=64),
                                        remats=("full", "dots"), topology="v5p:2x2x1", chip=get_chip("v5p"),
                                        hbm_bytes=None, out_dir=str(tmp_path / out), meshes=meshes, refine=refine)
    out = run(1, "one")
    assert calls[:3] == [(m, "full") for m in meshes] and len(calls) == 4
    full = [r for r in out["rows"] if r["remat"] == "full"]
    fastest = {a: full[0][a] for a in meshes[0]}
    assert calls[3] == (fastest, "dots")  # the mesh that ranked first with the first policy
    assert out["summary"]["configs"] == 4 and out["summary"]["refined_meshes"] == 1
    calls.clear()
    assert run(None, "all")["summary"]["configs"] == 6 and sorted(r for _, r in calls) == ["dots"] * 3 + ["full"] * 3


@NEEDS_LIBTPU
def test_with_a_rollout_profile_meshes_rank_by_the_whole_step(devices, tmp_path):
    from muajax.planning.rollout_profile import RolloutProfile

    profile = RolloutProfile.load(os.path.join(ROOT, "configs", "profiles", "tau2-retail.json"))
    meshes = [{"data": 1, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 2, "tensor": 2}]
    settings = PlanSettings(batch=8, seq=512, grpo=GRPOConfig(length_buckets=(512,)))
    out = run_sweep(TINY, "tiny", devices=devices, settings=settings, remats=("full",), topology="v5p:2x2x1",
                    chip=get_chip("v5p"), hbm_bytes=get_chip("v5p").usable_hbm_bytes, out_dir=str(tmp_path),
                    meshes=meshes, profile=profile)
    rows = out["rows"]
    assert [r["status"] for r in rows] == ["fits", "fits"]
    for r in rows:  # rollout (compiled once, on the engine's mesh) + sync + update, the update's own per mesh
        assert r["step_s"] == pytest.approx(r["rollout_s"] + r["sync_s"] + r["update_s"])
        assert r["rollout_s"] > 0 and r["update_s"] > 0
    assert rows[0]["rollout_s"] == rows[1]["rollout_s"]  # the engine's programs do not depend on the train mesh
    assert rows[0]["step_s"] <= rows[1]["step_s"]  # ranked by the whole step
    assert out["summary"]["best"]["step_s"] == rows[0]["step_s"]
    assert os.path.getsize(os.path.join(tmp_path, "sweep.png")) > 10_000


def test_meshes_whose_times_agree_to_three_figures_rank_by_serial_time_then_memory():
    from muajax.planning.sweep import SweepRow, _rank

    def row(name, step_s, serial_s, gib):
        return SweepRow({"data": name, "fsdp": 1, "tensor": 1, "sequence": 1}, "full", 1, "fits", gib << 30,
                        roofline={"serial_s": serial_s}, step={"step_s": step_s})

    ranked = _rank([row(1, 90.5512, 150.0, 56), row(2, 90.5511, 107.0, 60), row(3, 80.0, 200.0, 90),
                    row(4, 95.0, 100.0, 10), row(5, 90.5513, 150.2, 45)])
    assert [r.mesh["data"] for r in ranked] == [3, 2, 5, 1, 4]
