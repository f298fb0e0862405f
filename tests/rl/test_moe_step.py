"""The GRPO step of a tiny mixture of experts on 8 fake CPU devices, experts split over
expert = 2, 4 and 8 beside fsdp and tensor (and in microbatches), equals the one-device step:
loss, KL, the load-balancing loss, gradient norm, Adam's moments and the updated params, to
the tolerances of the dense model's sharded step (tests/rl/test_step.py); the experts are
really split over the expert axis, and XLA replicates nothing it should not."""
import functools
import json
import os
import subprocess
import sys

from tests.support import workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=None)
def _checks() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # LLVM opt level 0 halves compile time; every compared run in the process shares it
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, workers.path("moe_step_checks.py")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # XLA's warning that it replicated an array it could not reshard (a layout bug)
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expert_size(key: str) -> int:
    return int(key.split(")")[0].strip("(").split(", ")[4])


def test_sharded_moe_grpo_step_equals_one_device():
    out = _checks()
    base = out["base"]
    assert base["moe/aux_loss"] > 1.0 and base["kl"] > 0 and out["base_param_delta"] > 0  # it did update
    meshes = [k for k in out if k.startswith("(")]
    assert {_expert_size(k) for k in meshes} == {2, 4, 8}
    for key in meshes:
        r = out[key]
        assert "error" not in r, (key, r.get("error"))
        assert r["loss_diff"] <= 1e-5 and r["kl_diff"] <= 1e-6 and r["grad_norm_diff"] <= 1e-5, (key, r)
        assert r["aux_diff"] <= 1e-6, (key, r)
        assert r["param_diff"] <= 1e-5, (key, r)
        assert r["mu_diff"] <= 1e-8 and r["nu_diff"] <= 1e-11, (key, r)  # the gradients themselves


def test_the_experts_are_split_over_the_expert_axis():
    out = _checks()
    for key in (k for k in out if k.startswith("(")):
        specs = out[key]["specs"]
        for name in ("expert_gate", "expert_up", "expert_down"):
            # [layers, E, ...]: the experts' axis over the expert axis
            assert specs[name].startswith("P(None, 'expert'"), (key, name, specs[name])
