"""A tiny Qwen3's GRPO step, SFT step and paged-engine programs compiled by the TPU compiler
(libtpu, no TPU needed) for a v5p:2x2x1 slice (4 chips) on meshes (4,1,1), (1,4,1) and
(1,2,2): the phases' parts, their totals, and what must be resident."""
import dataclasses
import json

import pytest

from muajax.settings.fields import ConfigError

from muajax import parallel
from muajax.config.schema import SFTConfig
from muajax.chips import get_chip
from muajax.planning.topology import libtpu_available

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                'pip install -e ".[tpu]" to run the TPU planning tests')

from muajax.planning.planner import PlanSettings, plan_run  # noqa: E402
from muajax.planning.programs import EngineSettings, padded_batch  # noqa: E402
from muajax.planning.topology import parse_topology, tpu_devices  # noqa: E402
from muajax.rl.grpo import GRPOConfig  # noqa: E402
from tests.support.tiny_models import TINY_CONFIG  # noqa: E402

# head_dim 128: the engine takes the Pallas paged-attention path on TPU, as at scale; every
# sharded dim divides by 4 (fsdp=4) and the 2 kv heads by tensor=2.
TINY = TINY_CONFIG.replace(head_dim=128, max_position_embeddings=512, dtype="bfloat16", remat="full")
MESHES = {"data4": {"data": 4, "fsdp": 1, "tensor": 1}, "fsdp4": {"data": 1, "fsdp": 4, "tensor": 1},
          "fsdp2_tensor2": {"data": 1, "fsdp": 2, "tensor": 2}}
SETTINGS = PlanSettings(batch=8, seq=128, grpo=GRPOConfig(microbatch_size=4),
                        engine=EngineSettings(num_slots=8, max_len=128, widths=(32,)))


@pytest.fixture(scope="module")
def devices():
    return tpu_devices(parse_topology("v5p:2x2x1"))


@pytest.fixture(scope="module")
def plans(devices):
    chip = get_chip("v5p")
    return {name: plan_run(TINY, devices=devices, mesh=mesh, settings=SETTINGS, label="tiny", topology="v5p:2x2x1",
                           chip=chip, hbm_bytes=chip.usable_hbm_bytes)
            for name, mesh in MESHES.items()}


def phase_of(plan, name):
    return next(p for p in plan.phases if p.name == name)


@pytest.mark.parametrize("name", list(MESHES))
def test_compiled_by_the_tpu_compiler(plans, name):
    plan = plans[name]
    assert plan.compiler == "tpu" and plan.devices == 4 and plan.mesh == MESHES[name]
    assert [p.name for p in plan.programs] == ["engine decode", "engine extend_128x64", "grpo step"]
    assert all(p.error is None and p.compile_s > 0 and p.compiler == "tpu" for p in plan.programs)
    assert [p.name for p in plan.phases] == ["sync", "rollout", "update"]  # the engine decodes from a bf16 copy
    assert plan.fits is True
    rollout = {p.name: p.bytes for p in phase_of(plan, "rollout").parts}
    assert any(name.startswith("engine: KV pool") and "pallas" in name for name in rollout)  # the TPU path
    programs = plan.to_json()["programs"]  # the attention each program runs
    assert {name: p["attention"] for name, p in programs.items()} == {
        "engine decode": "pallas", "engine extend_128x64": "pallas", "grpo step": "splash"}


@pytest.mark.parametrize("name", list(MESHES))
def test_parts_add_up(plans, name):
    plan = plans[name]
    for phase in plan.phases:
        assert phase.total == sum(part.bytes for part in phase.parts) > 0
    assert plan.per_device_bytes == max(phase.total for phase in plan.phases)
    for program in plan.programs:  # resident arguments + transients: at least the compiler's whole footprint
        counted = sum(program.resident_args.values()) + sum(program.transient.values())
        assert counted >= program.memory["total"] and program.memory["temporaries"] > 0
        if program.memory["arguments"] >= sum(program.resident_args.values()) + program.input_bytes:
            assert counted == program.memory["total"]  # the compiler read every argument: exactly its figure
    # the GRPO step reads every argument: its figure is the compiler's own
    step = next(p for p in plan.programs if p.name == "grpo step")
    assert sum(step.resident_args.values()) + sum(step.transient.values()) == step.memory["total"]
    summary = json.loads(json.dumps(plan.to_json()))
    for phase in summary["phases"]:
        assert phase["total"] == sum(part["bytes"] for part in phase["parts"])


@pytest.mark.parametrize("name", list(MESHES))
def test_resident_state_is_at_least_its_share(plans, name):
    plan = plans[name]
    params = TINY.num_params() * 4  # float32 master weights
    # params + Adam's two moments + the float32 reference, spread over at most all 4 devices
    floor = (params + 2 * params + params) / 4
    for phase in plan.phases:
        resident = sum(p.bytes for p in phase.parts if p.name.startswith(("train state", "reference")))
        assert resident >= floor
    update = {p.name: p.bytes for p in phase_of(plan, "update").parts}
    if name == "data4":  # pure data parallelism replicates the weights
        assert update["train state: params"] == params
    assert update["reference model"] == update["train state: params"]  # the trainer's copy, in the params' dtype
    # the engine's copy and its pool are let go before the update (rollout.keep_kv_pool: false)
    assert not [part for part in update if part.startswith("engine:")]
    rollout = {p.name: p.bytes for p in phase_of(plan, "rollout").parts}
    # the sync casts the float32 params to bfloat16 in the train layout before laying them out as the copy
    sync = {p.name: p.bytes for p in phase_of(plan, "sync").parts}
    assert sync["engine: params"] == rollout["engine: params"]
    assert sync["sync: the params cast, in the train layout"] == pytest.approx(update["train state: params"] / 2, rel=0.01)
    # RolloutEngine's own copy: bfloat16 (the compute dtype) on the host's default engine mesh,
    # tensor parallel over the 2 kv heads, data parallel over the rest: half of each weight
    # matrix per device, at half the width (norms replicated)
    copy = rollout["engine: params"]
    assert TINY.num_params() * 2 / 2 <= copy < TINY.num_params() * 2
    pool = next(name for name in rollout if name.startswith("engine: KV pool"))
    assert "mesh 2x1x2x1" in pool and rollout[pool] > 0


def test_a_pool_kept_through_the_update_is_counted_there(devices):
    chip = get_chip("v5p")
    settings = dataclasses.replace(SETTINGS, keep_kv_during_update=True, phases=("update",))
    plan = plan_run(TINY, devices=devices, mesh=MESHES["fsdp4"], settings=settings, label="tiny",
                    topology="v5p:2x2x1", chip=chip, hbm_bytes=chip.usable_hbm_bytes)
    update = {p.name: p.bytes for p in plan.phases[0].parts}
    pools = [size for part, size in update.items() if part.startswith("engine: KV pool")]
    assert len(pools) == 1 and pools[0] > 0 and "engine: params" not in update


def test_microbatches_pad_like_the_trainer(plans, devices):
    # 8 rows in 2 microbatches of 4: 4 batch devices take 1 row each, nothing to pad
    grpo = plans["data4"].rows["grpo"]
    assert {k: grpo[k] for k in ("batch", "microbatches", "padded")} == {"batch": 8, "microbatches": 2, "padded": 8}
    assert grpo["attention"] == "splash" and grpo["shared_prefix"] == 0
    # tensor=2 leaves 2 batch devices: still 8
    assert plans["fsdp2_tensor2"].rows["grpo"]["padded"] == 8
    mesh = parallel.make_mesh(4, 1, 1, devices=devices)
    assert padded_batch(6, 2, mesh) == 8
    assert padded_batch(256, 32, mesh) == 256   # microbatches of 8 rows: 2 per device
    assert padded_batch(256, 128, mesh) == 512  # microbatches of 2 rows on 4 devices: padded to 4


def test_costs_and_roofline(plans):
    plan = plans["fsdp4"]
    step = next(p for p in plan.programs if p.name == "grpo step")
    assert step.flops > step.xla_flops > 0     # loops counted: 2 microbatches x 2 layers
    assert step.collectives["all-gather"] > 0  # fsdp gathers the weights
    line = plan.rooflines()["grpo step"]
    assert line["estimate_s"] == max(line["compute_s"], line["memory_s"], line["collective_s"]) > 0
    summary = plan.to_json()
    assert summary["per_device_bytes"] == plan.per_device_bytes and summary["compiler"] == "tpu"
    assert set(summary["programs"]["grpo step"]["collective_bytes"]) == {
        "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}


def test_does_not_fit_a_tiny_hbm(plans):
    small = dataclasses.replace(plans["fsdp4"], hbm_bytes=64 * 1024)
    assert small.fits is False and small.per_device_bytes > 64 * 1024
    assert small.to_json()["fits"] is False


def test_sft_phase_holds_no_reference_nor_pool(devices):
    settings = dataclasses.replace(SETTINGS, phases=("sft",), sft=SFTConfig(batch_size=8, microbatch_size=4),
                                   sft_seq=128)
    chip = get_chip("v5p")
    plan = plan_run(TINY, devices=devices, mesh=MESHES["fsdp4"], settings=settings, label="tiny",
                    topology="v5p:2x2x1", chip=chip, hbm_bytes=chip.usable_hbm_bytes)
    assert [p.name for p in plan.programs] == ["sft step"] and [p.name for p in plan.phases] == ["sft"]
    parts = [p.name for p in plan.phases[0].parts]
    assert "reference model" not in parts and not any(p.startswith("engine") for p in parts)
    sft = plan.rows["sft"]
    assert {k: sft[k] for k in ("batch", "microbatches", "padded")} == {"batch": 8, "microbatches": 2, "padded": 8}
    assert sft["packed"] and sft["shared_prefix"] == 0  # sft.packing auto: rows may be packed, with segment ids
    assert plan.fits is True and plan.programs[0].compiler == "tpu"
    # microbatches smaller than the batch devices: refused, as the trainer refuses them
    uneven = dataclasses.replace(settings, sft=SFTConfig(batch_size=8, microbatch_size=2))
    with pytest.raises(ConfigError, match="sft.microbatch_size"):
        plan_run(TINY, devices=devices, mesh=MESHES["fsdp4"], settings=uneven, label="tiny", topology="v5p:2x2x1")
