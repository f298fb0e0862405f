"""The GRPO stage: each step rolls out the next tasks of a seeded task stream with the
simulated user in the loop, collates the trajectories and runs the sharded update.

One RL step: the next `tasks_per_step` tasks of the (per-epoch shuffled) task stream ->
`n_per_task` rollouts each through the engine (which reads the live params) ->
the host batch (`GRPOLayout.update_batches`: collated, failed rows masked, group
advantages, packed into rows with segment ids unless grpo.pack_rows is false, placed) -> the GRPO update (clipped loss, KL to the stage's
starting policy, AdamW; several mini-batch updates with `grpo.minibatch_size`) -> metrics
and checkpoint. Everything a resumed run needs (params,
optimizer state, step, the task-stream position) is in the checkpoint, and every random
choice is a function of (seed, step), so a run killed with -9 and resumed goes on exactly
as if uninterrupted.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muajax.agent.rollout import rollout_loop, run_rollouts, run_rollouts_sync
from muajax.agent.trajectory import rollout_metrics
from muajax.settings.fields import config_to_dict
from muajax.models.flops import forward_flops, real_token_flops, train_step_flops
from muajax.runtime import distributed, stopping
from muajax.runtime.grpo_layout import check_batch, grpo_layout, system_prompt_prefix
from muajax.train.async_grpo import Batch, RolloutAhead, WeightBoard, staleness
from muajax.train.context import RunContext
from muajax.train.loop import CheckpointHook, Hook, MetricsHook, NonFiniteHook, ProfileHook, ProgressHook, run_steps
from muajax.train.metrics import flatten_metrics
from muajax.train.step_metrics import call_without_compile, perf_record


class FailedRolloutsError(RuntimeError):
    """More than `rollout.max_failed_share` of a step's rollouts failed (user or setup errors):
    the step was not applied, and the state before it is saved for `--resume`."""


def stop_on_failures(ctx: RunContext, ckpt, index: int, state, trajectories, position: int) -> None:
    """Raise `FailedRolloutsError` when too many of the step's rollouts failed, after saving
    the state the step started from as checkpoint `index` (task stream at `position`), so
    that a resumed run redoes this very step."""
    r = ctx.cfg.rollout
    failed = [t for t in trajectories if t.failed]
    if len(failed) <= r.max_failed_share * len(trajectories):
        return
    if index not in ckpt.steps():
        ckpt.save(index, state, config=config_to_dict(ctx.cfg), force=True, data_position=position)
    kinds = sorted({t.termination for t in failed})
    first_error = str(failed[0].error).rstrip(".")
    raise FailedRolloutsError(
        f"GRPO step {index + 1}: {len(failed)} of {len(trajectories)} rollouts failed ({', '.join(kinds)}), more "
        f"than rollout.max_failed_share={r.max_failed_share:g}; the first error: {first_error}. The step was "
        f"not applied; the state before it is checkpoint {index} in {ckpt.directory}: once the user endpoint or "
        f"environment works again, continue with --resume.")


class TaskStream:
    """Tasks in a seeded order, reshuffled every epoch; `position` is all the state there is."""

    def __init__(self, tasks, seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the training split has no tasks")
        self.tasks, self.seed, self.position = list(tasks), seed, position

    def take(self, count: int):
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.tasks))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))
            out.append(self.tasks[int(order[index])])
            self.position += 1
        return out


def step_seed(seed: int, step: int) -> int:
    """The rollout seed of GRPO step `step`."""
    return int(np.random.SeedSequence([seed, 104729, step]).generate_state(1, np.uint32)[0] >> 1)


# Of the first update only: the policy has not moved yet, so its ratios to the rollout's
# logprobs show how far the trainer's numbers are from the engine's (the on-policy mismatch).
FIRST_PASS_KEYS = ("clip_frac", "ratio_abs_dev")


def _update(step_fn, state, parts: list[dict], reference, grpo, old_logprobs_fn=None):
    """The step's optimizer update(s) over its placed (mini-)batches; returns the state, the
    mean of their metrics (with `updates`, their number, and `first_pass/...`, the first
    update's FIRST_PASS_KEYS), and the [rows, length] of each (mini-)batch as stepped,
    padding included. `old_logprobs_fn` (mini-batches with grpo.recompute_old_logprobs)
    gives every mini-batch its `prox_logprobs` before the first update, beside the rollout's
    old logprobs (the behaviour policy's). Maxima ("..._max" metrics) are the updates' max."""
    if old_logprobs_fn is not None:  # from the params the step starts from, as verl and AReaL do
        parts = [dict(part, prox_logprobs=old_logprobs_fn(state.params, part)) for part in parts]
    records = []
    for _ in range(grpo.ppo_epochs):
        for placed in parts:
            state, metrics = step_fn(state, placed, reference) if reference is not None else step_fn(state, placed)
            records.append({k: float(v) for k, v in jax.device_get(metrics).items() if k != "step"})
    summary = {k: float((np.max if k.endswith("_max") else np.mean)([r[k] for r in records])) for k in records[0]}
    summary.update({f"first_pass/{k}": records[0][k] for k in FIRST_PASS_KEYS})
    return state, {**summary, "updates": float(len(records))}, [tuple(p["tokens"].shape) for p in parts]


def update_flops(ctx: RunContext, shapes, *, shared_prefix: int, microbatches: int, recomputed: bool) -> float:
    """Model FLOPs of a step's updates over (mini-)batches of these [rows, length], padding
    included: each stepped `grpo.ppo_epochs` times (the reference's forward too when it is
    kept), plus the forward that recomputes its old logprobs first when `recomputed`."""
    g, total = ctx.cfg.grpo, 0.0
    for rows, length in shapes:
        total += g.ppo_epochs * train_step_flops(ctx.model_cfg, rows, length, reference=g.uses_reference,
                                                 shared_prefix=shared_prefix, microbatches=microbatches)
        if recomputed:
            total += forward_flops(ctx.model_cfg, rows, length, shared_prefix=shared_prefix, prefix_runs=microbatches)
    return total


def real_update_flops(ctx: RunContext, lengths, *, updates: int, shared_prefix: int, microbatches: int,
                      recomputed: bool) -> float:
    """`update_flops` over the rows' real tokens only (`lengths`: every rollout's, on every
    process): no padded positions, no padded rows; the shared prefix as computed, once per
    microbatch of each of the `updates` (mini-batch) updates of each pass."""
    g = ctx.cfg.grpo
    passes = (4.0 if g.uses_reference else 3.0) * g.ppo_epochs + (1.0 if recomputed else 0.0)
    return real_token_flops(ctx.model_cfg, lengths, passes=passes, shared_prefix=shared_prefix,
                            prefix_runs=updates * microbatches)


def reference_params(params, grpo, shardings):
    """The KL reference: a copy of the starting params, in `grpo.reference_dtype` if set
    (`muajax.runtime.grpo_layout.abstract_reference` is its abstract twin)."""
    if grpo.reference_dtype is not None:
        dtype = jnp.dtype(grpo.reference_dtype)
        params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p), out_shardings=shardings)(params)
    return jax.device_put(params, shardings)


ENGINE_COUNTERS = ("preemptions", "prefix_hits", "decode_calls", "extend_calls")


def engine_delta(engine, before: dict) -> dict[str, float]:
    """What the engine did since `before` (its stats then): device seconds and counters."""
    return {k: engine.stats[k] - before[k] for k in ("device_s", *ENGINE_COUNTERS)}


@dataclasses.dataclass
class GRPOStage:
    """What every step of a GRPO run shares: the update, the task stream, the checkpoints."""
    ctx: RunContext
    layout: Any
    step_fn: Any
    old_logprobs_fn: Any
    reference: Any
    stream: TaskStream
    ckpt: Any
    steps: int
    start: int
    peak: float | None = None

    def train(self, state, index: int, trajectories, position: int, *, first: int, t0: float, t_rollout: float,
              engine: dict[str, float]):
        """Step `index`'s update on this process's `trajectories` (task stream at `position`
        before them, its first task `first`): the new state, the step's record and every
        process's trajectories. `engine`: what the engine did rolling them out."""
        ctx, g = self.ctx, self.ctx.cfg.grpo
        everyone = distributed.gather_for_metrics(trajectories)  # multi-host: the whole step's, on every process
        stop_on_failures(ctx, self.ckpt, index, state, everyone, position)
        parts = self.layout.update_batches(trajectories, g, mesh=ctx.mesh, pad_id=ctx.pad_id, first_group=first)
        for part in parts:
            check_batch(part, self.layout)
        t1 = time.time()
        (state, metrics, shapes), compute_s = call_without_compile(
            lambda: _update(self.step_fn, state, parts, self.reference, g, self.old_logprobs_fn))
        t_update = time.time() - t1
        counted = dict(shared_prefix=self.layout.shared_prefix, microbatches=self.layout.microbatches,
                       recomputed=self.old_logprobs_fn is not None)
        padded_flops = update_flops(ctx, shapes, **counted)
        flops = real_update_flops(ctx, [len(t.tokens) for t in everyone], updates=len(parts), **counted)
        sampled = int(sum(t.num_sampled for t in everyone))
        record = {**flatten_metrics(rollout_metrics(everyone)), **metrics,
                  "time/rollout_s": t_rollout, "time/update_s": t_update,
                  "time/engine_busy_share": engine["device_s"] / max(t_rollout, 1e-9),
                  **{f"engine/{k}": engine[k] for k in ENGINE_COUNTERS},
                  "throughput/sampled_tokens_per_s": sampled / max(time.time() - t0, 1e-9),
                  "data/position": self.stream.position,
                  **perf_record(flops, compute_s, ctx.mesh.size, self.peak, padded_flops=padded_flops)}
        return state, record, everyone

    def hooks(self) -> list:
        ctx, steps, start = self.ctx, self.steps, self.start
        return [ProfileHook(ctx.profile_window(None)),  # first: the trace ends before the others' work
                MetricsHook(ctx.metrics_writer(None, start)),
                ProgressHook(ctx.progress(steps, start=start), steps,
                             show=lambda rec: {"reward": rec.get("reward", 0.0), "kl": rec.get("kl", 0.0),
                                               "tokens_per_s": rec["throughput/sampled_tokens_per_s"]},
                             line=lambda i, rec: f"[grpo] step {i}/{steps}: reward {rec.get('reward', 0.0):.3f}, "
                                                 f"kl {rec.get('kl', 0.0):.4f}, rollout {rec['time/rollout_s']:.1f}s, "
                                                 f"update {rec['time/update_s']:.1f}s"
                                                 + (f", {rec['failed_rollouts']:g} failed rollouts"
                                                    if rec.get("failed_rollouts") else "")),
                CheckpointHook(self.ckpt, steps, config=config_to_dict(ctx.cfg),
                               extra=lambda i: {"data_position": self.stream.position}),
                NonFiniteHook(ctx.cfg.grpo.max_consecutive_skips, "grpo.max_consecutive_skips")]


def grpo_stage(ctx: RunContext, params):
    """The stage's shared parts and its starting state (restored with `ctx.resume`)."""
    cfg, r, g = ctx.cfg, ctx.cfg.rollout, ctx.cfg.grpo
    tasks = ctx.train_tasks()
    steps = g.steps or max(1, g.epochs * len(tasks) // r.tasks_per_step)
    prompt_prefix = system_prompt_prefix(ctx.domain.env, ctx.tok, tasks)
    layout = grpo_layout(cfg, ctx.mesh, ctx.model_cfg, prompt_prefix=prompt_prefix)
    step_fn = layout.make_step(ctx.model_cfg, ctx.mesh, g, total_steps=steps * g.updates_per_step(layout.batch_size))
    old_logprobs_fn = layout.make_old_logprobs_fn(ctx.model_cfg, ctx.mesh, g)
    reference = reference_params(params, g, step_fn.param_shardings) if g.uses_reference else None
    state = step_fn.init_state(params)
    stage = GRPOStage(ctx, layout, step_fn, old_logprobs_fn, reference, TaskStream(tasks, cfg.run.seed),
                      ctx.checkpointer("grpo"), steps, 0)
    if ctx.resume:
        restored = stage.ckpt.restore_latest(state)
        if restored is not None:
            stage.start, state = restored.step, restored.state
            stage.stream.position = int(restored.data_position or 0)
            print(f"[grpo] resumed at step {stage.start} (task stream position {stage.stream.position})", flush=True)
    return stage, state


def run_grpo(ctx: RunContext, params, *, hooks: Sequence[Hook] = ()):
    """GRPO from `params` (also the KL reference); returns the trained params. With
    `grpo.max_staleness` >= 1 the rollouts run ahead of the updates (`run_async_grpo`).
    `hooks` run after the stage's own (e.g. a benchmark's clock)."""
    stage, state = grpo_stage(ctx, params)
    if ctx.cfg.grpo.max_staleness > 0:
        return run_async_grpo(stage, state, hooks=hooks)
    cfg, r = ctx.cfg, ctx.cfg.rollout
    stream = stage.stream

    def step(state, index):
        t0 = time.time()
        engine = ctx.engine(state.params)
        engine.version = index
        before = dict(engine.stats)
        # multi-host: this process rolls out its contiguous share of the step's tasks (one
        # process: all of them) under their global indices, so seeds and group ids are the step's
        position = stream.position
        first, chosen = distributed.task_share(stream.take(r.tasks_per_step))
        trajectories = stopping.agreed_rollouts(
            lambda: run_rollouts_sync(engine, ctx.tok, ctx.domain.env, ctx.domain.user, chosen, options=r,
                                      seed=step_seed(cfg.run.seed, index), first_task_index=first),
            on_stop=lambda: setattr(stream, "position", position))  # the step's tasks are redone on resume
        t_rollout = time.time() - t0
        done = engine_delta(engine, before)
        ctx.engine_idle()  # the update gets the memory of the engine's params copy (and pool)
        state, record, _ = stage.train(state, index, trajectories, position, first=first, t0=t0,
                                       t_rollout=t_rollout, engine=done)
        return state, record

    stage.peak = ctx.peak_flops_per_device  # before the first step: on a CPU it is measured
    return run_steps(state, stage.start, stage.steps, step, [*stage.hooks(), *hooks]).params


def run_async_grpo(stage: GRPOStage, state, *, hooks: Sequence[Hook] = ()):
    """`run_grpo` with the next batches rolling out during each update (module
    `muajax.train.async_grpo`: versions, the handoff, the bound, resume)."""
    ctx = stage.ctx
    cfg, r, s = ctx.cfg, ctx.cfg.rollout, ctx.cfg.grpo.max_staleness
    stage.peak = ctx.peak_flops_per_device  # measured before the rollout thread starts
    engine = ctx.engine(None)
    board = WeightBoard()
    board.publish(stage.start, engine.prepare(state.params))
    ahead_stream = TaskStream(stage.stream.tasks, cfg.run.seed, stage.stream.position)  # the rollout thread's

    async def rollout(index, version, params):
        engine.adopt(version, params)
        before, position, t0 = dict(engine.stats), ahead_stream.position, time.time()
        first, chosen = distributed.task_share(ahead_stream.take(r.tasks_per_step))
        trajectories = await run_rollouts(engine, ctx.tok, ctx.domain.env, ctx.domain.user, chosen, options=r,
                                          seed=step_seed(cfg.run.seed, index), first_task_index=first,
                                          weights=board if r.partial else None)
        return Batch(index, trajectories, position, ahead_stream.position, version, time.time() - t0, 0.0,
                     first_task=first, info=engine_delta(engine, before))

    def step(state, index):
        t0 = time.time()
        batch = stopping.agreed_rollouts(lambda: ahead.get(index))  # the stream's position is still batch index's
        waited = time.time() - t0
        staleness(batch.trajectories, index, s)  # every row, before it is trained
        state, record, everyone = stage.train(state, index, batch.trajectories, batch.position,
                                              first=batch.first_task, t0=t0, t_rollout=batch.rollout_s,
                                              engine=batch.info)
        stage.stream.position = batch.next_position
        if index + 1 < stage.steps:  # the handoff: the engine's copy of version index + 1
            board.publish(index + 1, engine.prepare(state.params))
        record.update({**staleness(everyone, index, s), "async/batch_wait_s": waited,
                       "async/weights_wait_s": batch.weights_wait_s, "async/rollout_version": float(batch.version),
                       "data/position": stage.stream.position})
        return state, record

    ahead = RolloutAhead(rollout, board, start=stage.start, total=stage.steps, max_staleness=s,
                         partial=r.partial, loop=rollout_loop())
    try:
        params = run_steps(state, stage.start, stage.steps, step, [*stage.hooks(), *hooks]).params
    finally:
        ahead.close()
    ctx.engine_idle()
    return params
