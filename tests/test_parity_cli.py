"""`python -m muajax.parity`: passes on a good checkpoint, exits 1 when muajax is wrong, 2 on a bad folder."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from muajax import parity
from tests.support.tiny_models import make_hf_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}

# The same CLI, with one muajax weight nudged after loading: transformers still reads the
# true checkpoint, so a working parity check has to notice and exit 1.
CORRUPT_ONE_WEIGHT = """
import sys
import muajax.parity as parity
load = parity.muajax_load
def corrupted(hf_dir, dtype):
    params, cfg = load(hf_dir, dtype)
    params["final_norm"] = params["final_norm"].at[0].add(0.5)
    return params, cfg
parity.muajax_load = corrupted
sys.exit(parity.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    return hf_checkpoint(seed=4)


def run_cli(args, code=None):
    cmd = [sys.executable, "-m", "muajax.parity", *args] if code is None else [sys.executable, "-c", code, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr}"
    return proc, json.loads(lines[-1])


def test_tiny_checkpoint_passes_logits_and_greedy_tokens(checkpoint):
    proc, out = run_cli([checkpoint, "--generate", "5", "--batch", "3", "--seed", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["passed"] is True and out["failures"] == []
    assert out["max_abs_logit_diff"] <= 1e-4
    assert 0 <= out["mean_kl"] < 1e-8
    assert out["tokens_match"] is True and out["token_agreement"] == 1.0
    assert (out["dtype"], out["batch"], out["generate"]) == ("float32", 3, 5)
    assert out["prompt_source"].startswith("random token ids")  # vocab 256: no tokenizer fits
    assert len(set(out["prompt_lengths"])) > 1
    assert out["positions"] == sum(out["prompt_lengths"])
    assert "PASS" in proc.stdout


def test_one_corrupted_muajax_weight_exits_1(checkpoint):
    proc, out = run_cli([checkpoint, "--batch", "2"], code=CORRUPT_ONE_WEIGHT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert out["passed"] is False
    assert out["max_abs_logit_diff"] > 1e-3
    assert "max |Δlogit|" in out["failures"][0]
    assert "FAIL" in proc.stdout


def test_splash_attention_on_long_prompts_passes(tmp_path):
    """--attention splash (Pallas interpret mode on CPU, head_dim 64) with prompts up to 700
    tokens: not a multiple of any block, so every row is padded inside the kernel's wrapper."""
    path = make_hf_checkpoint(str(tmp_path), seed=6, head_dim=64, max_position_embeddings=1024)
    proc, out = run_cli([path, "--attention", "splash", "--max-prompt-len", "700", "--generate", "3", "--batch", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["attention"] == "splash" and max(out["prompt_lengths"]) > 256
    assert out["max_abs_logit_diff"] <= 1e-4 and out["tokens_match"] is True


def test_attention_that_cannot_run_here_exits_2(checkpoint):
    for name, message in (("flash", "expected one of auto, xla, chunked, splash, cudnn"), ("cudnn", "needs a GPU")):
        with pytest.raises(parity.ParityError, match=message):
            parity.run(parity.parse_args([checkpoint, "--attention", name]))


def test_bad_directories_exit_2_with_a_clear_error(tmp_path):
    proc, out = run_cli([str(tmp_path / "missing")])
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    assert out["passed"] is False and "missing" in out["error"]
    proc, out = run_cli([str(tmp_path)])
    assert proc.returncode == 2 and "config.json: not found" in out["error"]


# ----------------------------------------------------------------------------- in-process pieces


def test_prompt_sources_fall_back_in_order(tmp_path, tokenizer):
    prompts, source = parity.make_prompts(str(tmp_path), 151936, batch=5, seed=0, max_len=24)
    assert source.startswith("bundled Qwen3 tokenizer") and "checkpoint has no tokenizer" in source
    assert len(prompts) == 5 and len({len(p) for p in prompts}) > 1

    tokenizer.save_pretrained(str(tmp_path))
    _, source = parity.make_prompts(str(tmp_path), 151936, batch=2, seed=0, max_len=24)
    assert source == "checkpoint tokenizer"

    empty = tmp_path / "empty"
    empty.mkdir()
    prompts, source = parity.make_prompts(str(empty), 300, batch=4, seed=3, max_len=12)
    assert source.startswith("random token ids, seed 3") and "exceed vocab 300" in source
    assert all(0 <= t < 300 for p in prompts for t in p) and max(map(len, prompts)) <= 12
    assert prompts == parity.make_prompts(str(empty), 300, batch=4, seed=3, max_len=12)[0]


def test_compare_logits_ignores_padding_and_measures_kl():
    rng = np.random.RandomState(0)
    ref = rng.randn(2, 3, 7).astype(np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    ours = ref.copy()
    ours[0, 2] += 100.0  # padding: must not count
    same = parity.compare_logits(ref, ours, mask)
    assert same["max_abs_logit_diff"] == 0.0 and same["mean_kl"] == 0.0 and same["positions"] == 3
    ours[1, 0, 3] += 1.0
    diff = parity.compare_logits(ref, ours, mask)
    assert diff["max_abs_logit_diff"] == pytest.approx(1.0) and diff["mean_kl"] > 1e-3


def test_compare_tokens_reports_the_first_divergence():
    ref = np.array([[1, 2, 3], [4, 5, 6]])
    assert parity.compare_tokens(ref, ref.copy())["tokens_match"] is True
    ours = ref.copy()
    ours[1, 1:] = [9, 9]
    out = parity.compare_tokens(ref, ours)
    assert out["tokens_match"] is False and out["token_agreement"] == pytest.approx(4 / 6)
    assert out["first_mismatch"] == {"prompt": 1, "step": 1, "transformers": 5, "muajax": 9}
