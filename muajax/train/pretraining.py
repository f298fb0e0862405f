"""Warm-ups before the SFT data, for models trained from scratch (off for pretrained ones):

- `copy_warmup`: synthetic span copying over the model's vocabulary
  (`muajax.rl.sft.copy_warmup_batch`);
- `domain_warmup`: short windows of the built-in expert's conversations in other shops,
  each ending at a tool call (`muajax.domains.builtin.copy_windows`), with the loss on the
  assistant's tokens. `python -m muajax.pretrain` is this warm-up, run on its own.

Each is a run of the SFT step with a fresh optimizer (its state is not kept), rows drawn
with a seeded generator, so a resumed run repeats it exactly.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np

from muajax.agent.chat import im_end_id, render_messages_ids
from muajax.domains.builtin.base_record import read_base_record, write_base_record
from muajax.domains.builtin.copy_windows import warmup_shop_seeds
from muajax.models.hf import save_hf
from muajax.models.vocab import DOMAIN_VOCAB_FILE
from muajax.rl.optim import optimizer_from_config
from muajax.rl.sft import copy_warmup_batch, make_sft_step
from muajax.runtime import build
from muajax.runtime.host_batch import LENGTH_MULTIPLE, batch_divisor, common_prefix, place_shared, sft_batch
from muajax.train.context import RunContext, build_context
from muajax.train.loop import CallbackHook, ProgressHook, run_steps

# The nll reported first and last is a mean over this many steps at each end: one batch is
# too noisy to report.
NLL_WINDOW = 20


def copy_warmup(ctx: RunContext, params):
    """`sft.copy_warmup_steps` of synthetic span copying; params unchanged when 0."""
    s = ctx.cfg.sft
    if not s.copy_warmup_steps:
        return params
    special = {ctx.pad_id, im_end_id(ctx.tok), getattr(getattr(ctx.tok, "vocab", None), "unk_id", -1)}
    size = len(ctx.tok) if hasattr(ctx.tok, "vocab") else ctx.model_cfg.vocab_size
    ids = [i for i in range(min(size, ctx.model_cfg.vocab_size)) if i not in special]
    rng = np.random.default_rng([ctx.cfg.run.seed, 31337])
    params, first, last = warmup_steps(ctx, params, s.copy_warmup_steps,
                                       lambda: copy_warmup_batch(rng, ids, s.batch_size, s.copy_warmup_length))
    if ctx.main:
        print(f"[sft] copy warm-up: {s.copy_warmup_steps} steps, nll on the repeated span "
              f"{first:.3f} -> {last:.3f}", flush=True)
    ctx.summary["copy_warmup_nll"] = last
    return params


def _system_prompt(ctx: RunContext):
    """(policy, tools) of the run's domain: the same in every shop of the built-in domain."""
    env = ctx.domain.env
    task = env.tasks(ctx.cfg.env.train_split)[0]
    session = env.reset(task)
    try:
        return env.policy_for(task), session.tools()
    finally:
        session.close()


def domain_warmup(ctx: RunContext, params, on_step: Callable | None = None):
    """`sft.domain_warmup_steps` on tool-call windows of other shops; params unchanged when 0.
    `on_step(step, params, nll)` sees every step (snapshots)."""
    s = ctx.cfg.sft
    if not s.domain_warmup_steps:
        return params
    system = _system_prompt(ctx) if s.domain_warmup_system_prompt else (None, None)
    rows = [render_messages_ids(ctx.tok, *system, w) for w in build.warmup_windows(ctx.cfg)]
    prefix = common_prefix([ids for ids, _ in rows]) if s.domain_warmup_system_prompt else 0
    # Windows run from ~50 to ~300 tokens (after the system prompt, if any): each batch
    # comes from one length bucket, so padding stays small and there is one compilation
    # per bucket.
    buckets: dict[int, list[int]] = {}
    for i, (ids, _) in enumerate(rows):
        buckets.setdefault(-(-len(ids) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, []).append(i)
    lengths = sorted(buckets)
    weights = np.array([len(buckets[n]) for n in lengths], np.float64)
    rng = np.random.default_rng([ctx.cfg.run.seed, 4242])

    def batch():
        length = lengths[rng.choice(len(lengths), p=weights / weights.sum())]
        pool = buckets[length]
        chosen = rng.choice(pool, s.domain_warmup_batch_size, replace=len(pool) < s.domain_warmup_batch_size)
        return sft_batch([rows[i] for i in chosen], ctx.pad_id, length)

    params, first, last = warmup_steps(ctx, params, s.domain_warmup_steps, batch, on_step=on_step,
                                       shared_prefix=prefix)
    if ctx.main:
        print(f"[sft] domain warm-up: {s.domain_warmup_steps} steps on {len(rows)} tool-call windows from "
              f"{s.domain_warmup_shops} other shops, assistant nll {first:.3f} -> {last:.3f}", flush=True)
    ctx.summary["domain_warmup_nll"] = last
    ctx.summary["domain_warmup_nll_first"] = first
    return params


def warmup_steps(ctx: RunContext, params, steps: int, make_batch, *, on_step=None, shared_prefix: int = 0):
    """(params, first nll, last nll) after `steps` SFT steps on `make_batch()` batches, with a
    fresh optimizer on the SFT schedule."""
    optimizer = optimizer_from_config(ctx.cfg.sft, total_steps=steps)
    step_fn = make_sft_step(ctx.model_cfg, optimizer, ctx.mesh, shared_prefix=shared_prefix,
                            logits_chunk=ctx.cfg.sft.logits_chunk)
    divisor = batch_divisor(ctx.mesh, 1)
    nlls: list[float] = []
    log_every = max(1, steps // 10)

    def step(state, index):
        state, metrics = step_fn(state, place_shared(make_batch(), ctx.mesh, divisor, ctx.pad_id))
        nlls.append(float(jax.device_get(metrics["nll"])))
        return state, {"nll": nlls[-1]}

    hooks = [ProgressHook(ctx.progress(steps, desc="warm-up"), steps, show=lambda r: {"nll": r["nll"]},
                          line=lambda i, r: f"[warm-up] step {i}/{steps}, nll {np.mean(nlls[-log_every:]):.3f}",
                          every=log_every)]
    if on_step is not None:
        hooks.append(CallbackHook(lambda i, state, r: on_step(i, state.params, r["nll"])))
    state = run_steps(step_fn.init_state(params), 0, steps, step, hooks)
    window = max(1, min(NLL_WINDOW, len(nlls) // 2))  # first and last never overlap
    return state.params, float(np.mean(nlls[:window])), float(np.mean(nlls[-window:]))


# ---------------------------------------------------------------------------------------------- a base alone


def write_base(out_dir: str, params, model_cfg, tokenizer, record: dict) -> None:
    """An HF directory, its domain vocabulary and its base record, each file written whole."""
    save_hf(params, model_cfg, out_dir)
    tokenizer.vocab.save(os.path.join(out_dir, DOMAIN_VOCAB_FILE))
    write_base_record(out_dir, record)


def pretrain_base(cfg, out_dir: str, *, save_every: int = 0, command: str = "") -> dict:
    """The domain warm-up on its own (`python -m muajax.pretrain`): train the base `cfg`
    describes (its model.arch or model.hf_dir, SFT optimizer and sft.domain_warmup_*) and
    write it to `out_dir` with the record of the shops it saw; returns its figures."""
    start = time.time()
    ctx = build_context(cfg)
    s = cfg.sft
    shops = [cfg.env.builtin_seed, *warmup_shop_seeds(cfg.env.builtin_seed, s.domain_warmup_shops)]
    record = {"command": command, "steps": s.domain_warmup_steps, "batch_size": s.domain_warmup_batch_size,
              "learning_rate": s.learning_rate, "system_prompt": s.domain_warmup_system_prompt,
              "vocab_size": len(ctx.tok)}
    if ctx.hf_dir:  # continued from an earlier base: its shops count as seen too
        record["init"] = read_base_record(ctx.hf_dir) or {}
        shops = sorted(set(shops) | set(record["init"].get("shop_seeds", [])))
    record["shop_seeds"] = shops

    def snapshot(step: int, params, nll: float) -> None:
        if save_every and step % save_every == 0 and step < s.domain_warmup_steps:
            write_base(os.path.join(out_dir, f"step-{step}"), params, ctx.model_cfg, ctx.tok,
                       dict(record, steps=step, nll=nll, wall_s=time.time() - start))

    params = build.initial_params(ctx.model_cfg, ctx.hf_dir, ctx.mesh, cfg.run.seed)
    params = domain_warmup(ctx, params, on_step=snapshot)
    figures = {"out": out_dir, "steps": s.domain_warmup_steps, "nll": ctx.summary["domain_warmup_nll"],
               "nll_first": ctx.summary["domain_warmup_nll_first"], "wall_s": round(time.time() - start, 1)}
    write_base(out_dir, params, ctx.model_cfg, ctx.tok, dict(record, **figures))
    return figures
