"""The model a run config trains and the prompt its conversations share, without its
checkpoint: what a plan needs.

The trainer reads the architecture from `model.hf_dir`'s config.json (or a preset, or the
inline `arch`) and applies the run's dtypes, remat and attention (`muajax.runtime.build.
model_and_tokenizer`). A plan does the same, except that a checkpoint folder need not
exist where one plans: a missing `hf_dir` whose name is a preset's (checkpoints/Qwen3-32B
-> qwen3-32b) plans that preset, and says so. An inline `arch` with a domain vocabulary gets
the vocabulary's size from the domain, as the trainer builds it (nothing is written: the
run directory's vocab.json is read if it is there).

`domain_facts` builds the run's environment (not its user: no API key) and measures what
the trainer measures there: the system prompt its training conversations share
(`muajax.runtime.grpo_layout.system_prompt_prefix`), so that a plan shares it (or not) by
the trainer's rule, and the evaluation's conversations, which the engine has slots for.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import tempfile

from muajax.config.schema import TrainConfig
from muajax.models.hf import load_config
from muajax.models.presets import UnknownPresetError, preset_config
from muajax.domains.registry import make_environment
from muajax.models.qwen3 import Qwen3Config
from muajax.models.tokenizer import load_tokenizer
from muajax.models.vocab import checkpoint_tokenizer
from muajax.runtime import build, run_tasks
from muajax.runtime.grpo_layout import system_prompt_prefix


def run_dtypes(cfg: TrainConfig) -> dict:
    m = cfg.model
    return dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat, attention=m.attention,
                logits_fp32=m.logits_fp32)


def model_from_config(cfg: TrainConfig) -> tuple[Qwen3Config, str, str]:
    """(model config, label, where the architecture came from)."""
    m, dtypes = cfg.model, run_dtypes(cfg)
    if m.preset:
        return preset_config(m.preset, **dtypes), m.preset, f"preset {m.preset}"
    if m.hf_dir:
        if os.path.isfile(os.path.join(m.hf_dir, "config.json")):
            return load_config(m.hf_dir, **dtypes), os.path.basename(m.hf_dir.rstrip("/")), f"{m.hf_dir}/config.json"
        name = os.path.basename(m.hf_dir.rstrip("/")).lower()
        try:
            model = preset_config(name, **dtypes)
        except UnknownPresetError:
            raise SystemExit(f"plan: model.hf_dir {m.hf_dir!r} has no config.json here and {name!r} is no preset: "
                             f"plan with --model, or override model.preset") from None
        return model, name, f"preset {name} ({m.hf_dir} is not here; its name is that preset's)"
    if m.vocab == "domain":  # its size is only known once built from the domain's texts
        model = domain_vocabulary_model(cfg)
        return model, "arch", f"the config's inline model.arch, vocabulary of {model.vocab_size} from the domain"
    return Qwen3Config(**dataclasses.asdict(m.arch), **dtypes), "arch", "the config's inline model.arch"


def domain_vocabulary_model(cfg: TrainConfig) -> Qwen3Config:
    """The inline arch with the domain vocabulary the trainer would build (or has built)."""
    env = make_environment(cfg.env)  # no user: a plan needs no API key
    if os.path.isfile(os.path.join(cfg.run_dir, "vocab.json")):  # where the trainer saves it
        return build.model_and_tokenizer(cfg, env, cfg.run_dir)[0]
    with tempfile.TemporaryDirectory() as scratch:
        return build.model_and_tokenizer(cfg, env, scratch)[0]


@dataclasses.dataclass(frozen=True)
class DomainFacts:
    prompt_prefix: int          # tokens every training conversation starts with (its system prompt)
    eval_conversations: int     # the evaluation's engine slots: trials x held-out tasks (0: rollout.num_slots caps)
    train_tasks: dict[str, int]  # training tasks per domain (what a step's conversations are drawn from)


def domain_facts(cfg: TrainConfig) -> DomainFacts:
    """What a plan needs of the run's domain, measured as the trainer measures it."""
    hf_dir = cfg.model.hf_dir
    # the checkpoint's where it is here; else the bundled one, every Qwen3 checkpoint's
    tokenizer = checkpoint_tokenizer(hf_dir) if hf_dir and os.path.isdir(hf_dir) else load_tokenizer()
    env = make_environment(cfg.env)  # no user: a plan needs no API key
    tasks = run_tasks.train_tasks(cfg, env)
    prefix = system_prompt_prefix(env, tokenizer, tasks)
    eval_slots = 0 if cfg.rollout.num_slots is not None else run_tasks.eval_conversations(cfg, env)
    return DomainFacts(prefix, eval_slots,
                       dict(collections.Counter(task.domain for task in tasks)))
