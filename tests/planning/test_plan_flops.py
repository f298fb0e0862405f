"""A tiny model's GRPO and SFT steps compiled for a v5p:2x2x1 slice: their FLOPs include
the splash kernels and sit beside the analytic count of what the step executes, in the
plan's JSON and its programs table."""
import pytest

from muajax.config.schema import SFTConfig
from muajax.planning.topology import libtpu_available

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                'pip install -e ".[tpu]" to run the TPU planning tests')

from muajax.planning import report  # noqa: E402
from muajax.planning.planner import PlanSettings, plan_run  # noqa: E402
from muajax.planning.topology import parse_topology, tpu_devices  # noqa: E402
from muajax.rl.grpo import GRPOConfig  # noqa: E402
from tests.support.tiny_models import TINY_CONFIG  # noqa: E402

TINY = TINY_CONFIG.replace(head_dim=128, max_position_embeddings=1024, dtype="bfloat16", remat="full")
SETTINGS = PlanSettings(batch=8, seq=256, grpo=GRPOConfig(microbatch_size=4, logits_chunk=128),
                        sft=SFTConfig(batch_size=8, microbatch_size=4, max_len=256), phases=("update", "sft"))


@pytest.fixture(scope="module")
def plan():
    devices = tpu_devices(parse_topology("v5p:2x2x1"))
    return plan_run(TINY, devices=devices, mesh={"data": 1, "fsdp": 4, "tensor": 1, "sequence": 1},
                    settings=SETTINGS, label="tiny", topology="v5p:2x2x1")


def test_steps_count_their_kernels_and_match_the_analytic_count(plan):
    summary = plan.to_json()
    for kind, program in (("grpo", "grpo step"), ("sft", "sft step")):
        entry = summary["programs"][program]
        names = {k["name"] for k in entry["kernels"]}
        assert any("fwd" in name for name in names) and any("dkv" in name for name in names), names
        assert entry["uncounted"] == {} and entry["kernel_flops"] > 0
        assert summary["flops"][kind] == entry["flops"] >= entry["xla_flops"] + entry["kernel_flops"]
        assert summary["analytic_flops"][kind] == entry["analytic_flops"] > 0
        assert summary["flops_ratio"][kind] == entry["flops_ratio"] == pytest.approx(1.0, abs=0.1)
    # the layers run 2 x 2 times per pass (2 layers, 2 microbatches): the policy's forward and
    # its remat rerun, its backward, the reference's forward; packed GRPO rows (the default)
    # run the segmented kernels
    calls = {k["name"]: k["calls"] for k in summary["programs"]["grpo step"]["kernels"]}
    assert calls == {"splash_mha_fwd_segmented_residuals": 8, "splash_mha_dq_segmented_no_residuals": 4,
                     "splash_mha_dkv_segmented_no_residuals": 4, "splash_mha_fwd_segmented_no_residuals": 4}


def test_the_programs_table_shows_the_kernels_share(plan):
    table = report.programs_table(plan)
    assert "kernel" in table.splitlines()[0]
    grpo = next(p for p in plan.programs if p.name == "grpo step")
    row = next(line for line in table.splitlines() if line.startswith("grpo step"))
    assert f"{grpo.flops / 1e12:.2f}" in row and f"{grpo.kernel_flops / 1e12:.2f}" in row
    assert "grpo step:" in table and "sft step:" in table and "ratio" in table
