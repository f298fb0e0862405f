"""Named Qwen3 architectures: `preset_config("qwen3-8b", param_dtype="bfloat16")`.

Source of truth: `configs/models/<name>.yaml` in the repository, located relative to this
package (`<repo>/muajax/models/presets.py` -> `<repo>/configs/models`). pyproject packages
only `muajax*`, so a wheel install has no `configs/`; for that case `BUILTIN` holds the same
architectures as a Python dict, and `tests/models/test_presets.py` fails if the two ever
disagree. When both exist, a YAML file wins over the built-in entry of the same name, and
a YAML-only file (a new preset) is picked up without code changes.

Presets hold the architecture only; `dtype`, `param_dtype` and `remat` are run choices and
come in as overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from pathlib import Path

import yaml

from muajax.models.qwen3 import Qwen3Config

PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
RUN_FIELDS = ("param_dtype", "dtype", "remat")
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(Qwen3Config) if f.name not in RUN_FIELDS)


class UnknownPresetError(ValueError):
    """The name is not a known preset; the message lists the known ones."""


_SHARED = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
               max_position_embeddings=40960)


def _arch(hidden, intermediate, layers, heads, kv_heads, tied):
    return dict(_SHARED, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                num_heads=heads, num_kv_heads=kv_heads, tie_word_embeddings=tied)


BUILTIN: dict[str, dict] = {
    "qwen3-0.6b": _arch(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _arch(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _arch(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _arch(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _arch(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _arch(5120, 25600, 64, 64, 8, False),
    # Mixtures of experts: 128 experts, 8 active per token, renormalised over those 8.
    "qwen3-30b-a3b": dict(_arch(2048, 6144, 48, 32, 4, False), num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    "qwen3-235b-a22b": dict(_arch(4096, 12288, 94, 64, 4, False), num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536, norm_topk_prob=True),
}


def _size_key(name: str):
    m = re.search(r"(\d+(?:\.\d+)?)b(?:-a\d+b)?$", name)
    return (0, float(m.group(1)), name) if m else (1, 0.0, name)


def _yaml_files() -> dict[str, Path]:
    if not PRESETS_DIR.is_dir():
        return {}
    return {p.stem.lower(): p for p in PRESETS_DIR.glob("*.yaml")}


def list_presets() -> list[str]:
    """Known preset names, smallest model first."""
    return sorted(set(BUILTIN) | set(_yaml_files()), key=_size_key)


def _normalise(name: str) -> str:
    # Accept the Hub id too ("Qwen/Qwen3-8B"): that is how people usually write it.
    name = name.strip().lower()
    return name[len("qwen/"):] if name.startswith("qwen/") else name


@functools.lru_cache(maxsize=None)
def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of Qwen3Config fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(ARCH_FIELDS))
    if unknown:
        hint = " (dtype/param_dtype/remat are run choices: pass them as overrides)" \
            if set(unknown) & set(RUN_FIELDS) else ""
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed: {list(ARCH_FIELDS)}{hint}")
    return data


def preset_values(name: str) -> dict:
    """The architecture fields of a preset as a plain dict (YAML if present, else built-in)."""
    key = _normalise(name)
    files = _yaml_files()
    if key in files:
        return dict(_read_yaml(str(files[key])))
    if key in BUILTIN:
        return dict(BUILTIN[key])
    known = list_presets()
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnknownPresetError(f"unknown model preset {name!r}{hint}; known presets: {', '.join(known)}")


def preset_config(name: str, **overrides) -> Qwen3Config:
    """`Qwen3Config` for a named preset; `overrides` replace any field (e.g. dtype="bfloat16")."""
    fields = {f.name for f in dataclasses.fields(Qwen3Config)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"preset_config({name!r}): unknown override(s) {bad}; Qwen3Config fields: {sorted(fields)}")
    values = preset_values(name)
    missing = sorted(set(ARCH_FIELDS) - set(values) - set(overrides))
    required = {f.name for f in dataclasses.fields(Qwen3Config)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if set(missing) & required:
        where = _yaml_files().get(_normalise(name), "built-in presets")
        raise ValueError(f"{where}: preset {name!r} is missing required field(s) {sorted(set(missing) & required)}")
    values.update(overrides)
    return Qwen3Config(**values)


def presets_source() -> str:
    """Where presets come from on this install (for logs and reports)."""
    return str(PRESETS_DIR) if _yaml_files() else "built-in dict (no configs/models folder next to the package)"

