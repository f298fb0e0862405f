"""The planner on a mixture of experts: its plan beside another (`--compare`), one row per
batch device of every batch axis (the expert axis too), and a tiny Qwen3-MoE planned with
the TPU compiler on an expert-parallel mesh."""
import argparse
import json

import pytest

from muajax.plan import smallest_microbatches
from muajax.planning.planner import PlanSettings
from muajax.planning.report import comparison
from muajax.planning.topology import libtpu_available
from muajax.rl.grpo import GRPOConfig
from tests.test_plan import run_plan

needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                  'pip install -e ".[tpu]" to run the TPU planning tests')
MOE = json.dumps({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 2, "head_dim": 128, "max_position_embeddings": 512, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True})


def _summary(model, devices, peak, step, rollout, update, tokens):
    return {"model": model, "topology": f"v5p-{2 * devices}", "devices": devices, "per_device_bytes": peak,
            "fits": True, "step_s": step, "rollout_s": rollout, "update_s": update, "tokens_per_s_per_chip": tokens}


def test_a_plan_beside_another_names_both_and_the_step_ratio():
    moe = _summary("qwen3-30b-a3b", 32, 50 * 2**30, 120.0, 30.0, 90.0, 100.0)
    dense = _summary("qwen3-8b", 16, 38 * 2**30, 80.0, 17.0, 63.0, 217.0)
    out = comparison(moe, dense)
    assert out["step_ratio"] == pytest.approx(1.5)
    assert out["this"]["model"] == "qwen3-30b-a3b" and out["other"]["devices"] == 16
    first, second, third = out["line"].splitlines()
    assert "qwen3-30b-a3b on v5p-64 (32 chips)" in first and "step 120.00 s" in first and "50.00 GiB" in first
    assert "qwen3-8b" in second and "step 80.00 s" in second
    assert third == "step ratio 1.50 (this / beside)"
    # a plan without a step (no rollout profile): memory only, no ratio
    bare = comparison({**moe, "step_s": None}, dense)
    assert bare["step_ratio"] is None and "step" not in bare["line"].splitlines()[0]
    # nor one that does not fit (its update never compiled: the step would be its rollout alone)
    too_big = comparison({**moe, "fits": False}, dense)
    assert too_big["step_ratio"] is None and "fits false" in too_big["line"] and "step" not in too_big["line"].split("\n")[0]


def test_one_row_per_batch_device_counts_the_expert_axis():
    args = argparse.Namespace(microbatch=None, sft_microbatch=None)
    settings = PlanSettings(batch=64, grpo=GRPOConfig())
    sizes = {"data": 1, "fsdp": 4, "tensor": 2, "sequence": 1, "expert": 4}
    chosen = smallest_microbatches(settings, args, sizes)
    assert chosen.grpo.microbatch_size == 16 and chosen.sft.microbatch_size == 16  # fsdp x expert


@needs_libtpu
def test_a_tiny_mixture_of_experts_plans_on_an_expert_parallel_mesh(tmp_path):
    dense, _ = run_plan(["--model", MOE.replace('"num_experts": 8', '"num_experts": 0'), "--batch", "8", "--seq",
                         "256", "--topology", "v5p-8", "--mesh", "fsdp=4", "--phases", "update"])
    saved = tmp_path / "dense.txt"
    saved.write_text("plan: ...\n" + json.dumps(dense) + "\n")
    out, proc = run_plan(["--model", MOE, "--batch", "8", "--seq", "256", "--topology", "v5p-8", "--mesh",
                          "fsdp=2,expert=2", "--phases", "update", "--compare", str(saved)])
    assert out["fits"] is True and out["mesh"]["expert"] == 2 and out["settings"]["microbatch_size"] == 4
    step = out["programs"]["grpo step"]
    # the grouped matmuls are XLA:TPU's ragged-dot kernel, each run counted; nothing left uncounted
    ragged = {k["name"]: k for k in step["kernels"]}["ragged-dot-none"]
    assert ragged["calls"] > 0 and ragged["flops"] > 0 and step["uncounted"] == {}
    # the experts' tokens travel by all-to-all over the expert axis
    assert step["collective_bytes"]["all-to-all"] > 0
    # the compiled step computes at least what the model counts (router + active experts):
    # more, by the dispatch's padding rows and the weight gradient's blocks (models/grouped_matmul)
    assert out["flops_ratio"]["grpo"] >= 0.99
    assert out["active_params"] < out["params"] and dense["active_params"] == dense["params"]
    assert "B active: 2 of 8 experts a token" in proc.stdout
    assert out["compared_with"]["other"]["devices"] == 4 and "beside:" in proc.stdout
