"""Topology names -> chip grids (no jax device needed), and libtpu's devices for them."""
import glob
import os
import sys

import pytest

from muajax.config.schema import load_config
from muajax.planning import topology
from muajax.planning.topology import (
    LibtpuMissingError,
    TopologySpec,
    parse_topology,
    tpu_devices,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("text, chips, shape, generation", [
    ("v5p-64", 32, (2, 4, 4), "v5p"),      # v5p-N counts TensorCores: two per chip
    ("v5p-8", 4, (2, 2, 1), "v5p"),
    ("v5p-128", 64, (4, 4, 4), "v5p"),
    ("v4-32", 16, (2, 2, 4), "v4"),        # so does v4-N
    ("v6e-16", 16, (4, 4), "v6e"),         # v6e-N and v5e-N count chips
    ("v5e-8", 8, (2, 4), "v5e"),
    ("v5litepod-16", 16, (4, 4), "v5e"),
    ("v5p:4x4x12", 192, (4, 4, 12), "v5p"),
    ("V6E:8x16", 128, (8, 16), "v6e"),
])
def test_tpu_names(text, chips, shape, generation):
    spec = parse_topology(text)
    assert (spec.platform, spec.chips, spec.shape, spec.generation) == ("tpu", chips, shape, generation)
    assert spec.topology_name == f"{generation}:{'x'.join(map(str, shape))}"
    assert spec.chip.name == generation


def test_cpu_names():
    assert parse_topology("cpu:8") == TopologySpec("cpu:8", "cpu", 8)
    assert parse_topology("cpu:8").chip is None


def test_gpu_names_compile_on_cpu_and_judge_against_the_gpu():
    spec = parse_topology("h100:8")
    assert (spec.platform, spec.chips, spec.gpu) == ("cpu", 8, "h100")
    assert spec.chip.name == "h100" and spec.chip.usable_hbm_bytes == 80 * 10**9
    assert "estimated" in spec.describe()


def test_a_gpu_plan_is_judged_against_the_share_jax_may_take():
    hbm, note = topology.judged_hbm(parse_topology("h100:8").chip, 0.9)
    assert hbm == 72 * 10**9 and "0.9 x h100's 80 GB" in note and "run.gpu_memory_fraction" in note
    v6e = parse_topology("v6e-16").chip
    assert topology.judged_hbm(v6e, 0.9) == (v6e.usable_hbm_bytes, None)  # a TPU: the compiler's limit
    assert topology.judged_hbm(None, 0.9) == (None, None)


@pytest.mark.parametrize("text, message", [
    ("v5p-63", "counts TensorCores"),      # odd: not whole chips
    ("v5p-6", "known sizes"),              # 3 chips: no such slice
    ("v6e-12", "counts chips"),
    ("v6e:4x4x4", "2-D"),
    ("v5p:2x2", "3-D"),
    ("tpu9-8", "unknown TPU generation"),
    ("cpu:0", "N >= 1"),
    ("h100:0", "N >= 1"),
    ("eight chips", "cannot read a topology"),
])
def test_bad_names_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(text)


@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                    'pip install -e ".[tpu]" to run the TPU planning tests')
def test_libtpu_gives_the_slice_devices():
    devices = tpu_devices(parse_topology("v5p:2x2x1"))
    assert len(devices) == 4 and {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {"TPU v5"}
    assert len(tpu_devices(parse_topology("v4-8"))) == 4  # megacore: one device per chip, not per core


@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                    'pip install -e ".[tpu]" to run the TPU planning tests')
def test_one_hosts_chips_compile_as_a_slice_of_their_own():
    # a v6e host's 4 chips of a 4x4 are ids 0, 1, 4, 5: libtpu compiles for them only renumbered 0..3
    host = [d for d in tpu_devices(parse_topology("v6e-16")) if d.process_index == 0]
    assert sorted(d.id for d in host) == [0, 1, 4, 5]
    alone = topology.one_host_devices(host)
    assert sorted(d.id for d in alone) == [0, 1, 2, 3] and {d.device_kind for d in alone} == {"TPU v6 lite"}
    v5p = [d for d in tpu_devices(parse_topology("v5p-32")) if d.process_index == 0]
    assert topology.one_host_devices(v5p) is v5p  # numbered 0..3 already


def test_missing_libtpu_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` now raises ImportError
    assert not topology.libtpu_available()
    with pytest.raises(LibtpuMissingError, match=r'pip install -e "\.\[tpu\]"'):
        tpu_devices(parse_topology("v5p-8"))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "runs", "qwen3-*-tau2-*.yaml"))),
                         ids=os.path.basename)
def test_every_hardware_config_names_a_topology_its_mesh_fills_without_padding(path):
    cfg = load_config(path)
    spec = parse_topology(cfg.mesh.topology)  # what `python -m muajax.plan --config` compiles for
    assert spec.chip is not None  # judged against a chip: a TPU generation's, or the GPU's
    data, fsdp, tensor, sequence, expert = cfg.mesh.resolve(spec.chips)
    assert data * fsdp * tensor * sequence * expert == spec.chips
    assert (spec.gpu is not None) == path.endswith("-h100.yaml")
    # the shipped microbatches pad nothing: the trainer pads rows to data x fsdp x expert x microbatches
    batch = cfg.rollout.n_per_task * cfg.rollout.tasks_per_step
    for rows, size in ((batch, cfg.grpo.microbatch_size), (cfg.sft.batch_size, cfg.sft.microbatch_size)):
        microbatches = rows // size if size else 1
        assert rows % (data * fsdp * expert * microbatches) == 0, (rows, size, data * fsdp * expert)


@pytest.mark.skipif(not topology.libtpu_available(), reason='libtpu (the TPU compiler) is not installed: pip install -e ".[tpu]"')
def test_compiling_for_a_slice_leaves_no_tpu_variables_behind(monkeypatch):
    """A trainer started later from this process must not read TPU_WORKER_HOSTNAMES as a pod."""
    for key in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_SKIP_MDS_QUERY"):
        monkeypatch.delenv(key, raising=False)
    assert len(tpu_devices(parse_topology("v5p:2x2x1"))) == 4
    assert not [k for k in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE") if k in os.environ]
