"""`python -m muajax.train`: config errors, the SFT mask, GRPO learning, kill -9 and resume."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from muajax.chat import system_prompt_ids, render_messages_ids
from muajax.config import load_config
from muajax.envs.base import Environment, EnvSession, Evaluation, Observation, Task
from muajax.models.tokenizer import IM_END_ID, IM_START_ID, PAD_ID, load_tokenizer
from muajax.models.vocab import DomainTokenizer, DomainVocab
from muajax import runtime
from muajax.trainer import Trainer, _sft_batch, params_fingerprint
from muajax.users.base import STOP, UserSession, UserSimulator, UserTurn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(args, timeout=600, **popen):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "muajax.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)


@pytest.mark.parametrize("override, message", [
    ("grpo.lr=1e-5", "unknown key 'grpo.lr' (did you mean 'grpo.learning_rate'?)"),
    ("rollout.top_p=1.5", "'rollout.top_p' must be <= 1"),
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


def test_sft_loss_mask_covers_exactly_the_assistant_tokens():
    from muajax.envs.builtin import BuiltinEnvironment
    from muajax.envs.builtin.expert import expert_conversation

    tok = load_tokenizer()
    env = BuiltinEnvironment()
    task = env.tasks("train")[1]
    messages, _ = expert_conversation(env, task, careless=0.0, seed=0)
    tools = env.reset(task).tools()
    ids, mask = render_messages_ids(tok, env.policy(), tools, messages)
    batch = _sft_batch([(ids, mask)], PAD_ID, 4096)
    tokens, loss_mask = batch["tokens"][0], batch["loss_mask"][0]
    assert loss_mask[len(ids):].sum() == 0 and (tokens[len(ids):] == PAD_ID).all()
    # every masked span is one assistant message followed by its <|im_end|>, nothing else
    spans, start = [], None
    for i, m in enumerate(list(loss_mask[: len(ids)]) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    for (a, b), message in zip(spans, assistants):
        assert tokens[b - 1] == IM_END_ID
        assert tokens[a - 1] != IM_START_ID  # preceded by the generation prompt's empty think block
        text = tok.decode(tokens[a: b - 1])
        if message.get("tool_calls"):
            assert message["tool_calls"][0]["function"]["name"] in text and "<tool_call>" in text
        else:
            assert text == message["content"]
    # with a context weight, every other token after the system prompt gets that weight
    prefix = len(system_prompt_ids(tok, env.policy(), tools))
    weighted = _sft_batch([(ids, mask)], PAD_ID, 4096, context_weight=0.5, context_start=prefix)
    assert (weighted["loss_mask"] == batch["loss_mask"]).all()
    context = weighted["context_mask"][0]
    assert (context[:prefix] == 0).all() and (context[len(ids):] == 0).all()
    assert (context[: len(ids)][loss_mask[: len(ids)] == 1] == 0).all()
    assert (context[prefix: len(ids)][loss_mask[prefix: len(ids)] == 0] == 0.5).all()


# --------------------------------------------------------------------------- a task a tiny model can learn


class _SayYesSession(EnvSession):
    def __init__(self, task):
        self.task = task

    def tools(self):
        return []

    def step(self, call):
        return Observation("Error: no tools here", error=True)

    def evaluate(self, messages, *, communicate_info):
        said = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
        first = said[0] if said else ""
        ok = "yes" in first and "no" not in first
        return Evaluation(float(ok), float(ok))


class SayYesEnvironment(Environment):
    """Reward 1 when the agent's first reply says "yes" and not "no"."""

    name = "say-yes"

    def policy(self):
        return "Answer."

    def tasks(self, split):
        return [Task(f"{split}-{i}", self.name, "Say yes or no.", "") for i in range(4)]

    def reset(self, task):
        return _SayYesSession(task)


class _StopSession(UserSession):
    async def reply(self, agent_message):
        return UserTurn(f"Bye. {STOP}", end=STOP)


class StopUser(UserSimulator):
    def start(self, task, env=None):
        return _StopSession()


def test_short_grpo_run_raises_reward_on_a_learnable_task(tmp_path, capsys):
    base = load_tokenizer()
    words = [base.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", " maybe", " ok", ".", "!")]
    prompt_ids = base.encode("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nSay yes or no.<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tok = DomainTokenizer(base, DomainVocab(words + prompt_ids))
    cfg = load_config(None, [
        f"run.out_dir={tmp_path}", "run.stages=[grpo]", "model.vocab=domain",
        "model.arch={hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1,"
        " head_dim: 16, max_position_embeddings: 256}",
        "rollout.n_per_task=8", "rollout.tasks_per_step=4", "rollout.max_new_tokens_per_turn=4",
        "rollout.max_context=128", "rollout.max_turns=2", "grpo.steps=10", "grpo.learning_rate=3e-2",
        "grpo.kl_coef=0", "metrics.progress_bar=false", "metrics.tensorboard=false", "checkpoint.every_steps=100",
        "eval.max_tasks=4"])
    trainer = Trainer(cfg, env=SayYesEnvironment(), user=StopUser(), tokenizer=tok)
    summary = trainer.run()
    rewards = [json.loads(line)["reward"] for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    assert len(rewards) == 10
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.25, rewards
    assert summary["heldout_success_grpo"] >= 0.75, summary
    # the report reads what the trainer wrote
    from muajax import report

    png = os.path.join(str(tmp_path), "dynamics.png")
    assert report.main([cfg.run_dir, "--out", png]) == 0 and os.path.getsize(png) > 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["figures"]
    assert (figures["reward"]["first"], figures["reward"]["last"]) == (rewards[0], rewards[-1])


def test_copy_warmup_teaches_copying_and_is_seeded(tmp_path, capsys):
    base = load_tokenizer()
    tok = DomainTokenizer(base, DomainVocab(range(1000, 1200)))
    overrides = [f"run.out_dir={tmp_path}", "model.vocab=domain",
                 "model.arch={hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 2, num_kv_heads: 1,"
                 " head_dim: 64, max_position_embeddings: 256}",
                 "sft.copy_warmup_steps=120", "sft.copy_warmup_length=64", "sft.batch_size=8",
                 "sft.learning_rate=3e-3", "sft.warmup_ratio=0.1", "rollout.max_context=256", "rollout.max_new_tokens_per_turn=16",
                 "metrics.progress_bar=false"]
    trainer = Trainer(load_config(None, overrides), env=SayYesEnvironment(), user=StopUser(), tokenizer=tok)
    params = runtime.initial_params(trainer.model_cfg, None, trainer.mesh, 0)
    warmed = trainer.copy_warmup(params)
    nll = trainer.summary["copy_warmup_nll"]
    assert nll < 2.5, nll  # uniform would be ln(200) = 5.3: the repeated span is being copied
    assert "copy warm-up: 120 steps" in capsys.readouterr().out
    again = Trainer(load_config(None, overrides), env=SayYesEnvironment(), user=StopUser(), tokenizer=tok)
    assert params_fingerprint(again.copy_warmup(params)) == params_fingerprint(warmed)
    off = Trainer(load_config(None, [o for o in overrides if not o.startswith("sft.copy_warmup_steps")]), env=SayYesEnvironment(), user=StopUser(), tokenizer=tok)
    assert off.copy_warmup(params) is params


def test_domain_warmup_learns_its_windows_is_seeded_and_needs_the_builtin_domain(tmp_path, capsys):
    import re

    from muajax.config import ConfigError

    overrides = [f"run.out_dir={tmp_path}", "run.stages=[sft]", "model.vocab=domain",
                 "model.arch={hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1,"
                 " head_dim: 16, max_position_embeddings: 2048}",
                 "env.builtin_users=12", "env.builtin_test_users=2", "env.builtin_train_tasks=20",
                 "env.builtin_test_tasks=4", "sft.domain_warmup_steps=30", "sft.domain_warmup_shops=1",
                 "sft.domain_warmup_batch_size=16", "sft.learning_rate=1e-2", "sft.warmup_ratio=0.1",
                 "rollout.max_context=1024", "rollout.max_new_tokens_per_turn=16", "metrics.progress_bar=false"]
    trainer = Trainer(load_config(None, overrides))
    # the run's vocabulary covers the other shops' windows: no id of theirs maps to UNK
    unk = trainer.tok.vocab.unk_id
    windows = runtime.warmup_windows(trainer.cfg)
    assert len(windows) > 100
    assert all(unk not in render_messages_ids(trainer.tok, None, None, w)[0] for w in windows)
    params = runtime.initial_params(trainer.model_cfg, None, trainer.mesh, 0)
    warmed = trainer.domain_warmup(params)
    first, last = map(float, re.search(r"assistant nll ([\d.]+) -> ([\d.]+)", capsys.readouterr().out).groups())
    # means of the first and last 15 steps: from ~ln(vocab) to the calls' fixed format and beyond
    assert last < 0.65 * first, (first, last)
    again = Trainer(load_config(None, overrides), tokenizer=trainer.tok)
    assert params_fingerprint(again.domain_warmup(params)) == params_fingerprint(warmed)
    off = Trainer(load_config(None, [o for o in overrides if not o.startswith("sft.domain_warmup_steps")]),
                  tokenizer=trainer.tok)
    assert off.domain_warmup(params) is params
    with pytest.raises(ConfigError, match="sft.domain_warmup_steps"):
        load_config(None, ["env.domain=retail", "sft.data=x.jsonl", "sft.domain_warmup_steps=10"])


# --------------------------------------------------------------------------- kill -9, then resume


TINY_RUN = [
    "run.stages=[grpo]", "model.hf_dir=null", "model.arch={hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2,"
    " num_kv_heads: 1, head_dim: 16, max_position_embeddings: 2048}", "model.vocab=domain",
    "rollout.n_per_task=2", "rollout.tasks_per_step=2", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12",
    "rollout.max_context=1536", "grpo.steps=4", "grpo.learning_rate=1e-3", "grpo.microbatch_size=null",
    "checkpoint.every_steps=1",
    "checkpoint.keep=2", "eval.max_tasks=2", "metrics.progress_bar=false", "metrics.tensorboard=false",
]


def final_summary(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def test_kill9_then_resume_equals_an_uninterrupted_run(tmp_path):
    straight = run_train([*TINY_RUN, f"run.out_dir={tmp_path / 'a'}"], timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    want = final_summary(straight.stdout)
    assert "[grpo] step 4/4: reward " in straight.stderr  # no terminal, no bar: a line per step instead

    run_dir = tmp_path / "b"
    args = [*TINY_RUN, f"run.out_dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "muajax.train", *args], cwd=ROOT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    killed = False
    while time.time() < deadline and proc.poll() is None:
        found = [p for p in run_dir.rglob("checkpoints/grpo/2") if p.is_dir()]
        if found:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.2)
    proc.wait()
    assert killed, "the run finished or timed out before a checkpoint to kill at"
    resumed = run_train([*args, "--resume"], timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[grpo] resumed at step" in resumed.stdout
    got = final_summary(resumed.stdout)
    assert got["params_sha256"] == want["params_sha256"]
