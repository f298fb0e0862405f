"""What every stage of a run shares: its config, mesh, domain, model config and tokenizer,
the rollout engine (built once), and where its files go.

`build_context(cfg)` makes all of it from the config; tests and custom domains pass a
`domain` or `tokenizer` of their own.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
from jax.sharding import Mesh

from muajax.config.schema import TrainConfig
from muajax.domains.base import Domain
from muajax.domains.registry import make_domain, make_user
from muajax.engine.engine import Engine
from muajax.models.qwen3 import Qwen3Config
from muajax.runtime import build, run_tasks
from muajax.runtime.host_batch import check_microbatch_sizes
from muajax.runtime.checkpoint import Checkpointer
from muajax.train.compilation import enable_compilation_cache
from muajax.train.metrics import MetricsWriter, ProgressBar
from muajax.runtime.rollout_engine import make_rollout_engine
from muajax.train.step_metrics import ProfileWindow, device_peak_flops


@dataclasses.dataclass
class RunContext:
    cfg: TrainConfig
    mesh: Mesh
    domain: Domain
    model_cfg: Qwen3Config
    tok: Any
    hf_dir: str | None  # the HF checkpoint the run starts from, if any
    resume: bool = False
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # figures stages report
    _engine: Engine | None = None
    _eval_domain: Domain | None = None

    @property
    def run_dir(self) -> str:
        return self.cfg.run_dir

    @property
    def main(self) -> bool:
        """True on the process that writes the run's files."""
        return jax.process_index() == 0

    @property
    def pad_id(self) -> int:
        return int(getattr(self.tok, "pad_token_id", None) or 0)

    def train_tasks(self) -> list:
        """The train split; with `env.max_train_tasks`, the first N tasks of each domain."""
        return run_tasks.train_tasks(self.cfg, self.domain.env)

    def eval_domain(self) -> Domain:
        """The domain evaluations run on: the run's, with `eval.user` as its user when set."""
        if self.cfg.eval.user is None:
            return self.domain
        if self._eval_domain is None:
            self._eval_domain = Domain(self.domain.env, make_user(self.cfg.eval.user, self.cfg.env))
        return self._eval_domain

    def eval_tasks(self) -> list:
        return run_tasks.eval_tasks(self.cfg, self.domain.env)

    def eval_trials(self) -> int:
        return run_tasks.eval_trials(self.cfg)

    def rollout_slots(self) -> int:
        """This process's share of a GRPO step's conversations open at once."""
        return run_tasks.rollout_slots(self.cfg, jax.process_count())

    def engine_slots(self) -> int:
        """Enough slots for this process's share of a GRPO step and of the evaluation."""
        return run_tasks.engine_slots(self.cfg, self.domain.env, jax.process_count())

    def engine(self, params) -> Engine:
        """The rollout engine, built on first use; `params` are assigned to it (it decodes from
        its own copy of them, see `muajax.runtime.rollout_engine`)."""
        if self._engine is None:
            r, slots = self.cfg.rollout, self.engine_slots()
            # fixed rows: every call as wide as this process's share of a step's conversations
            fixed = r.deterministic and r.call_layout == "fixed_rows"
            self._engine = make_rollout_engine(None, self.model_cfg, self.mesh, self.tok, num_slots=slots,
                                               max_len=r.max_context, rollout=r, min_batch_bucket=min(8, slots),
                                               call_rows=self.rollout_slots() if fixed else None,
                                               record_experts=self.cfg.grpo.routing_replay)
        self._engine.params = params
        return self._engine

    def engine_idle(self) -> None:
        """Before a train step: drop the engine's copy of the params, and its page pool unless
        `rollout.keep_kv_pool`, so the step has their memory."""
        if self._engine is not None:
            self._engine.release_params()
            if not self.cfg.rollout.keep_kv_pool:
                self._engine.release_memory()

    def checkpointer(self, stage: str) -> Checkpointer:
        c = self.cfg.checkpoint
        return Checkpointer(os.path.join(self.cfg.checkpoint_dir, stage), keep=c.keep, every_steps=c.every_steps)

    def metrics_writer(self, subdir: str | None, start: int) -> MetricsWriter:
        where = os.path.join(self.run_dir, subdir) if subdir else self.run_dir
        return MetricsWriter(where, jsonl=self.cfg.metrics.jsonl, tensorboard=self.cfg.metrics.tensorboard,
                             is_main_process=self.main,
                             resume_step=start if self.resume else None)

    def profile_window(self, subdir: str | None) -> ProfileWindow:
        """The `metrics.profile_steps` trace of a stage, into its metrics folder's profile/."""
        where = os.path.join(self.run_dir, subdir) if subdir else self.run_dir
        return ProfileWindow(os.path.join(where, "profile"), self.cfg.metrics.profile_steps)

    @functools.cached_property
    def peak_flops_per_device(self) -> float | None:
        """What MFU is measured against: the chip's peak, or a CPU's measured matmul peak
        (measured on first use, once a run); None for an accelerator of unknown peak."""
        return device_peak_flops(list(self.mesh.devices.flat))

    def progress(self, total: int, *, start: int = 0, desc: str | None = None) -> ProgressBar:
        kwargs = {"desc": desc} if desc else {}
        return ProgressBar(total, initial=start, enabled=self.cfg.metrics.progress_bar, is_main_process=self.main,
                           **kwargs)


def build_context(cfg: TrainConfig, *, resume: bool = False, domain: Domain | None = None,
                  tokenizer=None) -> RunContext:
    """Everything a run's stages share, from its config."""
    enable_compilation_cache(cfg.run.compilation_cache_dir)  # before anything compiles
    mesh = build.make_mesh(cfg)
    check_microbatch_sizes(cfg, mesh)
    domain = domain or make_domain(cfg.env, cfg.user)
    model_cfg, tok, hf_dir = build.model_and_tokenizer(cfg, domain.env, cfg.run_dir, tokenizer)
    return RunContext(cfg, mesh, domain, model_cfg, tok, hf_dir, resume=resume)
