"""`python -m muajax.plan`: ahead-of-time compile on a fake CPU mesh, per-device memory, fits."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from muajax.plan import parse_bytes, parse_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every sharded dim divides by fsdp=2 and tensor=2, so the layout really splits.
TINY = json.dumps(dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=512))


def run_plan(args, pre_import_jax=False):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # compile speed; plan adds the device count
    if pre_import_jax:
        # jax already running with 1 device: plan must re-execute itself to get its mesh.
        code = ("import jax; assert len(jax.devices()) == 1; from muajax.plan import main; "
                f"main({args!r}, allow_reexec=True)")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "muajax.plan", *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def param_count_per_device():
    """The tiny model's float32 weights on fsdp=2, tensor=2, counted from the rules by hand."""
    d, f, v, layers, n, k, h = 64, 128, 256, 2, 4, 2, 16
    per_layer = (2 * d + 2 * h) + (d * n * h + 2 * d * k * h + n * h * d) / 4 + 3 * d * f / 4
    # embed: rows replicated ("embed_vocab"), width over fsdp; lm_head: [embed/fsdp, vocab/tensor].
    return 4 * (layers * per_layer + v * d / 2 + d + d * v / 4)


def test_plan_train_and_decode_on_a_fake_mesh():
    out, table = run_plan(["--model", TINY, "--mesh", "data=1,fsdp=2,tensor=2", "--batch", "8", "--seq", "64",
                           "--microbatch", "4", "--remat", "full", "--hbm", "1GiB"])
    assert out["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} and out["microbatches"] == 2
    train, decode = out["breakdown"]["train"], out["breakdown"]["decode"]
    assert train["params"] == param_count_per_device()
    assert train["optimizer_state"] >= 2 * train["params"]  # Adam's mu and nu, sharded like params
    assert train["reference_params"] == train["params"] // 2  # bfloat16 reference
    assert decode["kv_cache"] == 2 * 2 * 4 * 64 * (2 // 2) * 16 * 2 + 4 * 4  # k, v (bf16) + lengths
    for part in (train, decode):
        assert part["temporaries"] > 0 and part["xla_flops"] > 0 and part["model_flops"] > 0
        assert part["aliased"] > 0  # the donated state / cache is reused in place
        assert part["total"] == part["arguments"] + part["outputs"] - part["aliased"] + part["temporaries"] \
            + part["code"]
    assert out["per_device_bytes"] == max(train["total"], decode["total"])
    assert out["fits"] is True and out["hbm_bytes"] == 2**30
    assert "TOTAL per device" in table and "fits" in table


def test_plan_reexecs_when_jax_already_started_and_reports_not_fitting():
    out, table = run_plan(["--model", TINY, "--mesh", "fsdp=2,tensor=2", "--batch", "8", "--seq", "64",
                           "--skip-train", "--hbm", "64KiB"], pre_import_jax=True)
    assert list(out["breakdown"]) == ["decode"]
    assert out["per_device_bytes"] > 64 * 1024 and out["fits"] is False
    assert "DOES NOT FIT" in table


def test_argument_parsing():
    assert parse_bytes("95GiB") == 95 * 2**30 and parse_bytes("16GB") == 16 * 10**9 and parse_bytes("1e9") == 10**9
    assert parse_mesh("data=1,fsdp=16,tensor=4") == {"data": 1, "fsdp": 16, "tensor": 4}
    assert parse_mesh("tensor=2") == {"data": 1, "fsdp": 1, "tensor": 2}
    with pytest.raises(argparse.ArgumentTypeError, match="memory size"):
        parse_bytes("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="data=N"):
        parse_mesh("pipeline=2")
