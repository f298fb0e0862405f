"""The engine benchmarks run end to end at tiny sizes and end with one valid JSON line.

No timing is asserted: the figures depend on the machine and its load; only that each
bench completes, reports every field the brief requires, and reports finite numbers.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str) -> tuple[dict, str]:
    """Run `python -m muajax.bench name --quick args`; return the last line's JSON and all stdout."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "muajax.bench", name, "--quick", *args]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert isinstance(result, dict) and result["benchmark"] == name and "error" not in result
    assert not any(line.lstrip().startswith("{") for line in lines[:-1]), "the JSON line must be the only one"
    return result, proc.stdout


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_generate_quick():
    result, stdout = run_bench("generate")
    for side in ("muajax", "transformers"):
        for key in ("decode_tok_s", "e2e_tok_s", "prefill_s", "decode_s", "total_s"):
            assert positive(result[side][key]), (side, key, result[side])
    assert result["muajax"]["compile_s"] >= 0
    for key in ("decode_ratio", "e2e_ratio", "decode_ratio_vs_best_torch", "e2e_ratio_vs_best_torch"):
        assert positive(result[key]), (key, result[key])
    assert result["decode_ratio_vs_best_torch"] <= result["decode_ratio"] * (1 + 1e-9)  # best torch is never slower
    assert math.isclose(result["decode_ratio"], result["muajax"]["decode_tok_s"] / result["transformers"]["decode_tok_s"],
                        rel_tol=1e-6)
    # same weights, greedy: both sides must pick the same first token (a wrong load would not)
    assert result["greedy_agree_prefix"] >= 1
    assert "transformers" in stdout and "muajax" in stdout  # the figures are printed beside the reference
    floor = result["floor"]  # one step's products: what bounds any engine's ratio on this machine
    for key in ("torch_matmul_ms", "xla_matmul_ms", "weight_stream_ms", "muajax_step_over_xla_floor",
                "decode_ratio_ceiling", "decode_ratio_bandwidth_ceiling"):
        assert positive(floor[key]), (key, floor)
    assert math.isclose(floor["decode_ratio_ceiling"], result["transformers"]["decode_ms_per_step"]
                        / min(floor["torch_matmul_ms"], floor["xla_matmul_ms"]), rel_tol=1e-2)
    # muajax's decode takes its turn in the floor's own rounds, and its ratio is of those medians
    assert floor["muajax_interleaved"] is True and positive(floor["muajax_decode_ms"])
    assert_floor_ratios(floor, result["config"])
    assert "decode floor" in stdout and "timed in the same rounds" in stdout


def assert_floor_ratios(floor: dict, config: dict) -> None:
    """The decode over the floor of the model's whole step (over the mean context), and over
    the products and the matmuls alone beside it: each of the medians timed in the same rounds."""
    assert floor["xla_floor_attention"]["context"] == config["prompt"] + (config["new"] - 1) // 2
    assert floor["xla_floor_kind"] == "model_step"
    assert positive(floor["xla_floor_ms"]) and positive(floor["xla_products_ms"]) and positive(floor["xla_matmul_ms"])
    assert math.isclose(floor["muajax_step_over_xla_floor"], floor["muajax_decode_ms"] / floor["xla_floor_ms"],
                        rel_tol=1e-6)
    assert math.isclose(floor["muajax_step_over_products_floor"], floor["muajax_decode_ms"] / floor["xla_products_ms"],
                        rel_tol=1e-6)
    assert floor["xla_floor_fastest_ms"] <= floor["xla_floor_ms"]  # the faster of the two cache layouts
    assert math.isclose(floor["muajax_step_over_fastest_floor"], floor["muajax_decode_ms"] / floor["xla_floor_fastest_ms"],
                        rel_tol=1e-6)
    assert math.isclose(floor["muajax_step_over_matmul_floor"], floor["muajax_decode_ms"] / floor["xla_matmul_ms"],
                        rel_tol=1e-6)


def test_generate_times_the_floor_without_transformers():
    """The floor ratio needs no transformers run: `--no-hf` still times the XLA floor, over the
    engine's own decode steps (its chunks), in the rounds muajax's decode takes its turn in."""
    result, stdout = run_bench("generate", "--no-hf")
    floor, config = result["floor"], result["config"]
    assert floor["muajax_interleaved"] is True and positive(floor["xla_matmul_ms"])
    assert floor["xla_floor_steps"] == -(-config["new"] // config["decode_chunk"]) * config["decode_chunk"]
    assert_floor_ratios(floor, config)
    assert "torch_matmul_ms" not in floor and "transformers" not in result
    machine = result["machine"]  # the box's facts, to compare figures from two boxes
    assert machine["isa_cap"] is None and machine["usable_cpus"] >= 1
    if os.path.exists("/proc/cpuinfo"):
        assert machine["isa"] and machine["cpu_model"]


def test_multiturn_quick():
    result, stdout = run_bench("multiturn")
    turns = result["config"]["turns"]
    for key in ("kept_per_turn_s", "reprefill_per_turn_s"):
        assert len(result[key]) == turns and all(positive(x) for x in result[key]), result[key]
    for key in ("per_turn_growth", "reprefill_growth", "speedup_vs_reprefill", "kept_total_s", "reprefill_total_s"):
        assert positive(result[key]), (key, result[key])
    assert math.isclose(result["per_turn_growth"], result["kept_per_turn_s"][-1] / result["kept_per_turn_s"][0],
                        rel_tol=1e-9)
    # the kept cache and a re-prefill of the whole history give the same greedy conversation
    assert result["same_conversation"] is True
    assert "re-prefill" in stdout
    # the model's own step over the first and last turns' contexts: the growth any engine has
    config = result["config"]
    assert result["floor_contexts"]["first"] == config["user"] + (config["new"] - 1) // 2
    assert result["floor_contexts"]["last"] == (turns - 1) * (config["user"] + config["new"]) + result["floor_contexts"]["first"]
    # and the turn's extend over each turn's history: a turn is an extend and `new` decode steps
    for end in ("first", "last"):
        assert positive(result["floor_step_ms"][end]) and positive(result["floor_extend_ms"][end])
        assert math.isclose(result["floor_turn_ms"][end],
                            result["floor_extend_ms"][end] + config["new"] * result["floor_step_ms"][end], rel_tol=1e-9)
    assert math.isclose(result["floor_growth"], result["floor_turn_ms"]["last"] / result["floor_turn_ms"]["first"],
                        rel_tol=1e-9)
    assert math.isclose(result["floor_decode_growth"],
                        result["floor_step_ms"]["last"] / result["floor_step_ms"]["first"], rel_tol=1e-9)
    assert math.isclose(result["per_turn_growth_over_floor"], result["per_turn_growth"] / result["floor_growth"],
                        rel_tol=1e-9)
    assert "a turn's own work in plain XLA" in stdout
    # the stream floor: only reading a step's bytes, at the same contexts
    assert all(positive(result["stream_step_ms"][end]) for end in ("first", "last"))
    assert math.isclose(result["stream_step_growth"], result["stream_step_ms"]["last"] / result["stream_step_ms"]["first"],
                        rel_tol=1e-9)


def test_generate_max_len_compares_with_a_short_max_len():
    result, stdout = run_bench("generate", "--no-hf", "--no-floor", "--max-len", "2048")
    base = result["muajax_base"]
    assert result["config"]["max_len"] == 2048 and base["max_len"] == 512
    assert positive(base["decode_ms_per_step"]) and positive(result["muajax"]["decode_ms_per_step"])
    assert math.isclose(result["maxlen_cost_ratio"],
                        result["muajax"]["decode_ms_per_step"] / base["decode_ms_per_step"], rel_tol=1e-9)
    assert result["maxlen_same_tokens"] is True  # max_len changes page-table widths, not the numbers
    assert "max_len 2048" in stdout and "max_len 512" in stdout


def test_rollout_quick_prefills_the_shared_system_prompt_once():
    result, stdout = run_bench("rollout", "--shop")
    runs = sum(len(r) for r in result["runs"].values())
    assert runs == 2 and result["same_conversations"] is True
    shared = result["prefix_tokens"]
    assert 0 < shared <= result["system_prompt_tokens"] < shared + 16  # full pages of 16 tokens
    # one policy version for every run: the prefix is computed once, every conversation hits it
    assert result["prefix_prefill_tokens"] == shared
    assert result["prefix_hits"] == runs * result["conversations"]
    assert positive(result["busy_share"]) and positive(result["baseline_busy_share"])


def test_generate_against_tunix_when_an_interpreter_with_it_is_given():
    """tunix lives in its own environment (its jax pins differ); MUAJAX_TUNIX_PYTHON names it."""
    python = os.environ.get("MUAJAX_TUNIX_PYTHON")
    if not python:
        pytest.skip("MUAJAX_TUNIX_PYTHON is not set (a python with google-tunix)")
    result, stdout = run_bench("generate", "--no-hf", "--tunix-python", python)
    assert result["tunix"]["available"] is True and result["tunix"]["version"]
    # the same checkpoint, greedy, float32: tunix's Sampler picks the very same tokens
    assert result["tunix_greedy_agree_prefix"] == result["config"]["new"]
    assert math.isclose(result["tunix_decode_ms_ratio"],
                        result["muajax"]["decode_ms_per_step"] / result["tunix"]["decode_ms_per_step"], rel_tol=1e-9)
    assert "tunix" in stdout and "tokens" not in result["tunix"]
