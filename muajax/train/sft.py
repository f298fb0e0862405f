"""The cold-start SFT stage: the data (a JSONL file, or the built-in expert's conversations),
then epochs of the SFT step over it, checkpointed and resumable. Each step's conversations
are packed into rows (`muajax.runtime.packing`, `sft.packing`) or take a row each.

A fresh stage first runs the warm-ups the config asks for (`muajax.train.pretraining`); a
resumed one restores its state instead (the warm-ups are already in it).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from muajax.agent.chat import render_messages_ids
from muajax.settings.fields import config_to_dict
from muajax.domains.base import WRITES_CONFIRMED
from muajax.domains.builtin.expert import expert_records
from muajax.models.flops import real_token_flops, train_step_flops
from muajax.rl.optim import optimizer_from_config
from muajax.rl.sft import make_sft_step
from muajax.runtime import distributed
from muajax.runtime.grpo_layout import shared_prefix_tokens
from muajax.runtime.host_batch import (LENGTH_MULTIPLE, batch_divisor, common_prefix, microbatch_count, padded_length,
                                   place_shared, sft_batch)
from muajax.runtime.packing import PackingPlan, pack, packed_batch, plan_packing
from muajax.train.context import RunContext
from muajax.train.loop import CheckpointHook, MetricsHook, NonFiniteHook, ProfileHook, ProgressHook, run_steps
from muajax.train.step_metrics import call_without_compile, perf_record
from muajax.train.pretraining import copy_warmup, domain_warmup

Example = tuple[list[int], list[int]]  # (token ids, assistant mask)


def write_expert_data(ctx: RunContext, path: str) -> None:
    """The built-in domain's cold-start data: the scripted expert's reward-1 conversations
    on the train split, careless (writing before the user confirms) on a share of tasks."""
    cfg = ctx.cfg
    records = expert_records(ctx.domain.env, ctx.domain.env.tasks(cfg.env.train_split),
                             careless=cfg.sft.expert_careless, seed=cfg.run.seed)
    kept = [r for r in records if r["reward"] == 1.0]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
    os.replace(path + ".tmp", path)
    unconfirmed = sum(1 for r in kept if r[WRITES_CONFIRMED] and not all(r[WRITES_CONFIRMED]))
    print(f"[sft] expert data: {len(kept)} conversations with reward 1, {unconfirmed} of them write "
          "before the user confirms", flush=True)


def read_examples(path: str, tokenizer, max_len: int) -> list[Example]:
    """The SFT records of a JSONL file, rendered with the rollout's own token deltas and cut
    to `max_len`; a bad line stops the run naming the file and line."""
    examples = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                ids, mask = render_messages_ids(tokenizer, record.get("system"), record.get("tools"),
                                                record["messages"])
            except (json.JSONDecodeError, KeyError, ValueError) as exc:
                raise SystemExit(f"{path}:{lineno}: bad SFT record: {exc}") from None
            examples.append((ids[:max_len], mask[:max_len]))
    return examples


def sft_examples(ctx: RunContext) -> list[Example]:
    path = ctx.cfg.sft.data
    if path is None:  # the built-in domain's scripted expert writes the cold-start data
        path = os.path.join(ctx.run_dir, "sft.jsonl")
        if ctx.main and not os.path.isfile(path):
            write_expert_data(ctx, path)
    return read_examples(path, ctx.tok, ctx.cfg.sft.max_len)


def step_examples(num_examples: int, batch_size: int, seed: int, index: int) -> list[int]:
    """The examples of SFT step `index`: its share of the epoch's seeded permutation."""
    per_epoch = max(1, num_examples // batch_size)
    epoch, within = divmod(index, per_epoch)
    order = np.random.default_rng([seed, 7, epoch]).permutation(num_examples)
    return [int(i) for i in order[within * batch_size:(within + 1) * batch_size]]


def plan_batches(ctx: RunContext, examples: list[Example], total: int, prefix: int) -> PackingPlan:
    """Row length and rows per step, packed (`sft.packing`) or one conversation a row."""
    s, seed = ctx.cfg.sft, ctx.cfg.run.seed
    length = padded_length(max(len(ids) for ids, _ in examples), LENGTH_MULTIPLE)  # one compilation
    lengths = lambda index: [len(examples[i][0]) for i in step_examples(len(examples), s.batch_size, seed, index)]
    plan = plan_packing(lengths, total, length=length, batch_size=s.batch_size,
                        row_multiple=s.microbatch_size or batch_divisor(ctx.mesh, 1), shared_prefix=prefix,
                        mode=s.packing)
    if plan.enabled:
        print(f"[sft] packing: {s.batch_size} conversations a step in {plan.rows} rows of {length} tokens "
              f"({plan.packed_tokens} tokens a step, against {plan.unpacked_tokens} unpacked)", flush=True)
    return plan


def run_sft(ctx: RunContext, params):
    """SFT from `params`; returns the tuned params."""
    s, seed = ctx.cfg.sft, ctx.cfg.run.seed
    examples = distributed.from_main_process(lambda: sft_examples(ctx))  # multi-host: only host 0 has the file
    per_epoch = max(1, len(examples) // s.batch_size)
    total = s.steps or per_epoch * s.epochs
    prefix = common_prefix([ids for ids, _ in examples])
    plan = plan_batches(ctx, examples, total, prefix)
    micro = microbatch_count(plan.rows, s.microbatch_size, ctx.mesh, "sft.microbatch_size")
    platform = ctx.mesh.devices.flat[0].platform  # packed rows do not begin alike
    shared_prefix = 0 if plan.enabled else shared_prefix_tokens(prefix, ctx.model_cfg, length=plan.length,
                                                               platform=platform)
    step_fn = make_sft_step(ctx.model_cfg, optimizer_from_config(s, total_steps=total), ctx.mesh, microbatches=micro,
                            shared_prefix=shared_prefix, logits_chunk=s.logits_chunk)
    ckpt = ctx.checkpointer("sft")
    restored = ckpt.restore_latest(step_fn.init_state(params)) if ctx.resume else None
    if restored is not None:
        start, state = restored.step, restored.state
        print(f"[sft] resumed at step {start}", flush=True)
        if restored.metadata.get("extra", {}).get("done"):
            ckpt.close()
            return state.params
    else:  # a fresh SFT stage: the warm-ups (if any) come first
        start, state = 0, step_fn.init_state(domain_warmup(ctx, copy_warmup(ctx, params)))
    divisor = batch_divisor(ctx.mesh, micro)
    peak = ctx.peak_flops_per_device  # before the first step: on a CPU it is measured

    def step(state, index):
        chosen = [examples[i] for i in step_examples(len(examples), s.batch_size, seed, index)]
        if plan.enabled:
            bins = pack([len(ids) for ids, _ in chosen], plan.length)
            batch = packed_batch(chosen, bins, ctx.pad_id, plan.length, plan.rows, context_weight=s.context_weight,
                                 context_start=prefix)
        else:
            batch = sft_batch(chosen, ctx.pad_id, plan.length, context_weight=s.context_weight, context_start=prefix)
        # multi-host: every process built this same batch; each places its own devices' rows
        placed = place_shared(batch, ctx.mesh, divisor, ctx.pad_id)

        def update():  # waits for the step: its metrics come to the host
            new_state, metrics = step_fn(state, placed)
            return new_state, jax.device_get(metrics)

        (state, metrics), compute_s = call_without_compile(update)
        rows, length = batch["tokens"].shape
        padded = train_step_flops(ctx.model_cfg, rows, length, shared_prefix=shared_prefix, microbatches=micro)
        flops = real_token_flops(ctx.model_cfg, [len(ids) for ids, _ in chosen], passes=3.0,
                                 shared_prefix=shared_prefix, prefix_runs=micro)
        return state, {**{k: float(v) for k, v in metrics.items() if k != "step"},
                       **perf_record(flops, compute_s, ctx.mesh.size, peak, padded_flops=padded)}

    hooks = [ProfileHook(ctx.profile_window("sft")),  # first: the trace ends before the others' work
             MetricsHook(ctx.metrics_writer("sft", start)),
             ProgressHook(ctx.progress(total, start=start), total, show=lambda r: {"loss": r["loss"]},
                          line=lambda i, r: f"[sft] step {i}/{total}, loss {r['loss']:.4f}",
                          every=max(1, total // 10)),
             CheckpointHook(ckpt, total, config=config_to_dict(ctx.cfg),
                            extra=lambda i: {"extra": {"done": i == total}}),
             NonFiniteHook(s.max_consecutive_skips, "sft.max_consecutive_skips")]
    return run_steps(state, start, total, step, hooks).params
