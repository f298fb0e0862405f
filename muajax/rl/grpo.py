"""GRPO as MUA-RL ran it: its settings (the `grpo:` section of a run config) and the update.

The update is one instance of `muajax.rl.step.TrainStep`: given each row's group
advantage (`muajax.rl.advantages.group_advantages`, computed by the host batch over whole
groups), the clipped policy loss with dual clip and KL to the reference
(`muajax.rl.losses`), AdamW. Variants are value sets of the same settings: DAPO =
clip_high 0.28, dynamic_sampling, kl_coef 0; GSPO = ratio_level sequence, clip_low 3e-4,
clip_high 4e-4; Dr. GRPO = advantage_scale none, agg seq-mean-token-sum-norm.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from muajax import parallel
from muajax.settings.fields import Checked, bounded, check
from muajax.models.qwen3 import Qwen3Config
from muajax.models.sharding import param_shardings
from muajax.rl.losses import finalize_policy_metrics, policy_loss_terms
from muajax.rl.moe_aux import add_aux, finalize_aux, real_tokens, wants_aux
from muajax.rl.optim import Optimizer
from muajax.rl.sequence import sequence_logprobs
from muajax.rl.step import LossFn, TrainStep, shift_left, split_microbatches

Schedule = Literal["constant", "warmup_cosine"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig(Checked):
    """The GRPO update (stage "grpo"): optimizer, clipping, KL and advantage settings."""

    steps: int | None = bounded(None, ge=1)  # if set, caps the run; else `epochs` over the tasks
    epochs: int = bounded(30, ge=1)  # passes over the train tasks (the released script's; the paper reports 25)
    learning_rate: float = bounded(1e-6, gt=0)  # AdamW's (the peak, with a schedule)
    schedule: Schedule = "constant"  # "warmup_cosine": linear warmup, then cosine decay to 0
    warmup_steps: int = bounded(0, ge=0)  # optimizer updates of linear warmup from 0
    betas: tuple[float, float] = bounded((0.9, 0.999), ge=0, lt=1)  # AdamW's (b1, b2)
    weight_decay: float = bounded(0.01, ge=0)  # AdamW's, on every parameter (norms too, as verl)
    grad_clip: float | None = bounded(1.0, gt=0)  # the gradients' global-norm bound; null: no clipping
    clip_low: float = bounded(0.2, gt=0, lt=1)  # the ratio's lower clip is 1 - clip_low (kept positive)
    clip_high: float = bounded(0.2, gt=0)  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    dual_clip: float | None = bounded(3.0, gt=1)  # c: bounds the loss at c*|A| when A < 0; null: no dual clip
    kl_coef: float = bounded(0.001, ge=0)  # weight of the per-token KL to the reference; 0: no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k1: logp - ref; k2: half its square; k3: verl's low_var_kl
    kl_clamp: float | None = bounded(10.0, gt=0)  # k3 is clamped to [-kl_clamp, kl_clamp]; null: unclamped
    # How token losses reduce to the batch's: a mean over tokens, a mean of each sequence's mean,
    # or each sequence's sum over the padded length, averaged over sequences (Dr. GRPO).
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    ratio_level: Literal["token", "sequence"] = "token"  # per-token ratios (GRPO) or one per sequence (GSPO)
    advantage_scale: Literal["std", "none"] = "std"  # divide by the group's std (GRPO) or not (Dr. GRPO)
    advantage_eps: float = bounded(1e-6, gt=0)  # added to the group's std
    dynamic_sampling: bool = False  # DAPO: groups whose rollouts all scored alike are masked out
    # Rows per optimizer update: None = the whole rollout batch, one update per step (the
    # paper's). With it, each step makes ppo_epochs passes over the batch in mini-batches
    # of this size, as verl's ppo_mini_batch_size and ppo_epochs do.
    minibatch_size: int | None = bounded(None, ge=1)
    ppo_epochs: int = bounded(1, ge=1)  # passes over the rollout batch per step (needs minibatch_size)
    # rows per gradient pass within one update: a multiple of data*fsdp (each device takes whole rows)
    microbatch_size: int | None = bounded(None, ge=1)
    logits_chunk: int | None = bounded(None, ge=1)  # positions per LM-head chunk: never all [T, V] at once
    # The KL reference model's weights: None = the params' own dtype; "bfloat16" halves its
    # memory (its logprobs then round like a bfloat16 model's).
    reference_dtype: Literal["float32", "bfloat16"] | None = None
    # Padded lengths of the rollout batches, one compilation of the step each: a batch takes
    # the shortest that holds its longest rollout. None: 512 doubled up to rollout.max_context.
    length_buckets: tuple[int, ...] | None = None
    # Trajectories packed into rows of the length bucket with segment ids (first-fit
    # decreasing; the shared prefix once per row), so the update computes close to the real
    # tokens; false: one trajectory per row, padded to the bucket of the longest. Loss and
    # gradient are the same either way (`muajax.runtime.grpo_packing`).
    pack_rows: bool = True
    # More than this many steps in a row with a non-finite loss or gradient (each such
    # update is dropped) stops the run after a checkpoint: the cause (a learning rate, a
    # poisoned batch, params gone NaN) will not fix itself. null: never stop.
    max_consecutive_skips: int | None = bounded(3, ge=0)
    # verl's way: the old logprobs come from the trainer's own forward of the params the step
    # starts from, not from the rollout engine (their ratio is then exactly 1 on the first
    # pass). With one update per step that forward is the update's own (no extra cost); with
    # mini-batches, one forward over the whole batch before the first update.
    recompute_old_logprobs: bool = False
    # Off-policy data (asynchronous rollouts, an engine whose numbers differ from the trainer's):
    # with recompute_old_logprobs, each token's clipped loss (its ratio against the recomputed,
    # proximal logprobs) is weighted by min(pi_prox / pi_behav, cap), detached, pi_behav the
    # rollout engine's sampling logprobs (decoupled PPO; verl's truncated importance sampling;
    # 2 is a common cap). null: no weight, the recomputed logprobs just replace the engine's.
    # Needs recompute_old_logprobs.
    behaviour_is_cap: float | None = bounded(None, ge=1)
    # Asynchronous GRPO (muajax/train/async_grpo.py): the rollouts of the next batches run
    # while this one updates, on weights at most this many updates old (a row's staleness:
    # the update's version minus the oldest version that sampled its tokens). 0: rollout,
    # then update, strictly in turn (the synchronous loop, unchanged).
    max_staleness: int = bounded(0, ge=0)
    # Routing replay (a mixture of experts): the rollout engine keeps the experts it routed
    # every token of a trajectory to, and the training forwards (the policy's, the reference's
    # and the recomputed old logprobs') use those experts instead of their routers' top k,
    # so the trainer's logprobs of a rollout are the engine's (to float rounding) even where
    # a near tie would route the trainer's computation elsewhere. The routers' probabilities
    # still weight the replayed experts (their gradient flows). false: each forward routes.
    routing_replay: bool = False

    def validate(self) -> None:
        check(self.steps is None or self.warmup_steps < self.steps, "warmup_steps",
              f"({self.warmup_steps}) must be smaller than steps ({self.steps})")
        check(self.minibatch_size is not None or self.ppo_epochs == 1, "ppo_epochs",
              f"({self.ppo_epochs}) needs grpo.minibatch_size: several passes are several updates per step")
        check(self.minibatch_size is None or self.microbatch_size is None
              or self.minibatch_size % self.microbatch_size == 0, "microbatch_size",
              f"({self.microbatch_size}) must divide minibatch_size ({self.minibatch_size})")
        check(self.behaviour_is_cap is None or self.recompute_old_logprobs, "behaviour_is_cap",
              "needs grpo.recompute_old_logprobs: without it the proximal policy is the behaviour policy")
        buckets = self.length_buckets
        check(buckets is None or (len(buckets) > 0 and all(b >= 1 for b in buckets)
                                  and list(buckets) == sorted(set(buckets))), "length_buckets",
              f"must be positive lengths in increasing order, got {buckets}")

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def loss_settings(self) -> dict:
        """Keyword arguments of `muajax.rl.losses.policy_loss_terms`."""
        return dict(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                    kl_coef=self.kl_coef, kl_estimator=self.kl_estimator, kl_clamp=self.kl_clamp, agg=self.agg,
                    ratio_level=self.ratio_level, behaviour_is_cap=self.behaviour_is_cap)

    def updates_per_step(self, batch_size: int) -> int:
        """Optimizer updates one GRPO step makes over a rollout batch of `batch_size` rows."""
        return 1 if self.minibatch_size is None else self.ppo_epochs * max(1, batch_size // self.minibatch_size)


def _packing(mb: dict, segments: int | None) -> dict:
    """policy_loss_terms' packed-row arguments for a microbatch (none for padded rows)."""
    if "segment_ids" not in mb:
        return {}
    if segments is None:
        raise ValueError("a packed GRPO batch needs the step's `segments` (most trajectories per update + 1)")
    # the targets' segments: position t predicts token t + 1
    return dict(segment_ids=shift_left(mb["segment_ids"]), num_segments=segments, sum_norm=mb["sum_norm"])


def _old_logprobs(grpo: GRPOConfig, mb: dict, logp):
    """(old, behaviour) logprobs of a microbatch's targets: without recompute, the rollout's
    and None; with it, the proximal policy's (the params the step starts from) and the
    rollout's (the behaviour policy, for the off-policy correction)."""
    rollout = shift_left(mb["old_logprobs"].astype(jnp.float32))
    if not grpo.recompute_old_logprobs:
        return rollout, None
    if grpo.minibatch_size is None:
        # one update per step: the params being differentiated are the ones the step starts from
        return jax.lax.stop_gradient(logp), rollout
    if "prox_logprobs" not in mb:
        raise KeyError("grpo.recompute_old_logprobs with mini-batches: the batch needs 'prox_logprobs', the "
                       "recomputed logprobs (`make_old_logprobs_fn`), beside the rollout's 'old_logprobs'")
    return shift_left(mb["prox_logprobs"].astype(jnp.float32)), rollout


def _replayed(grpo: GRPOConfig, mb: dict):
    """The microbatch's stored experts [B, T, L, k] with `grpo.routing_replay`, else None."""
    if not grpo.routing_replay:
        return None
    if "routing" not in mb:
        raise KeyError("grpo.routing_replay: the batch needs 'routing', the rollout's experts of every token "
                       "(an engine with record_experts, trajectories' `experts`)")
    return mb["routing"]


def grpo_loss_fn(cfg: Qwen3Config, grpo: GRPOConfig, *, temperature: float, shared_prefix: int,
                 segments: int | None = None) -> LossFn:
    """One microbatch's GRPO terms; `ref_params` is only read (and run) when kl_coef > 0.
    Packed rows (`segment_ids` in the batch) need `segments`, an id bound."""

    def loss_fn(params, ref_params, mb):
        tokens = mb["tokens"]
        targets = shift_left(tokens)
        mask = shift_left(mb["loss_mask"]).astype(jnp.float32)
        packing = _packing(mb, segments)
        seg = mb.get("segment_ids")
        advantages = shift_left(mb["advantages"]) if packing else mb["advantages"]
        moe_valid = real_tokens(mb["loss_mask"], seg) if wants_aux(cfg) else None
        routing = _replayed(grpo, mb)
        logp, ent, *moe_terms = sequence_logprobs(params, cfg, tokens, targets, temperature=temperature,
                                                  logits_chunk=grpo.logits_chunk, shared_prefix=shared_prefix,
                                                  segment_ids=seg, moe_valid=moe_valid, routing=routing)
        old, behaviour = _old_logprobs(grpo, mb, logp)
        ref_logp = None
        if grpo.uses_reference:
            ref_logp, _ = sequence_logprobs(ref_params, cfg, tokens, targets, temperature=temperature,
                                            logits_chunk=grpo.logits_chunk, shared_prefix=shared_prefix,
                                            segment_ids=seg, routing=routing)
            ref_logp = jax.lax.stop_gradient(ref_logp)
        loss_sum, denom, sums = policy_loss_terms(logp, old, ref_logp, advantages, mask, **grpo.loss_settings(),
                                                  **packing, behaviour_logprobs=behaviour)
        sums = dict(sums, entropy_sum=jax.lax.stop_gradient(jnp.where(mask > 0, ent, 0.0).sum()))
        if moe_terms:  # the router's load-balancing loss (muajax.rl.moe_aux)
            loss_sum, sums = add_aux(cfg, loss_sum, denom, sums, moe_terms[0])
        return loss_sum, denom, sums

    return loss_fn


def make_old_logprobs_fn(cfg: Qwen3Config, mesh, grpo: GRPOConfig, *, temperature: float, shared_prefix: int = 0,
                         microbatches: int = 1, packed: bool = False) -> Callable:
    """`fn(params, batch) -> prox_logprobs` f32 [B, T]: the trainer's forward of `params` (no
    gradient) over the batch's tokens, indexed by the token they describe like the rollout's
    (0 off the loss mask): `grpo.recompute_old_logprobs` with mini-batches, computed for every
    mini-batch before the step's first update and carried beside the rollout's old_logprobs
    as the batch's `prox_logprobs` (the proximal policy of the off-policy correction). Rows
    run `microbatches` at a time; `packed` rows carry `segment_ids`; with
    `grpo.routing_replay` the batch's `routing` forces the experts."""
    shardings = param_shardings(cfg, mesh)
    rows = NamedSharding(mesh, PartitionSpec(parallel.BATCH_AXES, None))
    optional = (("segment_ids",) if packed else ()) + (("routing",) if grpo.routing_replay else ())

    def one(params, tokens, extra):
        logp, _ = sequence_logprobs(params, cfg, tokens, shift_left(tokens), temperature=temperature,
                                    logits_chunk=grpo.logits_chunk, shared_prefix=shared_prefix,
                                    segment_ids=extra.get("segment_ids"), routing=extra.get("routing"))
        return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp[:, :-1]], axis=1)  # by the token predicted

    def fn(params, tokens, loss_mask, *rest):  # rest: the `optional` fields
        extra = dict(zip(optional, rest))
        if microbatches == 1:
            old = one(params, tokens, extra)
        else:
            split = lambda x: split_microbatches(x, microbatches, mesh)
            old = jax.lax.map(lambda xs: one(params, *xs), (split(tokens), jax.tree.map(split, extra)))
            old = old.swapaxes(0, 1).reshape(tokens.shape)  # undo the strided split
        return jnp.where(loss_mask > 0, old, 0.0)

    fields = ("tokens", "loss_mask") + optional
    field_sh = [parallel.batch_sharding(mesh, 4) if k == "routing" else rows for k in fields]
    jitted = jax.jit(fn, in_shardings=(shardings, *field_sh), out_shardings=rows)
    arguments = lambda batch: tuple(batch[k] for k in fields)

    def old_logprobs(params, batch):
        with parallel.activation_rules(mesh):
            return jitted(params, *arguments(batch))

    def lower(params, batch):  # for ahead-of-time analysis (the planner)
        with parallel.activation_rules(mesh):
            return jitted.lower(params, *arguments(batch))

    old_logprobs.lower = lower
    return old_logprobs


def grpo_prepare(batch: dict) -> dict:
    """Check the batch's keys. Its advantages come with it, computed on the host over whole
    groups before any split (`muajax.runtime.host_batch.with_advantages`), so a group may
    straddle microbatches and mini-batches."""
    for key in ("tokens", "loss_mask", "old_logprobs", "advantages"):
        if key not in batch:
            raise KeyError(f"GRPO batch needs {key!r}; got keys {sorted(batch)} (advantages come from "
                           "muajax.runtime.host_batch.with_advantages)")
    return dict(batch)


def grpo_finalize(denom, sums) -> dict:
    metrics = finalize_policy_metrics(denom, sums)
    metrics["entropy"] = sums["entropy_sum"] / jnp.maximum(sums["num_tokens"], 1.0)
    return metrics | finalize_aux(denom, sums)


def make_grpo_step(cfg: Qwen3Config, optimizer: Optimizer, mesh, *, grpo: GRPOConfig = GRPOConfig(),
                   temperature: float = 1.0, shared_prefix: int = 0,
                   microbatches: int = 1, donate: bool = True, segments: int | None = None) -> TrainStep:
    """The GRPO update. Call as `step(state, batch, ref_params)`; without KL (kl_coef == 0)
    as `step(state, batch)`: the reference model is then neither passed nor run.

    `temperature` is the rollout's (logprobs are of the tempered distribution), `shared_prefix`
    the tokens every row starts with (the system prompt: computed once per batch), `segments`
    the bound on packed rows' segment ids (`muajax.runtime.grpo_packing`; None: padded rows)."""
    shardings = param_shardings(cfg, mesh)
    loss = grpo_loss_fn(cfg, grpo, temperature=temperature, shared_prefix=shared_prefix, segments=segments)
    step = TrainStep(loss, optimizer, mesh, shardings, microbatches=microbatches,
                     prepare_fn=grpo_prepare, finalize_fn=grpo_finalize,
                     frozen_shardings=shardings if grpo.uses_reference else None,
                     requires_frozen=grpo.uses_reference, donate=donate)
    step.model_cfg, step.grpo = cfg, grpo
    return step
