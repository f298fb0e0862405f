"""`python -m muajax.train`: config errors, the SFT mask, GRPO learning, kill -9 and resume."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from muajax.config.schema import load_config
from muajax.models.vocab import DomainTokenizer, DomainVocab
from muajax.domains.base import Domain
from muajax.train.trainer import Trainer
from tests.support.tiny_models import arch_override
from tests.support.toy_domain import SayYesEnvironment, StopUser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_train(args, timeout=600, **popen):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "muajax.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)


@pytest.mark.parametrize("override, message", [
    ("grpo.lr=1e-5", "unknown key 'grpo.lr' (did you mean 'grpo.learning_rate'?)"),
    ("rollout.top_p=1.5", "'rollout.top_p' must be in (0, 1]"),
    ("grpo.kl_estimator=k9", "grpo.kl_estimator"),
    ("mesh.data=0", "mesh.data"),
])
def test_config_errors_stop_before_anything_compiles(override, message):
    start = time.time()
    result = run_train([override], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert time.time() - start < 60  # no model was built


def test_missing_config_file_is_reported():
    result = run_train(["--config", "no/such/file.yaml"], timeout=120)
    assert result.returncode == 2 and "no/such/file.yaml" in result.stderr



def test_short_grpo_run_raises_reward_on_a_learnable_task(tmp_path, capsys, tokenizer):
    base = tokenizer
    words = [base.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", " maybe", " ok", ".", "!")]
    prompt_ids = base.encode("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nSay yes or no.<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tok = DomainTokenizer(base, DomainVocab(words + prompt_ids))
    cfg = load_config(None, [
        f"run.out_dir={tmp_path}", "run.stages=[grpo]", "model.vocab=domain",
        arch_override(max_position_embeddings=256),
        "rollout.n_per_task=8", "rollout.tasks_per_step=4", "rollout.max_new_tokens_per_turn=4",
        "rollout.max_context=128", "rollout.max_turns=2", "grpo.steps=10", "grpo.learning_rate=3e-2",
        "grpo.kl_coef=0", "metrics.progress_bar=false", "metrics.tensorboard=false", "checkpoint.every_steps=100",
        "eval.max_tasks=4"])
    trainer = Trainer(cfg, domain=Domain(SayYesEnvironment(), StopUser()), tokenizer=tok)
    summary = trainer.run()
    records = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    rewards = [r["reward"] for r in records]
    assert len(rewards) == 10
    # the first pass is on-policy: the trainer's logprobs are the engine's (float32, to rounding)
    assert all(r["first_pass/ratio_abs_dev"] < 1e-4 and r["first_pass/clip_frac"] == 0 for r in records), records
    assert records[0]["time/compile_s"] > 0 and all(r["time/step_s"] > 0 for r in records)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.25, rewards
    assert summary["heldout_success_grpo"] >= 0.75, summary
    # the report reads what the trainer wrote
    from muajax import report

    png = os.path.join(str(tmp_path), "dynamics.png")
    assert report.main([cfg.run_dir, "--out", png]) == 0 and os.path.getsize(png) > 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["figures"]
    assert (figures["reward"]["first"], figures["reward"]["last"]) == (rewards[0], rewards[-1])



TINY_RUN = [
    "run.stages=[grpo]", "model.hf_dir=null", arch_override(), "model.vocab=domain",
    "rollout.n_per_task=2", "rollout.tasks_per_step=2", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12",
    "rollout.max_context=1536", "grpo.steps=4", "grpo.learning_rate=1e-3", "grpo.microbatch_size=null",
    "checkpoint.every_steps=1",
    "checkpoint.keep=2", "eval.max_tasks=2", "metrics.progress_bar=false", "metrics.tensorboard=false",
]


def final_summary(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


TINY_SFT = [
    "run.stages=[sft]", "model.hf_dir=null", arch_override(), "model.vocab=domain",
    "sft.steps=6", "sft.batch_size=2", "sft.max_len=1024", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12",
    "rollout.max_context=1536", "checkpoint.every_steps=1", "checkpoint.keep=2", "eval.max_tasks=1",
    "metrics.progress_bar=false", "metrics.tensorboard=false", "env.builtin_train_tasks=24", "env.builtin_test_tasks=4",
]


def kill_at_checkpoint(args, stage: str, step: int, run_dir):
    """Start a run and kill -9 it (its whole process group) once `stage` has finished
    checkpoint `step`; fails if the run ends first."""
    proc = subprocess.Popen([sys.executable, "-m", "muajax.train", *args], cwd=ROOT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    killed = False
    while time.time() < deadline and proc.poll() is None:
        # a fixed-depth glob: rglob would walk orbax's temporary directories while they are renamed
        if any(p.is_dir() for p in run_dir.glob(f"*/checkpoints/{stage}/{step}")):
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    proc.wait()
    assert killed, "the run finished or timed out before a checkpoint to kill at"


def resumed_step(stdout: str, stage: str) -> int:
    match = re.search(rf"\[{stage}\] resumed at step (\d+)", stdout)
    assert match, stdout[-2000:]
    return int(match.group(1))


@pytest.mark.parametrize("stage, config, total", [("grpo", TINY_RUN, 4), ("sft", TINY_SFT, 6)])
def test_kill9_then_resume_equals_an_uninterrupted_run(tmp_path, stage, config, total):
    straight = run_train([*config, f"run.out_dir={tmp_path / 'a'}"], timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    want = final_summary(straight.stdout)
    if stage == "grpo":
        assert "[grpo] step 4/4: reward " in straight.stderr  # no terminal, no bar: a line per step instead

    run_dir = tmp_path / "b"
    args = [*config, f"run.out_dir={run_dir}"]
    kill_at_checkpoint(args, stage, 2, run_dir)
    resumed = run_train([*args, "--resume"], timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the kill came mid-way: the run went on from a checkpoint before the last one
    assert 0 < resumed_step(resumed.stdout, stage) < total
    got = final_summary(resumed.stdout)
    assert got["params_sha256"] == want["params_sha256"]
