"""`python -m muajax.bench`: dispatch, errors and the JSON last line. No timing assertions."""
import json
import math
import os
import subprocess
import sys

import pytest

import muajax.bench as bench_pkg
from muajax.bench import __main__ as bench_main
from muajax.bench import common

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}


def run_bench(*args):
    proc = subprocess.run([sys.executable, "-m", "muajax.bench", *args], capture_output=True, text=True,
                          env=ENV, cwd=REPO, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr}"
    return proc, json.loads(lines[-1])


def test_forward_quick_prints_both_figures_and_a_json_last_line():
    proc, out = run_bench("forward", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["benchmark"] == "forward" and out["quick"] is True
    for key in ("ratio", "muajax_tokens_per_s", "transformers_tokens_per_s"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["ratio"] == pytest.approx(out["muajax_tokens_per_s"] / out["transformers_tokens_per_s"])
    assert len(out["muajax_times_s"]) == len(out["transformers_times_s"]) == out["repeat"] == 2
    assert out["max_abs_logit_diff"] < 1e-4  # both sides ran the same weights
    assert out["config"]["batch"] * out["config"]["seq"] == 64
    text = proc.stdout
    assert "transformers" in text and "muajax" in text and "ratio muajax/transformers" in text


def test_forward_moe_quick_compares_the_mixture_of_experts_with_transformers():
    proc, out = run_bench("forward", "--quick", "--moe")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["benchmark"] == "forward" and out["moe"] is True
    assert out["config"]["experts"] == 8 and out["config"]["active"] == 2 and out["config"]["moe_intermediate"] == 32
    assert out["ratio"] == pytest.approx(out["muajax_tokens_per_s"] / out["transformers_tokens_per_s"])
    assert out["max_abs_logit_diff"] < 1e-4  # Qwen3MoeForCausalLM's weights, through muajax's loader
    assert "8 experts of 32, 2 a token" in proc.stdout and "ratio muajax/transformers" in proc.stdout


def test_unknown_benchmark_is_an_error_with_the_list():
    proc, out = run_bench("no-such-bench")
    assert proc.returncode == 2
    assert "unknown benchmark 'no-such-bench'" in out["error"] and "forward" in out["error"]


def test_planned_but_missing_benchmark_says_not_available(monkeypatch, capsys):
    monkeypatch.setattr(bench_pkg, "PLANNED", bench_pkg.PLANNED + ("zzz_future",))
    assert bench_main.main(["zzz_future"]) == 2
    out = capsys.readouterr()
    assert "not available yet" in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["benchmark"] == "zzz_future"
    assert bench_main.main([]) == 2 and "zzz_future" in capsys.readouterr().out


def test_bench_error_from_a_benchmark_becomes_exit_1_and_json(monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "available", lambda: ["forward"])
    assert bench_main.main(["forward", "--heads", "3", "--kv-heads", "2"]) == 1
    out = capsys.readouterr()
    assert "multiple of --kv-heads" in json.loads(out.out.strip().splitlines()[-1])["error"]


def test_emit_json_is_one_line_with_nan_as_null(capsys):
    common.emit_json({"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": 2}})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == {"a": None, "b": [1.5, None], "c": {"d": 2}}


def test_interleave_warms_up_then_alternates_who_goes_first():
    calls = []
    seen = {}
    fns = {"x": lambda: calls.append("x") or 1, "y": lambda: calls.append("y") or 2}
    times = common.interleave(fns, warmup=1, repeat=3, on_warmup=lambda n, out: seen.__setitem__(n, out))
    assert calls == ["x", "y", "x", "y", "y", "x", "x", "y"]
    assert seen == {"x": 1, "y": 2}
    assert all(len(t) == 3 and all(s >= 0 for s in t) for t in times.values())
    assert common.median([3.0, 1.0, 100.0]) == 3.0 and math.isnan(common.ratio(1.0, 0.0))
    with pytest.raises(common.BenchError):
        common.interleave(fns, repeat=0)


def test_train_quick_times_muajax_beside_torch_and_another_attention():
    proc, out = run_bench("train", "--quick", "--attention", "chunked", "--also-attention", "xla")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["benchmark"] == "train" and out["attention"] == "chunked"
    assert set(out["attention_s"]) == {"chunked", "xla"} and all(s > 0 for s in out["attention_s"].values())
    assert out["attention_s"]["chunked"] == out["muajax_median_s"]
    assert out["ratio"] == pytest.approx(out["torch_median_s"] / out["muajax_median_s"])
    assert 0 < out["mfu"] and abs(out["first_loss_muajax"] - out["first_loss_torch"]) < 1e-3
    assert "with xla attention" in proc.stdout
