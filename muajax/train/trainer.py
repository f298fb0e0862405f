"""The run: cold-start SFT, then GRPO with the simulated user in the loop, each followed by
held-out evaluation. The stages are `muajax.train.sft` and `muajax.train.grpo`; what they
share is a `RunContext`.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from muajax.models.host_blocks import fingerprint
from muajax.agent.pass_k import evaluate_policy, evaluation_summary, task_records
from muajax.settings.loader import dump_yaml
from muajax.config.schema import TrainConfig
from muajax.domains.base import Domain
from muajax.runtime import build, distributed, stopping
from muajax.train.context import RunContext, build_context
from muajax.train.grpo import run_grpo
from muajax.runtime.resume import check_checkpoint_layouts, plan_resume
from muajax.train.sft import run_sft

EVAL_SEED_OFFSET = 1_000_003  # evaluation samples never reuse a training rollout's seed


def params_fingerprint(params) -> str:
    """sha256 over every parameter's bytes, in tree order: equal iff the params are bitwise equal.
    Read block by block from each leaf's shards (`muajax.models.host_blocks.fingerprint`):
    no leaf is gathered whole or replicated; the value does not depend on the sharding."""
    return fingerprint(params)


def evaluate(ctx: RunContext, params, label: str) -> dict[str, Any]:
    """Held-out evaluation of `params`, split across processes as a step's rollouts are:
    each rolls out its share of the tasks at their global indices (hence the seeds and
    trajectories of a one-process evaluation), the trajectories are gathered, and every
    process computes the same summary. Process 0 writes `eval_<label>.json` (each task with
    the process that evaluated it) and prints its line."""
    e = ctx.cfg.eval
    t0 = time.time()
    trials = ctx.eval_trials()
    first, share = distributed.evaluation_share(ctx.eval_tasks())
    _, mine = stopping.agreed_rollouts(lambda: evaluate_policy(  # a stop: every process ends here
        ctx.engine(params), ctx.tok, ctx.eval_domain(), share, trials=trials, temperature=e.temperature,
        options=ctx.cfg.rollout, seed=ctx.cfg.run.seed + EVAL_SEED_OFFSET, communicate_info=e.communicate_info,
        first_task_index=first))
    parts = distributed.gather_for_report(mine)
    trajectories = [t for part in parts for t in part]
    summary = evaluation_summary(trajectories, trials)
    summary["conversations_per_process"] = [len(part) for part in parts]
    summary["wall_s"] = time.time() - t0
    if ctx.main:
        process = {(t.domain, t.task_id): p for p, part in enumerate(parts) for t in part}
        records = [dict(r, process=process[(r["domain"], r["task_id"])]) for r in task_records(trajectories, trials)]
        with open(os.path.join(ctx.run_dir, f"eval_{label}.json"), "w") as f:
            json.dump({"summary": summary, "tasks": records}, f, indent=1, default=str)
        rate = summary["confirm_rate"]
        print(f"[{label}] held-out success {summary['success']:.3f} on {summary['tasks']} tasks, "
              f"confirm-before-write {'n/a' if rate is None else f'{rate:.3f}'}, "
              f"turns {summary['turns']:.1f} ({summary['wall_s']:.0f}s"
              f"{f', split across {len(parts)} processes' if len(parts) > 1 else ''})", flush=True)
        for domain, part in summary.get("by_domain", {}).items():
            print(f"[{label}]   {domain}: success {part['success']:.3f} on {part['tasks']} tasks, "
                  f"pass^1 {part['pass^1']:.3f}", flush=True)
    return summary


class Trainer:
    """One run of a config: `Trainer(cfg).run()` -> its figures."""

    def __init__(self, cfg: TrainConfig, *, resume: bool | str = False, allow_config_change: bool = False,
                 start_time: float | None = None, domain: Domain | None = None, tokenizer=None):
        """`resume`: False, True (a checkpoint is required) or "auto" (resume if there is
        one). A resume is checked before any file is written: there is a checkpoint, the
        saved config computes the same thing (unless `allow_config_change`), the arrays fit
        (`muajax.runtime.resume.ResumeError` otherwise). A missing API key for a remote user
        stops it earlier still (`DomainConfigError`). `domain` and `tokenizer` replace what
        the config would build (tests, custom domains)."""
        self.start_time = start_time or time.time()
        plan = plan_resume(cfg, resume, allow_config_change=allow_config_change, tokenizer_given=tokenizer is not None)
        self.ctx = build_context(cfg, resume=plan.resume, domain=domain, tokenizer=tokenizer)
        if plan.resume:
            check_checkpoint_layouts(cfg, self.ctx.model_cfg, plan)
        if self.ctx.main:
            os.makedirs(cfg.run_dir, exist_ok=True)
            # the config holds env-var names only, never secrets
            dump_yaml(cfg, os.path.join(cfg.run_dir, "config.yaml"))

    def run(self) -> dict[str, Any]:
        ctx = self.ctx
        cfg = ctx.cfg
        params = build.initial_params(ctx.model_cfg, ctx.hf_dir, ctx.mesh, cfg.run.seed)
        figures: dict[str, Any] = {}
        for stage, train in (("sft", run_sft), ("grpo", run_grpo)):
            if stage not in cfg.run.stages:
                continue
            params = train(ctx, params)
            result = evaluate(ctx, params, stage)
            figures.update({f"heldout_success_{stage}": result["success"],
                            f"confirm_rate_{stage}": result["confirm_rate"], f"partial_{stage}": result["partial"]})
        floor = ctx.domain.env.never_write_floor(ctx.eval_tasks(), communicate_info=cfg.eval.communicate_info)
        if floor is not None:
            figures["floor_success"] = floor
            if ctx.main:
                print(f"[floor] held-out success of an agent that never writes: {floor:.3f}", flush=True)
        figures["params_sha256"] = params_fingerprint(params)
        figures["wall_s"] = round(time.time() - self.start_time, 1)
        figures["run_dir"] = cfg.run_dir
        return figures
