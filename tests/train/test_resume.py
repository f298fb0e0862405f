"""Resuming: the checks a resumed run makes before it writes anything (a checkpoint exists
for --resume, --resume=auto starts fresh without one, the saved config computes the same
thing unless --allow-config-change, the arrays fit the model, a remote user has its key),
and a restore that fails for a reason other than the checkpoint's content stops the run
with every checkpoint where it was."""
import dataclasses
import errno
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from muajax.settings.fields import config_to_dict
from muajax.config.schema import load_config
from muajax.models.qwen3 import Qwen3Config
from muajax.train.__main__ import EMBEDDED_DEFAULT
from muajax.runtime.checkpoint import Checkpointer, CheckpointReadError, finished_steps
from muajax.runtime.resume import ResumeError, abstract_train_state, may_change, math_changes
from tests.support.tiny_models import arch_override
from tests.support.toy_run import toy_config, toy_tokenizer, toy_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = ["run.stages=[grpo]", "model.hf_dir=null", "model.vocab=full", "metrics.progress_bar=false",
       arch_override(), "metrics.tensorboard=false"]
SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
             head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)


def run_train(args, timeout=300, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in env or env[k] is not None}
    full_env.update({k: v for k, v in env.items() if v is not None}, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "muajax.train", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(root):
    """Every file and directory under root with its size and mtime: to see that nothing was written."""
    out = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            out[os.path.relpath(path, root)] = (os.path.getsize(path), os.stat(path).st_mtime_ns)
    return out


def fake_checkpoint(cfg, *, arch=None, config=None, stage="grpo", step=1):
    """A real checkpoint of a TrainState of `arch` (default: the run's), recording `config`
    (default: the run's)."""
    arch = arch or dataclasses.asdict(cfg.model.arch)
    abstract = abstract_train_state(Qwen3Config(**arch), getattr(cfg, stage))
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    with Checkpointer(os.path.join(cfg.checkpoint_dir, stage)) as ck:
        ck.save(step, state, config=config if config is not None else config_to_dict(cfg), force=True)


def test_resume_without_a_checkpoint_exits_2_and_writes_nothing(tmp_path):
    result = run_train([*CLI, f"run.out_dir={tmp_path}", "--resume"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "muajax.train: cannot resume: --resume: there is no checkpoint in" in result.stderr
    assert "--resume=auto" in result.stderr and "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_a_changed_config_names_the_keys_that_change_the_math(tmp_path):
    overrides = [*CLI, f"run.out_dir={tmp_path}"]
    cfg = load_config(EMBEDDED_DEFAULT, overrides)
    saved = config_to_dict(cfg)
    saved["run"]["seed"] = 7
    saved["rollout"]["n_per_task"] = 4
    saved["grpo"]["learning_rate"] = 3e-6
    saved["metrics"]["jsonl"] = False  # reporting, checkpoint cadence, eval: may change
    saved["checkpoint"]["every_steps"] = 1
    saved["eval"]["trials"] = 9
    fake_checkpoint(cfg, arch=SMALL, config=saved)
    before = snapshot(tmp_path)
    result = run_train([*overrides, "--resume"])
    assert result.returncode == 2, result.stderr[-2000:]
    err = result.stderr
    assert "the run config differs from the checkpoint's in keys that change the math" in err
    for line in ("run.seed: 7 in grpo step 1, now 0", "rollout.n_per_task: 4 in grpo step 1, now 8",
                 "grpo.learning_rate: 3e-06 in grpo step 1, now 0.0001"):
        assert line in err, err
    assert "metrics." not in err and "checkpoint.every" not in err and "eval.trials" not in err
    assert "--allow-config-change" in err and "Traceback" not in err
    assert snapshot(tmp_path) == before

    # allowed, the config goes through; then the arrays (saved for another model) do not fit
    result = run_train([*overrides, "--resume", "--allow-config-change"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "keys that change the math" not in result.stderr
    assert "leaf .params['embed'] was saved with shape (64, 16), the run asks for (151936, 32)" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("arch, message", [
    ({**SMALL, "vocab_size": 54, "hidden_size": 32, "head_dim": 16, "intermediate_size": 64},
     r"leaf .params\['embed'\] was saved with shape \(54, 32\), the run asks for \(\d+, 32\)"),
    ({"tie_word_embeddings": False},  # a head the run's tied model does not have
     r"different tree than the run asks for: saved but not requested \[.*\"\.params\['lm_head'\]\"\], "
     r"requested but not saved \[\]"),
    ({"num_layers": 2}, r"leaf .params\['layers'\]\['\w+'\] was saved with shape \(2, "),
])
def test_a_checkpoint_that_does_not_fit_stops_before_any_file_is_written(tmp_path, arch, message):
    cfg = toy_config(tmp_path)
    vocab = toy_tokenizer().vocab.padded_size()
    fake_checkpoint(cfg, arch={**dataclasses.asdict(cfg.model.arch), "vocab_size": vocab, **arch})
    before = snapshot(tmp_path)
    with pytest.raises(ResumeError, match=message + r".*saved for another model or optimizer"):
        toy_trainer(cfg, resume=True)
    assert snapshot(tmp_path) == before


def test_the_math_keys():
    allowed = ["run.out_dir", "run.name", "run.gpu_memory_fraction", "checkpoint.every_steps", "checkpoint.dir", "metrics.tensorboard",
               "eval.trials", "env.eval_split", "mesh.fsdp", "model.remat", "model.attention",
               "grpo.microbatch_size", "grpo.logits_chunk", "sft.microbatch_size", "rollout.num_slots",
               "user.base_url", "user.timeout_s", "grpo.max_consecutive_skips", "sft.max_consecutive_skips",
               "rollout.kv_cache_tokens", "rollout.page_size", "rollout.attention", "rollout.mesh",
               "rollout.mesh.tensor", "rollout.keep_kv_pool", "rollout.deterministic"]
    math = ["run.seed", "run.stages", "model.arch.hidden_size", "model.param_dtype", "model.hf_dir", "model.vocab",
            "env.domain", "env.builtin_seed", "env.train_split", "user.model", "user.temperature", "user.kind",
            "rollout.n_per_task", "rollout.tasks_per_step", "rollout.temperature", "rollout.max_context",
            "grpo.learning_rate", "grpo.steps", "grpo.kl_coef", "grpo.reference_dtype", "sft.data", "sft.batch_size", "sft.epochs",
            "checkpointing.every_steps"]  # a key this list does not know changes the math
    assert [k for k in allowed if not may_change(k)] == []
    assert [k for k in math if may_change(k)] == []
    saved = {"run": {"seed": 0, "name": "a"}, "model": {"arch": {"hidden_size": 32}}, "grpo": {"steps": 2}}
    new = {"run": {"seed": 0, "name": "b"}, "model": {"arch": None}, "grpo": {"steps": 2, "new_key": 1}}
    assert math_changes(saved, new) == [("grpo.new_key", "(absent)", 1), ("model.arch", "(absent)", None),
                                        ("model.arch.hidden_size", 32, "(absent)")]
    # a key added to muajax after the checkpoint was written is no change at its default value
    # (what the run did before the key existed), and is one at any other
    defaults = {"grpo": {"new_key": 1, "steps": 1}}
    assert ("grpo.new_key", "(absent)", 1) not in math_changes(saved, new, defaults)
    assert ("grpo.new_key", "(absent)", 2) in math_changes(saved, {**new, "grpo": {"steps": 2, "new_key": 2}}, defaults)


def test_a_remote_user_without_its_key_exits_2_before_writing(tmp_path):
    result = run_train([*CLI, f"run.out_dir={tmp_path}", "user.kind=openai", "user.model=gpt-test",
                        "user.base_url=https://api.example.invalid/v1", "user.api_key_env=MUAJAX_TEST_UNSET_KEY"],
                       MUAJAX_TEST_UNSET_KEY=None)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "muajax.train: config error: user.api_key_env: the user simulator at https://api.example.invalid/v1 " \
           "needs an API key: set the environment variable MUAJAX_TEST_UNSET_KEY" in result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ on a real (toy) run

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A toy run of 2 GRPO steps with checkpoints at steps 1 and 2."""
    cfg = toy_config(tmp_path_factory.mktemp("toy"))
    trainer = toy_trainer(cfg)
    assert trainer.ctx.resume is False
    figures = trainer.run()
    assert finished_steps(os.path.join(cfg.checkpoint_dir, "grpo")) == [1, 2]
    return cfg, figures


def copy_run(trained, tmp_path, *overrides):
    cfg, figures = trained
    shutil.copytree(cfg.run.out_dir, tmp_path, dirs_exist_ok=True)
    return toy_config(tmp_path, *overrides), figures


def test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one(tmp_path, trained, capsys):
    fresh = toy_trainer(toy_config(tmp_path / "empty"), resume="auto")
    assert fresh.ctx.resume is False
    assert "no checkpoint in" in capsys.readouterr().out
    cfg, figures = copy_run(trained, tmp_path / "copy", "grpo.steps=3")
    with pytest.raises(ResumeError, match=r"grpo.steps: 2 in grpo step 2, now 3"):
        toy_trainer(cfg, resume="auto")  # the schedule's length is part of the math
    again = toy_trainer(cfg, resume="auto", allow_config_change=True)
    assert again.ctx.resume is True
    resumed = again.run()
    assert "[grpo] resumed at step 2" in capsys.readouterr().out
    assert finished_steps(os.path.join(cfg.checkpoint_dir, "grpo")) == [1, 2, 3]
    assert resumed["params_sha256"] != figures["params_sha256"]


def test_a_restore_that_fails_with_an_io_error_stops_the_run_and_moves_nothing(tmp_path, trained, monkeypatch):
    cfg, _ = copy_run(trained, tmp_path)
    stage_dir = os.path.join(cfg.checkpoint_dir, "grpo")
    before = snapshot(stage_dir)
    real = ocp.CheckpointManager.restore

    def failing_restore(self, step, args=None, **kwargs):
        if "state" in args.keys():
            raise OSError(errno.EIO, "Input/output error", os.path.join(stage_dir, str(step), "state"))
        return real(self, step, args=args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing_restore)
    trainer = toy_trainer(cfg, resume=True)
    with pytest.raises(CheckpointReadError, match=r"/grpo/2: reading the arrays failed with an error that is not "
                                                  r"about the checkpoint's content \(OSError: \[Errno 5\]"):
        trainer.run()
    assert finished_steps(stage_dir) == [1, 2]
    assert not os.path.exists(os.path.join(stage_dir, "corrupt"))
    assert snapshot(stage_dir) == before


def test_main_maps_stops_to_exit_codes(monkeypatch, tmp_path, capsys):
    from muajax.train import __main__ as cli
    from muajax.train.loop import TrainingStopped

    for error in (CheckpointReadError("ckpt/grpo/2: reading the arrays failed"), TrainingStopped("stopped at step 4")):
        class Failing:
            def __init__(self, cfg, **kwargs):
                pass

            def run(self):
                raise error

        monkeypatch.setattr(cli, "Trainer", Failing)
        assert cli.main([*CLI, f"run.out_dir={tmp_path}"]) == 1
        captured = capsys.readouterr()
        assert str(error) in captured.err and "params_sha256" not in captured.out


def test_a_checkpoint_from_before_a_key_existed_resumes_while_the_key_holds_its_default():
    """Upgrading muajax between a save and its resume adds keys the saved config lacks: at
    their defaults they change nothing, so the resume goes on; set otherwise, it is refused."""
    import dataclasses

    from muajax.config.schema import TrainConfig
    from muajax.runtime.resume import _check_config
    from muajax.settings.fields import config_to_dict

    saved = config_to_dict(TrainConfig())
    del saved["grpo"]["kl_coef"]  # as if written by a muajax that did not have the key
    _check_config(TrainConfig(), {"grpo": (3, {"config": saved})})
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, kl_coef=cfg.grpo.kl_coef + 0.5))
    with pytest.raises(ResumeError, match="grpo.kl_coef"):
        _check_config(cfg, {"grpo": (3, {"config": saved})})
