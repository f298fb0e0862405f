"""The trainer's per-step measurements on this CPU: model TFLOP/s and MFU against the
measured matmul peak, the HBM high-water mark, a jax.profiler trace of chosen steps; and a
short SFT + GRPO run that logs them and writes its traces."""
import glob
import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from muajax.models.flops import real_token_flops, train_step_flops
from muajax.runtime.host_batch import length_buckets
from muajax.runtime.grpo_layout import system_prompt_prefix
from muajax.train.sft import read_examples
from muajax.train.step_metrics import (ProfileWindow, device_peak_flops, hbm_high_water, measure_matmul_peak,
                                       peak_flops, perf_record, step_throughput)
from tests.support.toy_run import toy_config, toy_trainer


class FakeDevice:
    def __init__(self, kind="TPU v5", stats=None, platform="tpu"):
        self.device_kind, self._stats, self.platform = kind, stats, platform

    def memory_stats(self):
        return self._stats


def test_throughput_and_mfu():
    assert step_throughput(4e12, 2.0, 4, 1e12) == {"perf/tflops_per_device": 0.5, "perf/mfu": 0.5}
    assert step_throughput(4e12, 2.0, 4, None) == {"perf/tflops_per_device": 0.5}
    with pytest.raises(ValueError):
        step_throughput(1.0, 0.0, 1, None)
    assert perf_record(4e12, 2.0, 4, 1e12) == {"perf/model_flops": 4e12, "perf/update_s": 2.0,
                                               "perf/tflops_per_device": 0.5, "perf/mfu": 0.5}  # XLA:CPU: no HBM
    assert perf_record(4e12, 0.0, 4, 1e12) == {"perf/model_flops": 4e12, "perf/update_s": 0.0}
    padded = perf_record(2e12, 2.0, 4, 1e12, padded_flops=4e12)  # MFU on real tokens; the padded one apart
    assert padded["perf/mfu"] == 0.25 and padded["perf/padded_mfu"] == 0.5
    assert padded["perf/padded_model_flops"] == 4e12 and padded["perf/padded_tflops_per_device"] == 0.5


def test_real_token_flops_count_each_row_at_its_length_and_the_prefix_as_computed():
    from tests.support.tiny_models import TINY_CONFIG as cfg
    assert real_token_flops(cfg, [100, 300], passes=3.0) == pytest.approx(
        train_step_flops(cfg, 1, 100) + train_step_flops(cfg, 1, 300))
    assert real_token_flops(cfg, [300], passes=3.0) < train_step_flops(cfg, 1, 512)  # no padded positions
    # a shared prefix run once per microbatch: two rows in one microbatch = the padded count at equal lengths
    shared = real_token_flops(cfg, [300, 300], passes=3.0, shared_prefix=128, prefix_runs=1)
    assert shared == pytest.approx(train_step_flops(cfg, 2, 300, shared_prefix=128, microbatches=1))
    assert real_token_flops(cfg, [300, 300], passes=3.0, shared_prefix=128, prefix_runs=2) > shared


def test_the_peak_is_the_chip_table_s_or_a_cpu_s_measured_matmul():
    assert peak_flops(FakeDevice("TPU v5")) == 459e12
    assert device_peak_flops([FakeDevice("TPU v6 lite")]) == 918e12
    assert device_peak_flops([FakeDevice("TPU v99")]) is None  # an accelerator of unknown peak: no MFU
    cpu = jax.devices("cpu")[0]
    assert peak_flops(cpu) is None
    measured = measure_matmul_peak(size=128, repeat=2)
    assert measured.per_second > 1e6 and measured.per_cpu_second > 1e6  # FLOP/s of a real matmul on this CPU
    assert device_peak_flops([cpu]) > 1e8


def test_hbm_high_water():
    devices = [FakeDevice(stats={"peak_bytes_in_use": 5, "bytes_in_use": 1}), FakeDevice(stats={"peak_bytes_in_use": 9}),
               FakeDevice(stats=None)]
    assert hbm_high_water(devices) == 9
    assert hbm_high_water([FakeDevice(stats=None)]) is None
    assert hbm_high_water() is None  # XLA:CPU reports no memory statistics


def trace_files(log_dir) -> dict[str, str]:
    """{suffix after the host name: path} of the one trace session under log_dir."""
    sessions = glob.glob(os.path.join(log_dir, "plugins", "profile", "*"))
    assert len(sessions) == 1, sessions
    return {os.path.basename(p).split(".", 1)[1]: p for p in glob.glob(os.path.join(sessions[0], "*"))}


def assert_opens(log_dir):
    """TensorBoard's profile plugin reads the .xplane.pb, Perfetto the JSON trace."""
    files = trace_files(log_dir)
    assert os.path.getsize(files["xplane.pb"]) > 0
    perfetto = os.path.join(os.path.dirname(files["xplane.pb"]), "perfetto_trace.json.gz")
    assert os.path.getsize(perfetto) > 0
    with gzip.open(perfetto) as f:
        assert json.load(f)["traceEvents"]


def test_profile_window_traces_only_its_steps(tmp_path):
    window = ProfileWindow(str(tmp_path / "profile"), [2, 3])
    step = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    for n in range(1, 6):
        window.step_started(n)
        assert window.active == (2 <= n <= 3)
        x = step(x)
        window.step_finished(n, x)
    assert not window.active
    assert_opens(tmp_path / "profile")


def test_profile_window_rejects_bad_steps(tmp_path):
    with pytest.raises(ValueError, match="first, last"):
        ProfileWindow(str(tmp_path), [3, 2])
    ProfileWindow(str(tmp_path), None).step_started(1)  # no window: nothing happens
    assert not os.listdir(tmp_path)


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_an_sft_and_grpo_run_logs_throughput_and_writes_its_traces(tmp_path):
    data = tmp_path / "sft.jsonl"
    conversation = {"system": "Answer.", "messages": [{"role": "user", "content": "Say yes or no."},
                                                      {"role": "assistant", "content": "yes"}]}
    data.write_text((json.dumps(conversation) + "\n") * 4)
    cfg = toy_config(tmp_path, "run.stages=[sft, grpo]", f"sft.data={data}", "sft.steps=2", "sft.batch_size=2",
                     "sft.max_len=64", "grpo.kl_coef=0.01", "metrics.profile_steps=[2, 2]", "eval.max_tasks=1")
    trainer = toy_trainer(cfg)
    trainer.run()
    ctx = trainer.ctx
    sft, grpo = records(os.path.join(cfg.run_dir, "sft", "metrics.jsonl")), records(os.path.join(cfg.run_dir,
                                                                                                   "metrics.jsonl"))
    assert len(sft) == len(grpo) == 2
    # SFT packs both conversations into one row of 128 tokens; GRPO steps 4 rows of its one
    # length bucket (512) with the KL reference's forward, and the system prompt once when it
    # is long enough to share (`grpo_layout.shared_prefix_tokens`). MFU counts real tokens;
    # the padded figure is logged apart.
    prompt = system_prompt_prefix(ctx.domain.env, ctx.tok, ctx.train_tasks())
    prefix = prompt if prompt >= 128 else 0
    assert length_buckets(cfg.rollout.max_context) == (512,) and prompt > 0
    # packed GRPO rows (the default): the 4 trajectories run in as many rows as they pack into
    grpo_flops = {train_step_flops(ctx.model_cfg, rows, 512, reference=True, shared_prefix=prefix)
                  for rows in (1, 2, 3, 4)}
    lengths = [len(ids) for ids, _ in read_examples(str(data), ctx.tok, 64)][:2]
    for stage, rec in [("sft", r) for r in sft] + [("grpo", r) for r in grpo]:
        assert rec["perf/tflops_per_device"] > 0 and 0 < rec["perf/mfu"] < rec["perf/padded_mfu"] < 1, (stage, rec)
        assert "time/compile_s" in rec and "perf/hbm_peak_bytes" not in rec  # XLA:CPU has no memory stats
        assert rec["perf/tflops_per_device"] == pytest.approx(rec["perf/model_flops"] / rec["perf/update_s"] / 1e12)
        assert rec["perf/mfu"] / rec["perf/padded_mfu"] == pytest.approx(
            rec["perf/model_flops"] / rec["perf/padded_model_flops"])
        if stage == "sft":
            assert rec["perf/padded_model_flops"] == train_step_flops(ctx.model_cfg, 1, 128)
            assert rec["perf/model_flops"] == pytest.approx(real_token_flops(ctx.model_cfg, lengths, passes=3.0))
        else:
            assert rec["perf/padded_model_flops"] in grpo_flops
            assert rec["perf/update_s"] <= rec["time/update_s"]  # the update's compile time is not in it
    assert grpo[0]["time/compile_s"] > 0
    assert_opens(os.path.join(cfg.run_dir, "profile"))
    assert_opens(os.path.join(cfg.run_dir, "sft", "profile"))
