"""Context parallelism (a mesh whose sequence axis splits each row's positions) equals one
device: attention alone for xla, chunked and splash, chunked's cache form, and a whole SFT
step of a tiny Qwen3 with packed rows and chunked logits; and the row really is split."""
import functools
import json
import os
import subprocess
import sys

from tests.support import workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 2e-5


@functools.lru_cache(maxsize=None)
def _run() -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, workers.path("context_parallel_checks.py")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)


def _checks() -> dict:
    proc = _run()  # once per session, failed or not
    assert proc.returncode == 0, proc.stderr[-4000:]
    # XLA's warning that it replicated an array it could not reshard: a layout bug that
    # costs a whole [B, T, D] per device at scale, though the numbers stay right
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_attention_split_over_sequence_equals_one_device():
    for mesh, impls in _checks()["attention"].items():
        assert set(impls) == {"xla", "chunked", "splash"}
        for impl, errors in impls.items():
            assert max(errors.values()) <= TOL, (mesh, impl, errors)


def test_cache_form_split_over_sequence_equals_one_device():
    errors = _checks()["cache_form"]
    assert max(errors.values()) <= TOL, errors


def test_the_row_is_split_not_replicated():
    split = _checks()["split"]
    assert split["seq4"]["all_gathers"] > 0 and split["seq1"]["all_gathers"] == 0, split
    # a quarter of the [T, S] scores per device, plus the gathered keys and values
    assert split["seq4"]["temp_bytes"] < 0.4 * split["seq1"]["temp_bytes"], split


def test_sft_step_split_over_sequence_equals_one_device():
    for mesh, errors in _checks()["sft_step"].items():
        assert errors["loss"] <= 1e-6 and errors["grad_norm_rel"] <= 1e-5 and errors["params"] <= 1e-7, (mesh, errors)
