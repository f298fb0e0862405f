"""`python -m muajax.bench device` in its reduced form on the CPU: every check passes with
its error under its tolerance, the figures are measured (MFU null: a CPU's peak is not in
muajax/chips.py), the output ends with one JSON line; a wrong model fails the check and the
command."""
import json
import os
import subprocess
import sys

import jax
import pytest

from muajax.bench import device_checks
from muajax.bench.__main__ import EXIT_FAILED, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_the_reduced_device_check_passes_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "muajax.bench", "device"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = _json(proc.stdout)
    assert out["benchmark"] == "device" and out["passed"] and out["failed"] == []
    assert out["backend"] == "cpu" and out["form"] == "reduced" and out["arch"]["tie_word_embeddings"]
    checks = out["checks"]
    assert set(checks) == {"logits_float32", "logits_bfloat16", "greedy_tokens", "attention_chunked", "grpo_step"}
    for name, check in checks.items():
        assert check["passed"] and 0 <= check["error"] <= check["tolerance"], (name, check)
        assert f"PASS {name}: " in proc.stdout
    assert checks["logits_float32"]["positions"] == 30 and checks["greedy_tokens"]["tokens"] == 16
    assert checks["grpo_step"]["max_param_change"] > 0 and checks["grpo_step"]["reference"] is None
    figures = out["figures"]
    assert figures["decode_tokens_per_s"] > 0 and figures["update_model_flops"] > 0 and figures["update_s"] > 0
    assert figures["peak_flops"] is None and figures["mfu"] is None and "peak unknown" in figures["peak_note"]


def test_the_quick_checks_pass_and_a_wrong_model_fails_them(monkeypatch, capsys):
    """In process, the logit and attention checks pass; then with one embedding weight of
    muajax's side off by 1e-2 (tied: the LM head's too) the float32 logits part by more than
    their tolerance, the check says FAIL with its error, the JSON says which check failed,
    and the command exits 1. (The whole reduced run, figures included, is the slow tier's.)"""
    assert main(["device", "--reduced", "--checks", "logits,attention"]) == 0
    out = _json(capsys.readouterr().out)
    assert out["passed"] and set(out["checks"]) == {"logits_float32", "logits_bfloat16", "attention_chunked"}
    assert all(c["error"] <= c["tolerance"] for c in out["checks"].values())

    load = device_checks.muajax_model

    def perturbed(hf_dir, dtype):
        params, cfg = load(hf_dir, dtype)
        return dict(params, embed=params["embed"].at[7, 3].add(1e-2)), cfg

    monkeypatch.setattr(device_checks, "muajax_model", perturbed)
    assert main(["device", "--reduced", "--checks", "logits"]) == EXIT_FAILED
    stdout = capsys.readouterr().out
    out = _json(stdout)
    assert out["passed"] is False and "logits_float32" in out["failed"]
    check = out["checks"]["logits_float32"]
    assert check["error"] > check["tolerance"] == device_checks.F32_LOGIT_ATOL
    assert "FAIL logits_float32: max |Δlogit|" in stdout


def test_the_checks_cover_what_each_backend_has():
    assert device_checks.attention_impls("cpu") == [("chunked", "float32")]
    assert ("cudnn", "bfloat16") in device_checks.attention_impls("gpu")
    assert ("splash", "bfloat16") in device_checks.attention_impls("tpu")
    assert jax.default_backend() == "cpu"


def test_unknown_checks_are_refused(capsys):
    assert main(["device", "--checks", "logits,speed"]) != 0
    assert "choose from" in _json(capsys.readouterr().out)["error"]


@pytest.mark.parametrize("error,passed", [(0.0, True), (1e-5, True), (2e-5, False), (float("nan"), False)])
def test_a_check_passes_at_or_under_its_tolerance(error, passed):
    check = device_checks.Check("x", error, 1e-5, "max |Δ|")
    assert check.passed is passed and check.record()["passed"] is passed
    assert check.line().startswith("PASS" if passed else "FAIL")
