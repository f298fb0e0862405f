"""The training run: cold-start SFT, then GRPO with the simulated user in the loop.

One RL step: the next `tasks_per_step` tasks of the (seeded, per-epoch shuffled) task
stream → `n` rollouts each through the engine (which reads the live params directly)
→ trajectories collated to a fixed-shape batch → the sharded GRPO update (advantages,
clipped loss, KL to the SFT reference, AdamW) → metrics and checkpoint. Everything a
resumed run needs — params, optimizer state, step, RNG seed and the task-stream
position — is in the checkpoint, and every random choice is a function of (seed, step),
so a run killed with -9 and resumed goes on exactly as if uninterrupted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np

from muajax import distributed, runtime
from muajax.chat import im_end_id, render_messages_ids, system_prompt_ids
from muajax.checkpoint import Checkpointer
from muajax.config import TrainConfig, config_to_dict
from muajax.engine.engine import Engine
from muajax.evaluation import evaluate_policy
from muajax.metrics import MetricsWriter, ProgressBar
from muajax.rl.optim import optimizer_from_config
from muajax.rl.sft import make_sft_step
from muajax.rl.step import GRPOOptions, make_grpo_step
from muajax.rollout import RolloutOptions, run_rollouts_sync
from muajax.trajectory import rollout_metrics

log = logging.getLogger(__name__)
LENGTH_MULTIPLE = 128  # padded batch lengths are multiples of this: few shapes, few compilations
ROLLOUT_LENGTH_MULTIPLE = 512  # rollout lengths vary step to step: coarser buckets, fewer compilations


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


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, start_time: float | None = None,
                 env=None, user=None, tokenizer=None):
        """`env`, `user` and `tokenizer` replace what the config would build (tests, custom domains)."""
        self.cfg, self.resume = cfg, resume
        self.start_time = start_time or time.time()
        self.run_dir = cfg.run_dir
        self.main = jax.process_index() == 0
        if self.main:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                from muajax.config import dump_yaml

                f.write(dump_yaml(cfg))  # the config holds env-var names only, never secrets
        self.mesh = runtime.make_mesh(cfg)
        self.env = env or runtime.make_environment(cfg)
        self.user = user or runtime.make_user(cfg, self.env)
        self.model_cfg, self.tok, self.hf_dir = runtime.model_and_tokenizer(cfg, self.env, self.run_dir, tokenizer)
        self.summary: dict[str, Any] = {}
        r = cfg.rollout
        self.rollout_options = RolloutOptions.from_config(r, communicate_info=False)
        slots = r.num_slots or r.n_per_task * r.tasks_per_step
        self.engine_slots = max(slots, self._eval_trials() * len(self._eval_tasks()))

    # ------------------------------------------------------------------ helpers
    def _eval_tasks(self):
        tasks = self.env.tasks(self.cfg.env.eval_split)
        return tasks[: self.cfg.eval.max_tasks] if self.cfg.eval.max_tasks else tasks

    def _eval_trials(self) -> int:
        return 1 if self.cfg.eval.temperature == 0 else self.cfg.eval.trials

    def _engine(self, params) -> Engine:
        if not hasattr(self, "engine"):
            self.engine = Engine(params, self.model_cfg, num_slots=self.engine_slots,
                                 max_len=self.cfg.rollout.max_context, mesh=self.mesh,
                                 stop_ids=(im_end_id(self.tok),), decode_chunk=16,
                                 min_batch_bucket=min(8, self.engine_slots))
        self.engine.params = params  # the engine reads the live params: no copy
        return self.engine

    def _checkpointer(self, stage: str) -> Checkpointer:
        c = self.cfg.checkpoint
        return Checkpointer(os.path.join(self.cfg.checkpoint_dir, stage), keep=c.keep, every_steps=c.every_steps)

    def _pad_batch(self, batch: dict, divisor: int) -> dict:
        """Pad rows (all-masked: they contribute nothing) up to a multiple of the batch devices."""
        b = batch["tokens"].shape[0]
        extra = -b % divisor
        if not extra:
            return batch
        out = {}
        for key, x in batch.items():
            pad = np.zeros((extra,) + x.shape[1:], x.dtype)
            if key == "tokens":
                pad[:] = self.tok_pad
            if key == "group_ids":
                pad[:] = np.arange(extra) + x.max() + 1  # singleton groups: advantage 0
            out[key] = np.concatenate([x, pad])
        return out

    @property
    def tok_pad(self) -> int:
        return int(getattr(self.tok, "pad_token_id", None) or 0)

    def evaluate(self, params, label: str) -> dict[str, Any]:
        engine = self._engine(params)
        e = self.cfg.eval
        opts = RolloutOptions.from_config(self.cfg.rollout, communicate_info=e.communicate_info)
        t0 = time.time()
        summary, trajectories = evaluate_policy(engine, self.tok, self.env, self.user, self._eval_tasks(),
                                                trials=self._eval_trials(), temperature=e.temperature,
                                                options=opts, seed=self.cfg.run.seed + 1_000_003,
                                                communicate_info=e.communicate_info)
        summary["wall_s"] = time.time() - t0
        if self.main:
            with open(os.path.join(self.run_dir, f"eval_{label}.json"), "w") as f:
                json.dump({"summary": summary, "trajectories": [
                    {"task_id": t.task_id, "reward": t.reward, "partial": t.partial, "termination": t.termination,
                     "messages": t.messages} for t in trajectories]}, f, indent=1, default=str)
            rate = summary["confirm_rate"]
            print(f"[{label}] held-out success {summary['success']:.3f} on {summary['tasks']} tasks, "
                  f"confirm-before-write {'n/a' if rate is None else f'{rate:.3f}'}, "
                  f"turns {summary['turns']:.1f} ({summary['wall_s']:.0f}s)", flush=True)
        return summary

    # ------------------------------------------------------------------ SFT
    def sft_examples(self) -> list[tuple[list[int], list[int]]]:
        s = self.cfg.sft
        path = s.data
        if path is None:  # the built-in domain's scripted expert writes the cold-start data
            from muajax.synth import expert_records

            path = os.path.join(self.run_dir, "sft.jsonl")
            if self.main and not os.path.isfile(path):
                records = expert_records(self.env, self.env.tasks(self.cfg.env.train_split),
                                         careless=s.expert_careless, seed=self.cfg.run.seed)
                kept = [r for r in records if r["reward"] == 1.0]
                with open(path + ".tmp", "w") as f:
                    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
                os.replace(path + ".tmp", path)
                unconfirmed = sum(1 for r in kept if r["writes_confirmed"] and not all(r["writes_confirmed"]))
                print(f"[sft] expert data: {len(kept)} conversations with reward 1, {unconfirmed} of them write "
                      "before the user confirms", flush=True)
        examples = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                    ids, mask = render_messages_ids(self.tok, record.get("system"), record.get("tools"),
                                                    record["messages"])
                except (json.JSONDecodeError, KeyError, ValueError) as exc:
                    raise SystemExit(f"{path}:{lineno}: bad SFT record: {exc}") from None
                examples.append((ids[: s.max_len], mask[: s.max_len]))
        return examples

    def run_sft(self, params):
        s = self.cfg.sft
        distributed.use_process_local_engine(self)  # multi-host: each host decodes on its own devices
        examples = distributed.from_main_process(self.sft_examples)  # multi-host: only host 0 has the data file
        per_epoch = max(1, len(examples) // s.batch_size)
        total = s.steps or per_epoch * s.epochs
        optimizer = optimizer_from_config(s, total_steps=total)
        micro = s.batch_size // s.microbatch_size if s.microbatch_size else 1
        prefix = _common_prefix([ids for ids, _ in examples])
        step_fn = make_sft_step(self.model_cfg, optimizer, self.mesh, microbatches=micro, shared_prefix=prefix)
        ckpt = self._checkpointer("sft")
        # one padded length for the whole dataset: one compilation
        length = -(-max(len(ids) for ids, _ in examples) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        restored = ckpt.restore_latest(_abstract(step_fn.init_state(params))) if self.resume else None
        if restored is not None:
            start, state = restored.step, restored.state
            if restored.metadata.get("extra", {}).get("done"):
                ckpt.close()
                return state.params
        else:  # a fresh SFT stage: the copy warm-up (if any) comes first
            start, state = 0, step_fn.init_state(self.domain_warmup(self.copy_warmup(params)))
        writer = MetricsWriter(os.path.join(self.run_dir, "sft"), tensorboard=self.cfg.metrics.tensorboard,
                               is_main_process=self.main, resume_step=start if self.resume else None)
        bar = ProgressBar(total, initial=start, enabled=self.cfg.metrics.progress_bar, is_main_process=self.main)
        for step in range(start, total):
            epoch, index = divmod(step, per_epoch)
            order = np.random.default_rng([self.cfg.run.seed, 7, epoch]).permutation(len(examples))
            chosen = [examples[i] for i in order[index * s.batch_size:(index + 1) * s.batch_size]]
            batch = _sft_batch(chosen, self.tok_pad, length, context_weight=s.context_weight, context_start=prefix)
            batch = self._pad_batch(batch, _batch_divisor(self.mesh, micro))
            # multi-host: every process built this same batch; each places its own devices' rows
            state, metrics = step_fn(state, distributed.same_on_every_process(batch, self.mesh))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "step"}
            writer.write(step + 1, metrics)
            bar.update(step + 1, loss=metrics["loss"])
            bar.log(step + 1, f"[sft] step {step + 1}/{total}, loss {metrics['loss']:.4f}", every=max(1, total // 10))
            done = step + 1 == total
            if ckpt.should_save(step + 1) or done:
                ckpt.save(step + 1, state, config=config_to_dict(self.cfg), extra={"done": done}, force=done)
        bar.close()
        writer.close()
        ckpt.wait()
        ckpt.close()
        return state.params

    def copy_warmup(self, params):
        """`sft.copy_warmup_steps` of synthetic span copying over the model's vocabulary
        (see `muajax.rl.sft.copy_warmup_batch`); seeded, so a resumed run repeats it exactly."""
        s = self.cfg.sft
        if not s.copy_warmup_steps:
            return params
        from muajax.rl.sft import copy_warmup_batch

        special = {self.tok_pad, im_end_id(self.tok), getattr(getattr(self.tok, "vocab", None), "unk_id", -1)}
        size = len(self.tok) if hasattr(self.tok, "vocab") else self.model_cfg.vocab_size
        ids = [i for i in range(min(size, self.model_cfg.vocab_size)) if i not in special]
        rng = np.random.default_rng([self.cfg.run.seed, 31337])
        params, first, last = self._warmup(params, s.copy_warmup_steps,
                                           lambda: copy_warmup_batch(rng, ids, s.batch_size, s.copy_warmup_length))
        if self.main:
            print(f"[sft] copy warm-up: {s.copy_warmup_steps} steps, nll on the repeated span "
                  f"{first:.3f} -> {last:.3f}", flush=True)
        self.summary["copy_warmup_nll"] = last
        return params

    def domain_warmup(self, params, on_step=None):
        """`sft.domain_warmup_steps` on short windows of the built-in expert's conversations
        in other shops, each ending at a tool call (`muajax.envs.builtin.warmup`): loss on the
        assistant's tokens, rows drawn with a seeded generator."""
        s = self.cfg.sft
        if not s.domain_warmup_steps:
            return params
        system = (None, None)
        if s.domain_warmup_system_prompt:  # the built-in policy and tools are the same in every shop
            task = self.env.tasks(self.cfg.env.train_split)[0]
            session = self.env.reset(task)
            try:
                system = (self.env.policy_for(task), session.tools())
            finally:
                session.close()
        rows = [render_messages_ids(self.tok, *system, w) for w in runtime.warmup_windows(self.cfg)]
        prefix = _common_prefix([ids for ids, _ in rows]) if s.domain_warmup_system_prompt else 0
        # Windows run from ~50 to ~300 tokens (after the system prompt, if any): each batch
        # comes from one length bucket, so padding stays small and there is one compilation
        # per bucket.
        buckets: dict[int, list[int]] = {}
        for i, (ids, _) in enumerate(rows):
            buckets.setdefault(-(-len(ids) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, []).append(i)
        lengths = sorted(buckets)
        weights = np.array([len(buckets[n]) for n in lengths], np.float64)
        rng = np.random.default_rng([self.cfg.run.seed, 4242])

        def batch():
            length = lengths[rng.choice(len(lengths), p=weights / weights.sum())]
            pool = buckets[length]
            chosen = rng.choice(pool, s.domain_warmup_batch_size, replace=len(pool) < s.domain_warmup_batch_size)
            return _sft_batch([rows[i] for i in chosen], self.tok_pad, length)

        params, first, last = self._warmup(params, s.domain_warmup_steps, batch, on_step=on_step,
                                           shared_prefix=prefix)
        if self.main:
            print(f"[sft] domain warm-up: {s.domain_warmup_steps} steps on {len(rows)} tool-call windows from "
                  f"{s.domain_warmup_shops} other shops, assistant nll {first:.3f} -> {last:.3f}", flush=True)
        self.summary["domain_warmup_nll"] = last
        self.summary["domain_warmup_nll_first"] = first
        return params

    def _warmup(self, params, steps: int, make_batch, *, on_step=None, shared_prefix: int = 0):
        """(params, first nll, last nll) after `steps` SFT steps on `make_batch()` batches,
        with a fresh optimizer on the SFT schedule (its state is not kept). The nlls are
        means over the first and the last (up to) 20 steps, one batch being too noisy to
        report; `on_step(step, params, nll)` sees every step (snapshots)."""
        s = self.cfg.sft
        optimizer = optimizer_from_config(s, total_steps=steps)
        step_fn = make_sft_step(self.model_cfg, optimizer, self.mesh, shared_prefix=shared_prefix)
        state = step_fn.init_state(params)
        divisor = _batch_divisor(self.mesh, 1)
        nlls: list[float] = []
        bar = ProgressBar(steps, enabled=self.cfg.metrics.progress_bar, is_main_process=self.main, desc="warm-up")
        log_every = max(1, steps // 10)
        for step in range(1, steps + 1):
            batch = self._pad_batch(make_batch(), divisor)
            state, metrics = step_fn(state, distributed.same_on_every_process(batch, self.mesh))
            nlls.append(float(jax.device_get(metrics["nll"])))
            bar.update(step, nll=nlls[-1])
            bar.log(step, f"[warm-up] step {step}/{steps}, nll {np.mean(nlls[-log_every:]):.3f}", every=log_every)
            if on_step is not None:
                on_step(step, state.params, nlls[-1])
        bar.close()
        window = max(1, min(20, len(nlls) // 2))  # first and last never overlap
        return state.params, float(np.mean(nlls[:window])), float(np.mean(nlls[-window:]))

    # ------------------------------------------------------------------ GRPO
    def run_grpo(self, params):
        cfg, r, g = self.cfg, self.cfg.rollout, self.cfg.grpo
        distributed.use_process_local_engine(self)  # multi-host: each host decodes on its own devices
        tasks = self.env.tasks(cfg.env.train_split)
        steps = g.steps or max(1, g.epochs * len(tasks) // r.tasks_per_step)
        batch_size = r.n_per_task * r.tasks_per_step
        micro = batch_size // g.microbatch_size if g.microbatch_size else 1
        prefix = self._shared_system_prefix(tasks)
        options = GRPOOptions.from_config(g, temperature=max(r.temperature, 1e-6), num_groups=batch_size + 64,
                                          shared_prefix=prefix)
        step_fn = make_grpo_step(self.model_cfg, optimizer_from_config(g, total_steps=steps), self.mesh,
                                 options=options, microbatches=micro)
        reference = jax.device_put(params, step_fn.param_shardings) if options.uses_reference else None
        state = step_fn.init_state(params)
        stream = TaskStream(tasks, cfg.run.seed)
        ckpt = self._checkpointer("grpo")
        start = 0
        if self.resume:
            restored = ckpt.restore_latest(_abstract(state))
            if restored is not None:
                start, state = restored.step, restored.state
                stream.position = int(restored.data_position or 0)
                print(f"[grpo] resumed at step {start} (task stream position {stream.position})", flush=True)
        writer = MetricsWriter(self.run_dir, tensorboard=cfg.metrics.tensorboard, is_main_process=self.main,
                               resume_step=start if self.resume else None)
        bar = ProgressBar(steps, initial=start, enabled=cfg.metrics.progress_bar, is_main_process=self.main)
        for step in range(start, steps):
            t0 = time.time()
            engine = self._engine(state.params)
            device_before = engine.stats["device_s"]
            # multi-host: this process rolls out its contiguous share of the step's tasks (one
            # process: all of them) under their global indices, so seeds and group ids are the step's
            first, chosen = distributed.task_share(stream.take(r.tasks_per_step))
            trajectories = run_rollouts_sync(engine, self.tok, self.env, self.user, chosen,
                                             options=self.rollout_options, seed=_step_seed(cfg.run.seed, step),
                                             first_task_index=first)
            t_rollout = time.time() - t0
            batch = distributed.collate_share(trajectories, pad_id=self.tok_pad, multiple=ROLLOUT_LENGTH_MULTIPLE,
                                              first_group=first)
            if _common_prefix(batch["tokens"]) < prefix:
                raise RuntimeError(f"rollouts no longer share the {prefix}-token system prompt")
            if g.dynamic_sampling:  # DAPO: groups with one outcome carry no signal
                batch = _mask_uniform_groups(batch)
            divisor = _batch_divisor(self.mesh, micro)
            # multi-host: the processes' blocks become one global batch (advantages over all of it)
            batch = (distributed.global_batch(batch, self.mesh, divisor, pad_id=self.tok_pad)
                     if distributed.multiprocess() else self._pad_batch(batch, divisor))
            t1 = time.time()
            state, metrics = step_fn(state, batch, reference) if reference is not None else step_fn(state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "step"}
            t_update = time.time() - t1
            trajectories = distributed.gather_for_metrics(trajectories)  # multi-host: metrics of the whole step
            sampled = int(sum(t.num_sampled for t in trajectories))
            record = {**_flat(rollout_metrics(trajectories)), **metrics,
                      "time/rollout_s": t_rollout, "time/update_s": t_update,
                      "time/engine_busy_share": (engine.stats["device_s"] - device_before) / max(t_rollout, 1e-9),
                      "throughput/sampled_tokens_per_s": sampled / max(time.time() - t0, 1e-9),
                      "data/position": stream.position}
            writer.write(step + 1, record)
            bar.update(step + 1, reward=record.get("reward", 0.0), kl=metrics.get("kl", 0.0),
                       tokens_per_s=record["throughput/sampled_tokens_per_s"])
            bar.log(step + 1, f"[grpo] step {step + 1}/{steps}: reward {record.get('reward', 0.0):.3f}, "
                              f"kl {metrics.get('kl', 0.0):.4f}, rollout {t_rollout:.1f}s, update {t_update:.1f}s")
            if ckpt.should_save(step + 1) or step + 1 == steps:
                ckpt.save(step + 1, state, data_position=stream.position, config=config_to_dict(cfg),
                          force=step + 1 == steps)
        bar.close()
        writer.close()
        ckpt.wait()
        ckpt.close()
        return state.params

    def _shared_system_prefix(self, tasks) -> int:
        """Tokens every conversation starts with (the system prompt, if one domain): the GRPO
        step computes them once per batch instead of once per row."""
        prompts = {}
        for task in tasks:
            if task.domain not in prompts:
                session = self.env.reset(task)
                try:
                    prompts[task.domain] = system_prompt_ids(self.tok, self.env.policy_for(task), session.tools())
                finally:
                    session.close()
        rows = list(prompts.values())
        return len(rows[0]) if len(rows) == 1 else _common_prefix(rows)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        params = runtime.initial_params(self.model_cfg, self.hf_dir, self.mesh, cfg.run.seed)
        figures: dict[str, Any] = {}
        if "sft" in cfg.run.stages:
            params = self.run_sft(params)
            sft_eval = self.evaluate(params, "sft")
            figures.update(heldout_success_sft=sft_eval["success"], confirm_rate_sft=sft_eval["confirm_rate"],
                           partial_sft=sft_eval["partial"])
        if "grpo" in cfg.run.stages:
            params = self.run_grpo(params)
            grpo_eval = self.evaluate(params, "grpo")
            figures.update(heldout_success_grpo=grpo_eval["success"], confirm_rate_grpo=grpo_eval["confirm_rate"],
                           partial_grpo=grpo_eval["partial"])
        figures["params_sha256"] = params_fingerprint(params)
        figures["wall_s"] = round(time.time() - self.start_time, 1)
        figures["run_dir"] = self.run_dir
        return figures


# ---------------------------------------------------------------------- small pure helpers


def params_fingerprint(params) -> str:
    """sha256 over every parameter's bytes, in tree order: equal iff the params are bitwise equal."""
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        if not leaf.is_fully_addressable:  # split across hosts: every process gathers the whole leaf
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        digest.update(np.asarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _batch_divisor(mesh, microbatches: int) -> int:
    from muajax.parallel import batch_divisor

    return batch_divisor(mesh) * microbatches


def _common_prefix(rows) -> int:
    """Length of the longest prefix all rows share (0 for one row: nothing to share)."""
    if len(rows) < 2:
        return 0
    n = min(len(r) for r in rows)
    first = np.asarray(rows[0][:n])
    same = np.ones(n, bool)
    for row in rows[1:]:
        same &= np.asarray(row[:n]) == first
    return int(np.argmin(same)) if not same.all() else n - 1


def _step_seed(seed: int, step: int) -> int:
    return int(np.random.SeedSequence([seed, 104729, step]).generate_state(1, np.uint32)[0] >> 1)


def _sft_batch(examples, pad_id: int, length: int, *, context_weight: float = 0.0,
               context_start: int = 0) -> dict[str, np.ndarray]:
    """Padded tokens and the assistant-token loss mask; with a `context_weight`, also a
    `context_mask` of that weight on the other tokens from `context_start` (the end of the
    shared system prompt) to the row's end."""
    tokens = np.full((len(examples), length), pad_id, np.int32)
    mask = np.zeros((len(examples), length), np.int32)
    for i, (ids, m) in enumerate(examples):
        tokens[i, : len(ids)] = ids
        mask[i, : len(m)] = m
    batch = {"tokens": tokens, "loss_mask": mask}
    if context_weight:
        context = np.zeros((len(examples), length), np.float32)
        for i, (ids, _) in enumerate(examples):
            context[i, context_start: len(ids)] = context_weight
        batch["context_mask"] = np.where(mask == 0, context, 0.0).astype(np.float32)
    return batch


def _mask_uniform_groups(batch: dict) -> dict:
    batch = dict(batch)
    keep = np.ones(len(batch["rewards"]), bool)
    for gid in np.unique(batch["group_ids"]):
        rows = batch["group_ids"] == gid
        if np.ptp(batch["rewards"][rows]) == 0:
            keep[rows] = False
    batch["loss_mask"] = batch["loss_mask"] * keep[:, None]
    return batch


def _flat(tree, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        elif isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
            out[name] = float(value)
    return out
