"""What a resumed run checks before it writes anything: that there is a checkpoint, that
the saved run config computes the same thing as the new one, and that the checkpoint's
arrays fit the model and optimizer the new config builds.

The keys that may differ (`MAY_CHANGE`) are those that do not change what the run
computes in exact arithmetic:
- where files go and what is reported: `run.name`, `run.out_dir`, `checkpoint.*`,
  `metrics.*`, `eval.*`, `env.eval_split`;
- how much of each GPU jax may take: `run.gpu_memory_fraction`;
- how the same computation is laid out on the machine: `mesh.*` (orbax reshards on
  restore), `model.remat`, `model.attention` (the same function, another kernel),
  `grpo.microbatch_size`, `grpo.logits_chunk`, `sft.microbatch_size` (the same gradient
  in other pieces), and the rollout engine's `rollout.num_slots`, `rollout.tool_workers`,
  `rollout.overlap_io`, `rollout.user_timeout_s`, its pool, pages, kernel and layout
  (`rollout.kv_cache_tokens`, `rollout.kv_cache_share`, `rollout.page_size`,
  `rollout.attention`, `rollout.mesh`, `rollout.keep_kv_pool`) and its fixed-shape calls
  (`rollout.deterministic`). These may change float rounding, not the method; a
  bitwise-equal continuation needs them unchanged too;
- how the simulated user is reached and paced: `user.base_url`, `user.api_key_env`,
  `user.timeout_s`, `user.max_retries`, `user.max_concurrency`, `user.requests_per_minute`,
  `user.tokens_per_minute`, `user.turn_timeout_s`;
- the stop guards: `grpo.max_consecutive_skips`, `sft.max_consecutive_skips`.

Every other key changes the math and stops a resume, naming the keys, unless the run is
started with `--allow-config-change`: the model (`model.*` else: preset, hf_dir, arch,
dtypes, logits_fp32, vocab), the seed and stages (`run.seed`, `run.stages`), the data
(`env.*` else, `sft.data`, `sft.expert_careless`), the batch and sampling (`rollout.*`
else: n_per_task, tasks_per_step, max_turns, max_new_tokens_per_turn, max_context,
temperature, top_p, top_k, end_on_malformed_call, communicate_info, system_text), the
simulated user's behaviour (`user.kind`, `user.model`, `user.temperature`), and the
optimizer, loss and schedule (`grpo.*`, `sft.*` else, steps and epochs included: they
set the schedule's length). A key present on one side only counts as changed. A new key
is thereby math until listed here: the safe default.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from muajax.settings.fields import _short, config_to_dict
from muajax.config.schema import TrainConfig
from muajax.rl.optim import optimizer_from_config
from muajax.rl.step import TrainState, model_abstract_params
from muajax.runtime.checkpoint import finished_steps, read_metadata
from muajax.runtime.checkpoint_records import CheckpointLayoutError, check_layout

STAGES = ("sft", "grpo")
MAY_CHANGE = ("run.name", "run.out_dir", "run.gpu_memory_fraction", "checkpoint.", "metrics.", "eval.",
              "env.eval_split", "mesh.",
              "model.remat", "model.attention", "grpo.microbatch_size", "grpo.logits_chunk", "sft.microbatch_size",
              "rollout.num_slots", "rollout.tool_workers", "rollout.overlap_io", "rollout.user_timeout_s",
              "rollout.kv_cache_tokens", "rollout.kv_cache_share", "rollout.page_size", "rollout.attention",
              "rollout.mesh", "rollout.mesh.", "rollout.keep_kv_pool", "rollout.deterministic", "rollout.call_layout",
              "rollout.extend_tile", "rollout.decode_tile",
              "user.base_url", "user.api_key_env", "user.timeout_s", "user.max_retries", "user.max_concurrency",
              "user.requests_per_minute", "user.tokens_per_minute", "user.turn_timeout_s",
              "user.latency_s", "user.latency_jitter", "user.latency_distribution", "user.latency_seed",
              "grpo.max_consecutive_skips", "sft.max_consecutive_skips", "rollout.max_failed_share")
_ABSENT = "(absent)"


class ResumeError(ValueError):
    """A resume that cannot go on; the message says why and what to do."""


@dataclasses.dataclass
class ResumePlan:
    resume: bool  # restore the stages' checkpoints
    latest: dict[str, tuple[int, dict]]  # stage -> (newest step whose metadata reads, its metadata)


def resume_mode(resume: bool | str | None) -> str:
    """False/None -> "no", True/"required" -> "required", "auto" -> "auto"."""
    if resume in (False, None, "no"):
        return "no"
    if resume in (True, "required"):
        return "required"
    if resume == "auto":
        return "auto"
    raise ValueError(f"resume must be False, True, 'required' or 'auto', got {resume!r}")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}


def may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE)


def math_changes(saved: Mapping, new: Mapping, defaults: Mapping | None = None) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for each key that differs and changes the math.
    With `defaults` (a whole config's default values): a key the saved config does not have
    (added to muajax after the checkpoint) is no change while it holds its default, the value
    that keeps what the run did before the key existed."""
    old, now = _flatten(saved), _flatten(new)
    default = _flatten(defaults) if defaults is not None else {}

    def new_at_default(key):
        return key not in old and key in default and now.get(key, _ABSENT) == default[key]

    return [(key, old.get(key, _ABSENT), now.get(key, _ABSENT)) for key in sorted(set(old) | set(now))
            if old.get(key, _ABSENT) != now.get(key, _ABSENT) and not may_change(key) and not new_at_default(key)]


def _latest_metadata(directory: str) -> tuple[int, dict] | None:
    """The newest step whose metadata reads (a corrupt one is the restore's business)."""
    for step in reversed(finished_steps(directory)):
        try:
            return step, read_metadata(directory, step)
        except (OSError, ValueError):
            continue
    return None


def _check_config(cfg: TrainConfig, latest: dict[str, tuple[int, dict]]) -> None:
    new = config_to_dict(cfg)
    problems = []
    for stage, (step, meta) in latest.items():
        saved = meta.get("config")
        if not isinstance(saved, Mapping):
            problems.append(f"{stage} step {step} records no run config to compare with")
            continue
        for key, was, now in math_changes(saved, new, config_to_dict(TrainConfig())):
            problems.append(f"{key}: {_short(was)} in {stage} step {step}, now {_short(now)}")
    if problems:
        listing = "\n  ".join(dict.fromkeys(problems))
        raise ResumeError(f"the run config differs from the checkpoint's in keys that change the math:\n  {listing}\n"
                          "a resumed run would not continue the saved one. Resume with the saved values, or pass "
                          "--allow-config-change to go on with the new ones.")


def plan_resume(cfg: TrainConfig, resume: bool | str | None, *, allow_config_change: bool = False,
                tokenizer_given: bool = False) -> ResumePlan:
    """Decide whether the run restores checkpoints, reading files only. Raises ResumeError
    for `--resume` without a checkpoint, a config that changes the math (unless
    `allow_config_change`), or a domain vocabulary that is gone."""
    mode = resume_mode(resume)
    if mode == "no":
        return ResumePlan(False, {})
    dirs = {stage: os.path.join(cfg.checkpoint_dir, stage) for stage in STAGES}
    if not any(finished_steps(d) for d in dirs.values()):
        if mode == "required":
            raise ResumeError(f"--resume: there is no checkpoint in {cfg.checkpoint_dir} to resume from. Run "
                              "without --resume to start this run, or with --resume=auto to resume when there is "
                              "a checkpoint and start fresh when there is none.")
        print(f"[resume] no checkpoint in {cfg.checkpoint_dir}: starting fresh (--resume=auto)", flush=True)
        return ResumePlan(False, {})
    latest = {stage: found for stage, d in dirs.items() if (found := _latest_metadata(d)) is not None}
    if not allow_config_change:
        _check_config(cfg, latest)
    vocab = os.path.join(cfg.run_dir, "vocab.json")
    if cfg.model.vocab == "domain" and cfg.model.hf_dir is None and not tokenizer_given and not os.path.isfile(vocab):
        raise ResumeError(f"{vocab} is missing: the checkpoints in {cfg.checkpoint_dir} use the token ids it "
                          "recorded, and a vocabulary built again may number them differently. Restore the file, "
                          "or start a new run.")
    return ResumePlan(True, latest)


def abstract_train_state(model_cfg, stage_cfg) -> TrainState:
    """The shapes and tree of a stage's TrainState, nothing allocated."""
    params = model_abstract_params(model_cfg)
    # The optimizer state's tree does not depend on the schedule's length: any will do.
    optimizer = optimizer_from_config(stage_cfg, total_steps=10**9)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return TrainState(scalar, params, jax.eval_shape(optimizer.tx.init, params), scalar)


def check_checkpoint_layouts(cfg: TrainConfig, model_cfg, plan: ResumePlan) -> None:
    """Each stage's newest checkpoint has the leaves and shapes the run will ask for."""
    for stage, (step, meta) in plan.latest.items():
        if stage not in cfg.run.stages or not isinstance(meta.get("leaves"), list):
            continue
        where = f"checkpoint {os.path.join(cfg.checkpoint_dir, stage, str(step))}"
        try:
            check_layout(meta["leaves"], abstract_train_state(model_cfg, getattr(cfg, stage)), where)
        except CheckpointLayoutError as exc:
            raise ResumeError(f"{exc}. It was saved for another model or optimizer than this config builds; "
                              "resume with the config it was saved with, or start a new run.") from None
