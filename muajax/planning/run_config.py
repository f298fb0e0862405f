"""The model a run config trains, without its checkpoint or domain: what a plan needs.

The trainer reads the architecture from `model.hf_dir`'s config.json (or a preset, or the
inline `arch`) and applies the run's dtypes, remat and attention (`muajax.runtime.build.
model_and_tokenizer`). A plan does the same, except that a checkpoint folder need not
exist where one plans: a missing `hf_dir` whose name is a preset's (checkpoints/Qwen3-32B
-> qwen3-32b) plans that preset, and says so.
"""
from __future__ import annotations

import dataclasses
import os

from muajax.config.schema import TrainConfig
from muajax.models.hf import load_config
from muajax.models.presets import UnknownPresetError, preset_config
from muajax.models.qwen3 import Qwen3Config


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
    arch = dataclasses.asdict(m.arch)
    # a domain vocabulary's size is only known once built from the domain; the arch's is an upper bound
    return Qwen3Config(**arch, **dtypes), "arch", "the config's inline model.arch"
