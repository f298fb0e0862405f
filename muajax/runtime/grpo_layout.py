"""The GRPO update as the trainer runs it, decided in one place: the trainer
(`muajax.train.grpo`) builds its step and batches from a `GRPOLayout`, and the planner
(`muajax.planning`) builds the abstract step and batch it compiles from the same layout, so
the two cannot plan and run different programs.

A layout fixes, from the run config, the mesh and the conversations' common prompt:
- the rows of one optimizer update (the rollout batch, or a mini-batch) and how many
  microbatches they run in (`grpo.microbatch_size`), padded to data x fsdp x microbatches;
- the length buckets a collated batch is padded to (`grpo.length_buckets`, or powers of two
  from 512 up to `rollout.max_context`);
- the shared prefix: the tokens every row starts with that the step computes once per
  microbatch instead of once per row (`shared_prefix_tokens`);
- the logprobs' temperature (the rollout's);
- whether trajectories are packed into rows with segment ids (`grpo.pack_rows`,
  `muajax.runtime.grpo_packing`) or padded one per row;
- with routing replay (`grpo.routing_replay`, a mixture of experts) the batch's `routing`
  field, the rollout's experts of every token [rows, T, L, k].

The batch an update takes is `fields()` (`GRPO_BATCH_FIELDS` padded, `PACKED_BATCH_FIELDS`
packed) at [rows, bucket]: the host builds it (`GRPOLayout.update_batches`) and the planner
declares it abstractly (`GRPOLayout.abstract_batch`). Padded rows are always the padded
rows; packed ones are one of `row_buckets()`, as few as the step's lengths pack into, and
the planner compiles the most (what a step whose trajectories do not pack runs: its memory
bounds every other's).
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from muajax import parallel
from muajax.agent.chat import system_prompt_ids
from muajax.engine.experts import expert_dtype
from muajax.models import attention
from muajax.models.qwen3 import Qwen3Config
from muajax.rl.grpo import make_grpo_step, make_old_logprobs_fn
from muajax.rl.optim import optimizer_from_config
from muajax.runtime.grpo_packing import grpo_packed_batches, row_buckets
from muajax.runtime.host_batch import (batch_divisor, common_prefix, grpo_update_batches, length_buckets,
                                       microbatch_count)
from muajax.settings.fields import ConfigError

# A common prompt shorter than this is not worth a prefix pass of its own: a page of the
# engine's TPU pool, and the smallest block the attention kernels tile by.
MIN_SHARED_PREFIX = 128
# What one update's batch holds: name -> (dtype, per-row shape: "T" is the length bucket).
GRPO_BATCH_FIELDS = {"tokens": (np.int32, ("T",)), "loss_mask": (np.int32, ("T",)),
                     "old_logprobs": (np.float32, ("T",)), "advantages": (np.float32, ())}
# Packed rows: advantages per token, each trajectory's segment id, and the padded length the
# "seq-mean-token-sum-norm" aggregation divides by.
PACKED_BATCH_FIELDS = {"tokens": (np.int32, ("T",)), "loss_mask": (np.int32, ("T",)),
                       "old_logprobs": (np.float32, ("T",)), "advantages": (np.float32, ("T",)),
                       "segment_ids": (np.int32, ("T",)), "sum_norm": (np.float32, ())}


def system_prompt_prefix(env, tokenizer, tasks) -> int:
    """Tokens every conversation of `tasks` starts with: the whole system prompt when they
    come from one domain, else the prompts' common beginning."""
    prompts = {}
    for task in tasks:
        if task.domain not in prompts:
            session = env.reset(task)
            try:
                prompts[task.domain] = system_prompt_ids(tokenizer, env.policy_for(task), session.tools())
            finally:
                session.close()
    rows = list(prompts.values())
    return len(rows[0]) if len(rows) == 1 else common_prefix(rows)


def shared_prefix_tokens(prompt_prefix: int, model_cfg: Qwen3Config, *, length: int, platform: str) -> int:
    """How many of the `prompt_prefix` common tokens the step computes once (0: none).

    Computing the prefix once runs the rows' attention in its cache form
    (`muajax.models.qwen3.forward_shared_prefix`), which has no splash or cuDNN kernel: on a
    TPU or a GPU it would trade the fast kernel (and its memory: +88% temporaries measured
    for a tiny model at 8192 positions on 4 devices) for the prefix's FLOPs. So it is shared
    only where the rows' attention is the same either way, and only when it is at least
    `MIN_SHARED_PREFIX` tokens."""
    if prompt_prefix < MIN_SHARED_PREFIX:
        return 0
    kinds = {attention.resolve(model_cfg.attention, num_keys=length, dtype=model_cfg.dtype, platform=platform,
                               cache_form=cache_form) for cache_form in (False, True)}
    return prompt_prefix if len(kinds) == 1 else 0


def rows_attention(model_cfg: Qwen3Config, *, length: int, platform: str, shared_prefix: int) -> str:
    """The attention a train step's rows run (`muajax.models.attention.resolve`): the
    model's in its cache form when they extend a shared prefix."""
    return attention.resolve(model_cfg.attention, num_keys=length, dtype=model_cfg.dtype, platform=platform,
                             cache_form=shared_prefix > 0)


@dataclasses.dataclass(frozen=True)
class GRPOLayout:
    batch_size: int                # rollouts per step
    update_rows: int               # rows per optimizer update (the batch, or a mini-batch)
    microbatches: int
    buckets: tuple[int, ...]       # the lengths a batch is padded to
    shared_prefix: int
    temperature: float             # the rollout's, floored away from 0 (logprobs divide by it)
    divisor: int                   # an update's rows come in multiples of this
    packed: bool = False           # trajectories packed into rows with segment ids
    # the step's batch also carries `prox_logprobs`, recomputed before the first update
    # (grpo.recompute_old_logprobs with mini-batches), beside the host's fields
    proximal: bool = False
    # routing replay: (layers, experts per token, dtype) of the batch's `routing`; None: none
    routing: tuple | None = None

    def fields(self) -> dict:
        """The update batch's fields: name -> (dtype, per-row shape)."""
        fields = PACKED_BATCH_FIELDS if self.packed else GRPO_BATCH_FIELDS
        if self.routing is None:
            return fields
        layers, k, dtype = self.routing
        return {**fields, "routing": (dtype, ("T", layers, k))}

    @property
    def segments(self) -> int | None:
        """Packed rows: a bound on their segment ids (every trajectory of an update, + 1)."""
        return self.update_rows + 1 if self.packed else None

    def row_buckets(self) -> tuple[int, ...]:
        """The row counts an update's batch may have (one process)."""
        return row_buckets(self.padded_rows, self.divisor) if self.packed else (self.padded_rows,)

    @property
    def padded_rows(self) -> int:
        """One update's rows after the host pads them (`host_batch.pad_to_multiple`)."""
        return -(-self.update_rows // self.divisor) * self.divisor

    @property
    def longest(self) -> int:
        return max(self.buckets)

    def make_step(self, model_cfg: Qwen3Config, mesh, grpo, *, total_steps: int):
        """The jitted GRPO update (`muajax.rl.grpo.make_grpo_step`) for this layout."""
        optimizer = optimizer_from_config(grpo, total_steps=total_steps)
        return make_grpo_step(model_cfg, optimizer, mesh, grpo=grpo, temperature=self.temperature,
                              shared_prefix=self.shared_prefix, microbatches=self.microbatches,
                              segments=self.segments)

    def make_old_logprobs_fn(self, model_cfg: Qwen3Config, mesh, grpo):
        """The forward that recomputes old logprobs before the first of several mini-batch
        updates (`grpo.recompute_old_logprobs`), or None where the step does not run one."""
        if not (grpo.recompute_old_logprobs and grpo.minibatch_size is not None):
            return None
        return make_old_logprobs_fn(model_cfg, mesh, grpo, temperature=self.temperature,
                                    shared_prefix=self.shared_prefix, microbatches=self.microbatches,
                                    packed=self.packed)

    def update_batches(self, trajectories, grpo, *, mesh, pad_id: int, first_group: int) -> list[dict]:
        """A step's trajectories -> the placed batch of each of its updates, padded or packed."""
        common = dict(mesh=mesh, pad_id=pad_id, buckets=self.buckets, first_group=first_group,
                      divisor=self.divisor, shared_prefix=self.shared_prefix, routing=self.routing)
        if self.packed:
            return grpo_packed_batches(trajectories, grpo, padded_rows=self.padded_rows, **common)
        return grpo_update_batches(trajectories, grpo, **common)

    def abstract_batch(self, mesh, length: int | None = None, rows: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """One update's batch as the step takes it (the host's, plus the `prox_logprobs` the
        trainer adds when `proximal`), at `length` (default: the longest bucket) and `rows`
        (default: the most, `padded_rows`)."""
        length = self.longest if length is None else length
        rows = self.padded_rows if rows is None else rows
        out = {}
        fields = dict(self.fields(), **({"prox_logprobs": (np.float32, ("T",))} if self.proximal else {}))
        for name, (dtype, row) in fields.items():
            shape = (rows, *(length if d == "T" else d for d in row))
            out[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=parallel.batch_sharding(mesh, len(shape)))
        return out


def make_layout(mesh, model_cfg: Qwen3Config, grpo, *, batch_size: int, max_context: int, temperature: float,
                prompt_prefix: int) -> GRPOLayout:
    """The layout of GRPO updates (`grpo`: the config's GRPOConfig) over steps of
    `batch_size` rollouts of up to `max_context` tokens on `mesh`, the conversations sharing
    a `prompt_prefix`-token beginning (`system_prompt_prefix`)."""
    update_rows = grpo.minibatch_size or batch_size
    micro = microbatch_count(update_rows, grpo.microbatch_size, mesh, "grpo.microbatch_size")
    buckets = tuple(grpo.length_buckets or length_buckets(max_context))
    platform = mesh.devices.flat[0].platform
    prefix = shared_prefix_tokens(prompt_prefix, model_cfg, length=max(buckets), platform=platform)
    return GRPOLayout(batch_size, update_rows, micro, buckets, prefix, max(temperature, 1e-6),
                      batch_divisor(mesh, micro), packed=grpo.pack_rows,
                      proximal=grpo.recompute_old_logprobs and grpo.minibatch_size is not None,
                      routing=replay_routing(model_cfg, grpo))


def replay_routing(model_cfg: Qwen3Config, grpo) -> tuple | None:
    """The layout's `routing`: (layers, experts per token, dtype) with grpo.routing_replay."""
    if not grpo.routing_replay:
        return None
    if not model_cfg.is_moe:
        raise ConfigError("grpo.routing_replay replays a mixture of experts' routing: the model has no experts "
                          "(model num_experts is 0)")
    return model_cfg.num_layers, model_cfg.num_experts_per_tok, expert_dtype(model_cfg)


def grpo_layout(cfg, mesh, model_cfg: Qwen3Config, *, prompt_prefix: int) -> GRPOLayout:
    """The layout of run config `cfg`'s GRPO updates on `mesh` (see `make_layout`)."""
    r = cfg.rollout
    return make_layout(mesh, model_cfg, cfg.grpo, batch_size=r.n_per_task * r.tasks_per_step,
                       max_context=r.max_context, temperature=r.temperature, prompt_prefix=prompt_prefix)


def abstract_reference(params, shardings, grpo):
    """The KL reference as the trainer keeps it (`muajax.train.grpo.reference_params`): the
    starting params in `grpo.reference_dtype` if set, else their own dtype, laid out as the
    step's params."""
    dtype = None if grpo.reference_dtype is None else jnp.dtype(grpo.reference_dtype)
    return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, dtype or p.dtype, sharding=s), params, shardings)


def field_dtypes(batch: dict) -> dict[str, np.dtype]:
    """A placed batch's dtypes by field (what `GRPO_BATCH_FIELDS` declares)."""
    return {k: np.dtype(v.dtype) for k, v in batch.items()}


def check_batch(batch: dict, layout: GRPOLayout) -> None:
    """Raise if a host batch is not what the layout declares (fields, dtypes, rows, a bucket)."""
    want = {k: np.dtype(d) for k, (d, _) in layout.fields().items()}
    if field_dtypes(batch) != want:
        raise TypeError(f"GRPO batch fields {field_dtypes(batch)} are not the layout's {want}")
    rows, length = batch["tokens"].shape
    if length not in layout.buckets or rows % layout.divisor:
        raise ValueError(f"GRPO batch [{rows}, {length}]: rows must be a multiple of {layout.divisor} and the "
                         f"length one of {layout.buckets}")
    if layout.packed and jax.process_count() == 1 and rows not in layout.row_buckets():
        raise ValueError(f"packed GRPO batch of {rows} rows: expected one of {layout.row_buckets()}")

