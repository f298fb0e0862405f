"""Every run config shipped in configs/ loads and validates."""
import glob
import os

import pytest

from muajax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = sorted(glob.glob(os.path.join(ROOT, "configs", "runs", "qwen3-*.yaml")))


@pytest.mark.parametrize("path", RUNS, ids=os.path.basename)
def test_run_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.hf_dir and cfg.env.domains == ("retail", "airline")
    assert cfg.user.kind == "openai" and cfg.rollout.n_per_task == 8 and cfg.grpo.kl_coef == 0.001


def test_embedded_default_loads():
    cfg = load_config(os.path.join(ROOT, "configs", "embedded-cpu.yaml"))
    assert cfg.env.domain == "builtin" and cfg.user.kind == "scripted" and cfg.run.stages == ("sft", "grpo")


def test_there_are_real_scale_configs_for_each_size_and_hardware():
    names = {os.path.basename(p) for p in RUNS}
    for size in ("8b", "14b", "32b"):
        for hw in ("v5p", "v6e", "h100"):
            assert f"qwen3-{size}-tau2-{hw}.yaml" in names
