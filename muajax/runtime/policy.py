"""Load a policy for evaluation, export or serving: DIR → (params, model config, tokenizer).

DIR may be
- a Hugging Face Qwen3 directory (`config.json` + safetensors; its tokenizer files if any,
  else the bundled Qwen3 tokenizer; a domain vocabulary if it has `domain_vocab.json`);
- a muajax run directory (`config.yaml`, `checkpoints/{sft,grpo}/<step>`): the newest step
  of the latest stage (GRPO before SFT) unless `stage`/`step` say otherwise;
- its `checkpoints` directory, one stage directory, or one step directory.

Checkpoints are read without `muajax.runtime.checkpoint.Checkpointer`: its manager creates
directories and cleans up unfinished saves, which must not happen to a run that is still
training while we evaluate it. Only the params are restored (orbax partial restore), not
the optimizer state, which would double or triple the memory; each restored leaf is
checked against the fingerprint saved with it, so bytes changed on disk are an error.

A domain-vocabulary run (`model.vocab: domain`) needs the run's `vocab.json`; it is looked
for next to the checkpoints (walking up from the step directory), then at the run
directory the config names.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from muajax import parallel
from muajax.agent.chat import im_end_id
from muajax.settings.fields import ConfigError, from_dict
from muajax.config.schema import TrainConfig, load_config
from muajax.models.hf import load_config as load_hf_config
from muajax.models.hf import load_params
from muajax.models.safetensors_io import CheckpointError
from muajax.models.sharding import param_shardings
from muajax.models.vocab import DomainTokenizer, checkpoint_tokenizer
from muajax.rl.step import model_abstract_params
from muajax.runtime.build import model_and_tokenizer
from muajax.runtime.checkpoint_records import leaf_fingerprints
from muajax.runtime.rollout_engine import make_rollout_engine

STAGES = ("grpo", "sft")  # latest first: GRPO starts from the SFT result
_STEP = re.compile(r"\d+\Z")


class PolicyLoadError(RuntimeError):
    """DIR is not something a policy can be loaded from; the message says why."""


@dataclasses.dataclass
class Policy:
    params: Any
    model_cfg: Any  # muajax.models.qwen3.Qwen3Config
    tokenizer: Any  # HF tokenizer or muajax.models.vocab.DomainTokenizer
    kind: str  # "hf" or "muajax"
    path: str
    mesh: Any
    config: Any = None  # the run's TrainConfig (muajax checkpoints only)
    stage: str | None = None
    step: int | None = None
    run_dir: str | None = None  # where vocab.json was found (domain-vocabulary runs)

    @property
    def vocab(self):
        """The DomainVocab of a domain-vocabulary model, else None."""
        return self.tokenizer.vocab if isinstance(self.tokenizer, DomainTokenizer) else None

    def describe(self) -> str:
        where = f" ({self.stage} step {self.step})" if self.step is not None else ""
        vocab = f", domain vocabulary of {self.vocab.size} ids" if self.vocab is not None else ""
        c = self.model_cfg
        return (f"{self.kind} policy {self.path}{where}: {c.num_layers} layers, hidden {c.hidden_size}, "
                f"vocab {c.vocab_size}{vocab}, {c.param_dtype}")


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def _steps(stage_dir: str) -> list[int]:
    if not os.path.isdir(stage_dir):
        return []
    # Orbax finalizes a save by renaming its tmp directory, so a plain number is a finished step.
    return sorted(int(n) for n in os.listdir(stage_dir)
                  if _STEP.match(n) and os.path.isdir(os.path.join(stage_dir, n, "state")))


def _is_step_dir(path: str) -> bool:
    return bool(_STEP.match(os.path.basename(os.path.normpath(path)))) and os.path.isdir(
        os.path.join(path, "state")) and os.path.isdir(os.path.join(path, "meta"))


def find_step_dir(path: str, *, stage: str | None = None, step: int | None = None) -> tuple[str, str | None, int]:
    """(step directory, stage name or None, step) for a run / checkpoints / stage / step dir."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise PolicyLoadError(f"{path}: no such directory")
    if stage is not None and stage not in STAGES:
        raise PolicyLoadError(f"stage must be one of {STAGES}, got {stage!r}")
    if _is_step_dir(path):
        if step is not None and int(os.path.basename(path)) != step:
            raise PolicyLoadError(f"{path} is step {os.path.basename(path)}, not the requested step {step}")
        parent = os.path.basename(os.path.dirname(path))
        return path, parent if parent in STAGES else None, int(os.path.basename(path))
    if _steps(path):  # a stage directory
        name = os.path.basename(path)
        return _pick(path, name if name in STAGES else None, step)
    roots = [path, os.path.join(path, "checkpoints")]
    if os.path.isfile(os.path.join(path, "config.yaml")):
        cfg = _read_run_config(os.path.join(path, "config.yaml"))
        if cfg is not None and cfg.checkpoint.dir:  # a custom checkpoint.dir, relative to where training ran
            roots.append(cfg.checkpoint.dir)
    tried = []
    for root in roots:
        for name in ([stage] if stage else STAGES):
            stage_dir = os.path.join(root, name)
            tried.append(stage_dir)
            if _steps(stage_dir):
                return _pick(stage_dir, name, step)
    raise PolicyLoadError(
        f"{path}: no checkpoint found (not a Hugging Face directory: no config.json; no finished step under "
        f"{', '.join(tried)})")


def _pick(stage_dir: str, stage: str | None, step: int | None) -> tuple[str, str | None, int]:
    steps = _steps(stage_dir)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise PolicyLoadError(f"{stage_dir}: no step {step} (steps: {steps})")
    return os.path.join(stage_dir, str(step)), stage, step


def _read_run_config(path: str):
    try:
        return load_config(path)
    except (ConfigError, OSError):
        return None


def _read_meta(step_dir: str) -> dict:
    path = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PolicyLoadError(f"{path}: unreadable checkpoint metadata ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("leaves"), list):
        raise PolicyLoadError(f"{path}: malformed checkpoint metadata")
    return meta


def _find_vocab(step_dir: str, cfg) -> str | None:
    here = step_dir
    for _ in range(5):
        candidate = os.path.join(here, "vocab.json")
        if os.path.isfile(candidate):
            return here
        here = os.path.dirname(here)
    if os.path.isfile(os.path.join(cfg.run_dir, "vocab.json")):
        return os.path.abspath(cfg.run_dir)
    return None


def make_default_mesh():
    """Weights sharded (FSDP) over every device; one device on a CPU host."""
    return parallel.make_mesh(1, -1, 1)


def _placed(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _restore_params(step_dir: str, model_cfg, meta: dict, mesh):
    abstract = _placed(model_abstract_params(model_cfg), param_shardings(model_cfg, mesh))
    saved = {r["path"]: r for r in meta["leaves"]}
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
    for path, leaf in flat:
        name = ".params" + jax.tree_util.keystr(path)
        record = saved.get(name)
        if record is None:
            raise PolicyLoadError(f"{step_dir}: the checkpoint has no leaf {name}: it was saved for another "
                                  "model (check model.arch / vocabulary)")
        if record["shape"] is not None and list(leaf.shape) != record["shape"]:
            raise PolicyLoadError(f"{step_dir}: leaf {name} has shape {tuple(record['shape'])}, the model config "
                                  f"expects {tuple(leaf.shape)}")
    item = {"params": abstract}
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(os.path.join(step_dir, "state"), args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
        raise PolicyLoadError(f"{step_dir}: cannot read the params ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300]})") from None
    params = restored["params"]
    leaves = [leaf for _, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
    fps = [int(v) for v in jax.device_get(leaf_fingerprints(leaves))]
    for (path, leaf), fp in zip(flat, fps):
        record = saved[".params" + jax.tree_util.keystr(path)]
        if record["dtype"] == str(leaf.dtype) and record.get("fp") is not None and record["fp"] != fp:
            raise PolicyLoadError(f"{step_dir}: params{jax.tree_util.keystr(path)} does not match its saved "
                                  "fingerprint (the checkpoint changed on disk)")
    return params


def _check_tokenizer_fits(model_cfg, tokenizer, path: str) -> None:
    needed = max(im_end_id(tokenizer), int(getattr(tokenizer, "pad_token_id", 0) or 0)) + 1
    if model_cfg.vocab_size < needed:
        raise PolicyLoadError(f"{path}: the model's vocab_size is {model_cfg.vocab_size}, smaller than the "
                              f"tokenizer's special ids need ({needed}); this model cannot speak the chat format")


def load_hf(path: str, *, dtype: str | None = None, mesh=None) -> Policy:
    mesh = mesh or make_default_mesh()
    overrides = {"param_dtype": dtype, "dtype": dtype} if dtype else {}
    try:
        model_cfg = load_hf_config(path, **overrides)
        tokenizer = checkpoint_tokenizer(path)
        _check_tokenizer_fits(model_cfg, tokenizer, path)
        params, _ = load_params(path, model_cfg, param_shardings(model_cfg, mesh))
    except CheckpointError as e:
        raise PolicyLoadError(str(e)) from None
    return Policy(params, model_cfg, tokenizer, "hf", os.path.abspath(path), mesh)


def load_muajax(path: str, *, stage: str | None = None, step: int | None = None, dtype: str | None = None,
                mesh=None) -> Policy:
    step_dir, stage, step = find_step_dir(path, stage=stage, step=step)
    meta = _read_meta(step_dir)
    if not isinstance(meta.get("config"), dict):
        raise PolicyLoadError(f"{step_dir}: the checkpoint does not record its run config")
    try:
        cfg = from_dict(TrainConfig, meta["config"])
    except ConfigError as e:
        raise PolicyLoadError(f"{step_dir}: the recorded run config is invalid ({e})") from None
    if dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype=dtype, dtype=dtype))
    run_dir = None
    if cfg.model.vocab == "domain":
        run_dir = _find_vocab(step_dir, cfg)
        if run_dir is None:
            raise PolicyLoadError(f"{step_dir}: a domain-vocabulary checkpoint needs its run's vocab.json, found "
                                  f"neither above the checkpoint nor in {os.path.abspath(cfg.run_dir)}")
    # env=None: with vocab.json present nothing needs the domain's texts
    model_cfg, tokenizer, _ = model_and_tokenizer(cfg, None, run_dir or cfg.run_dir)
    _check_tokenizer_fits(model_cfg, tokenizer, step_dir)
    mesh = mesh or make_default_mesh()
    params = _restore_params(step_dir, model_cfg, meta, mesh)
    return Policy(params, model_cfg, tokenizer, "muajax", step_dir, mesh, config=cfg, stage=stage, step=step,
                  run_dir=run_dir)


def load_policy(path: str, *, stage: str | None = None, step: int | None = None, dtype: str | None = None,
                mesh=None) -> Policy:
    """A policy from a Hugging Face directory or a muajax run/checkpoint directory."""
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise PolicyLoadError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if is_hf_dir(path):
        if stage is not None or step is not None:
            raise PolicyLoadError(f"{path} is a Hugging Face directory: it has no stages or steps")
        return load_hf(path, dtype=dtype, mesh=mesh)
    return load_muajax(path, stage=stage, step=step, dtype=dtype, mesh=mesh)


def make_engine(policy: Policy, *, num_slots: int, max_len: int, **kwargs):
    """The policy's rollout engine (`muajax.runtime.rollout_engine.make_rollout_engine`)."""
    if max_len > policy.model_cfg.max_position_embeddings:
        raise PolicyLoadError(f"max_len={max_len} exceeds the model's max_position_embeddings "
                              f"({policy.model_cfg.max_position_embeddings})")
    return make_rollout_engine(policy.params, policy.model_cfg, policy.mesh, policy.tokenizer, num_slots=num_slots,
                               max_len=max_len, **kwargs)
