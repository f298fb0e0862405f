"""`python -m muajax.plan`: a tiny model planned for a v5p slice with the TPU compiler, by
flags and by run config; its table and JSON, the exit statuses (1: does not fit, 2: no
libtpu), and fake CPU meshes."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from muajax.plan import parse_bytes, parse_mesh
from muajax.planning.topology import libtpu_available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = json.dumps({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                   "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 512})
SMALL = ["--model", TINY, "--batch", "8", "--seq", "64", "--microbatch", "4"]
# A run config as the trainer reads it: head_dim 128 (the engine's Pallas path on TPU), SFT then GRPO.
CONFIG = """\
run: {name: tiny-plan, stages: [sft, grpo]}
model:
  arch: {vocab_size: 256, hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 4, num_kv_heads: 2,
         head_dim: 128, max_position_embeddings: 512}
  param_dtype: float32
  dtype: bfloat16
  remat: full
mesh: {data: 1, fsdp: 2, tensor: 2, topology: "v5p:2x2x1"}
rollout: {n_per_task: 2, tasks_per_step: 4, max_context: 256, max_new_tokens_per_turn: 64}
grpo: {microbatch_size: 4}
sft: {batch_size: 8, microbatch_size: 4, max_len: 256}
"""
# 39B float32 params on 4 chips: the weights, Adam's moments and the reference alone are 145 GiB a chip.
TOO_BIG = ["model.arch.hidden_size=8192", "model.arch.intermediate_size=65536", "model.arch.num_layers=24"]
needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                  'pip install -e ".[tpu]" to run the TPU planning tests')


def run_plan(args, *, code=None, expect=0, fast_cpu=False):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    if fast_cpu:  # XLA:CPU compiles twice as fast at LLVM -O0; plan adds the device count
        env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "muajax.plan", *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), proc


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    return str(path)


@needs_libtpu
def test_plan_on_a_v5p_slice():
    out, proc = run_plan([*SMALL, "--topology", "v5p-8", "--mesh", "fsdp=2,tensor=2"])
    assert out["compiler"] == "tpu" and out["devices"] == 4 and out["chip"] == "v5p" and out["fits"] is True
    assert out["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 1}
    assert [p["name"] for p in out["phases"]] == ["sync", "rollout", "update"]  # the engine's bf16 copy is synced
    for phase in out["phases"]:
        assert phase["total"] == sum(part["bytes"] for part in phase["parts"])
    assert out["per_device_bytes"] == max(p["total"] for p in out["phases"])
    step = out["programs"]["grpo step"]
    assert step["flops"] > 0 and step["roofline"]["estimate_s"] > 0 and step["collective_bytes"]["all-gather"] > 0
    # the engine's packed extend (the trainer's default layout): rows of 16 tokens, as many as a call holds
    assert set(out["programs"]) == {"engine decode", "engine extend_128x64", "grpo step"}
    assert "phase update" in proc.stdout and "fits: true" in proc.stdout


@needs_libtpu
def test_flag_defaults_take_the_least_memory_a_step_can():
    # no --microbatch: one row per batch device (fsdp=2: 2 rows) per microbatch; the LM head in chunks
    out, _ = run_plan(["--model", TINY, "--batch", "8", "--seq", "64", "--topology", "v5p-8", "--mesh",
                       "fsdp=2,tensor=2", "--phases", "update"])
    grpo = out["rows"]["grpo"]
    assert {k: grpo[k] for k in ("batch", "microbatches", "padded")} == {"batch": 8, "microbatches": 4, "padded": 8}
    assert grpo["length"] == 512  # a 64-token context is padded to the shortest GRPO bucket, as the trainer pads it
    assert out["settings"]["microbatch_size"] == 2 and out["settings"]["logits_chunk"] == 2048


@needs_libtpu
def test_plan_a_run_config_as_the_trainer_runs_it(config):
    out, proc = run_plan(["--config", config])
    assert out["compiler"] == "tpu" and out["devices"] == 4 and out["topology"] == "v5p:2x2x1" and out["fits"] is True
    assert out["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 1} and out["remat"] == "full"
    assert [p["name"] for p in out["phases"]] == ["sync", "rollout", "update", "sft"]  # the config's stages
    # 2 x 4 rollouts in microbatches of 4; SFT's 8 rows likewise; the engine: every rollout, max_context
    shape = {kind: {k: rows[k] for k in ("batch", "microbatches", "padded")} for kind, rows in out["rows"].items()}
    assert shape == {"grpo": {"batch": 8, "microbatches": 2, "padded": 8},
                     "sft": {"batch": 8, "microbatches": 2, "padded": 8}}
    assert out["settings"]["seq"] == 256
    assert out["settings"]["engine"]["num_slots"] == 8 and out["settings"]["engine"]["max_len"] == 256
    _, rollout, update, sft = ({part["name"]: part["bytes"] for part in p["parts"]} for p in out["phases"])
    assert update["reference model"] == update["train state: params"]  # float32, as run_grpo keeps it
    assert any(name.startswith("engine: KV pool") and "pallas" in name for name in rollout)  # the TPU path
    assert not any(name.startswith("engine") for name in update)  # copy and pool let go for the update
    assert "reference model" not in sft and not any(name.startswith("engine") for name in sft)
    for phase in out["phases"]:
        assert phase["total"] == sum(part["bytes"] for part in phase["parts"])
    assert {"engine decode", "grpo step", "sft step"} <= set(out["programs"])
    assert "model from the config's inline model.arch" in proc.stdout


@needs_libtpu
def test_the_configs_engine_pool_is_planned(config):
    out, _ = run_plan(["--config", config, "--phases", "rollout,update", "--set", "rollout.kv_cache_tokens=1024",
                       "rollout.keep_kv_pool=true"])
    assert out["settings"]["engine"]["kv_cache_tokens"] == 1024 and out["settings"]["keep_kv_during_update"]
    _, rollout, update = ({part["name"]: part["bytes"] for part in p["parts"]} for p in out["phases"])
    (pool,) = [name for name in update if name.startswith("engine: KV pool")]  # kept through the update
    assert pool.startswith("engine: KV pool (1024 tokens") and rollout[pool] == update[pool] > 0


@needs_libtpu
def test_a_config_too_big_for_its_chip_exits_1(config):
    out, proc = run_plan(["--config", config, "--phases", "update", "--set", *TOO_BIG], expect=1)
    assert out["fits"] is False and out["compiler"] == "tpu" and out["per_device_bytes"] > out["hbm_bytes"]
    (update,) = out["phases"]
    assert update["total"] == sum(part["bytes"] for part in update["parts"])
    assert "DOES NOT FIT" in proc.stdout and "fits: false" in proc.stdout


def test_a_config_is_changed_with_set_not_with_run_flags(config):
    _, proc = run_plan(["--config", config, "--batch", "16"], expect=1)
    assert "--batch with --config" in proc.stderr and "--set" in proc.stderr


def test_a_config_without_a_topology_asks_for_one(config):
    _, proc = run_plan(["--config", config, "--set", "mesh.topology=null"], expect=1)
    assert "names no mesh.topology" in proc.stderr and "--topology" in proc.stderr


@needs_libtpu
def test_too_big_exits_1():
    out, proc = run_plan([*SMALL, "--topology", "v5p-8", "--phases", "update", "--hbm", "64KiB"], expect=1)
    assert out["fits"] is False and out["per_device_bytes"] > 64 * 1024
    assert "DOES NOT FIT" in proc.stdout and "fits: false" in proc.stdout


def test_without_libtpu_exits_2_and_names_the_extra():
    # `import libtpu` fails as it would without the tpu extra
    code = ("import sys; sys.modules['libtpu'] = None; from muajax.plan import main; "
            f"main({[*SMALL, '--topology', 'v5p-64']!r})")
    _, proc = run_plan(None, code=code, expect=2)
    assert 'pip install -e ".[tpu]"' in proc.stderr


def test_fake_cpu_mesh_reexecs_and_judges_against_a_chip():
    # jax already started with 1 device: plan re-executes itself with 4
    code = ("import jax; assert len(jax.devices()) == 1; from muajax.plan import main; "
            f"main({[*SMALL, '--topology', 'cpu:4', '--chip', 'h100', '--phases', 'update']!r}, allow_reexec=True)")
    out, proc = run_plan(None, code=code, fast_cpu=True)
    assert out["compiler"] == "cpu" and out["devices"] == 4 and out["chip"] == "h100" and out["fits"] is True
    # judged against the share of the card the trainer lets jax take (run.gpu_memory_fraction's default)
    assert out["hbm_bytes"] == 72 * 10**9 and out["gpu_memory_fraction"] == 0.9
    assert "judged against 0.9 x h100's 80 GB = 72.0 GB" in proc.stdout
    assert out["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1, "sequence": 1, "expert": 1}  # default: fsdp over every device


def test_argument_parsing():
    assert parse_bytes("95GiB") == 95 * 2**30 and parse_bytes("16GB") == 16 * 10**9 and parse_bytes("1e9") == 10**9
    assert parse_mesh("data=1,fsdp=16,tensor=4") == {"data": 1, "fsdp": 16, "tensor": 4, "sequence": 1, "expert": 1}
    assert parse_mesh("tensor=2") == {"data": 1, "fsdp": 1, "tensor": 2, "sequence": 1, "expert": 1}
    assert parse_mesh("fsdp=-1,tensor=2") == {"data": 1, "fsdp": -1, "tensor": 2, "sequence": 1, "expert": 1}
    with pytest.raises(argparse.ArgumentTypeError, match="memory size"):
        parse_bytes("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="data=N"):
        parse_mesh("pipeline=2")
    with pytest.raises(argparse.ArgumentTypeError, match="data=N"):
        parse_mesh("fsdp=0")


def test_user_latency_sets_the_profile_s_users_reply_time():
    from muajax.plan import build_parser, rollout_profile

    args = build_parser().parse_args(["--model", "qwen3-0.6b", "--rollout-profile",
                                      "configs/profiles/tau2-retail.json", "--user-latency", "2"])
    profile = rollout_profile(args)
    assert profile.user_latency_s.mean == 2.0 and profile.user_latency_s.quantile(0.9) == 2.0
    assert profile.name == "tau2-retail, users answering in 2 s"
    shipped = rollout_profile(build_parser().parse_args(["--rollout-profile", "configs/profiles/tau2-retail.json"]))
    assert shipped.user_latency_s.mean == 0.0 and shipped.agent_turns == profile.agent_turns
    with pytest.raises(SystemExit, match="at least 0"):
        rollout_profile(build_parser().parse_args(["--rollout-profile", "configs/profiles/tau2-retail.json",
                                                   "--user-latency", "-1"]))
