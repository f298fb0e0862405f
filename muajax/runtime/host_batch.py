"""The host's batches for the train steps: one path from a step's trajectories to the
batch its update takes, and one padding convention.

A GRPO step's batch (`grpo_update_batches`), in order:
1. collate: this process's trajectories to [rows, length] arrays at a length bucket all
   processes agree on, group ids counted from its first task's global index (`collate_share`);
2. mask: rows whose user or setup failed, and with dynamic sampling the groups whose rollouts
   all scored alike, keep their place but leave the update (`mask_failed`, `mask_uniform_groups`);
3. advantages: each row's group advantage from its group's rewards (`with_advantages`, the one
   place they are computed: before any split into mini-batches or microbatches, so a
   group's statistics always come from the whole group);
4. place: (mini-)batches padded to a multiple of the devices x microbatches, and with several
   processes joined into global arrays with the step's batch sharding (`place`).

Rows are padded with rows that contribute nothing: every token the pad id, an all-zero
loss mask, group id `PAD_GROUP` (outside every group) and advantage 0. Columns are padded
by `collate` (GRPO) and `sft_batch` (SFT) to a multiple of a length step, so that few
shapes, hence few compilations, occur. With several processes, process p holds tasks
[p*k, (p+1)*k) of the step (`distributed.task_share`): whole groups, so its advantages are
those of the global batch, and `jax.make_array_from_process_local_data` joins the blocks.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from muajax import parallel
from muajax.agent.trajectory import Trajectory
from muajax.models.tokenizer import PAD_ID
from muajax.rl.advantages import group_advantages
from muajax.runtime import distributed
from muajax.settings.fields import ConfigError

PAD_GROUP = -1
LENGTH_MULTIPLE = 128  # SFT and warm-up lengths are multiples of this
# The shortest GRPO length bucket; the others double it up to the rollout context. Rollout
# lengths vary step to step, and each bucket is one compilation of the whole train step:
# 7 buckets up to 32768 against 64 lengths as multiples of 512, for at most twice the
# positions of the longest rollout (and on average ~1.4x).
ROLLOUT_LENGTH_MULTIPLE = 512


def pad_rows(batch: dict[str, np.ndarray], extra: int, pad_id: int) -> dict[str, np.ndarray]:
    """`extra` more rows that contribute nothing: all-masked, and in no group."""
    if extra <= 0:
        return batch
    out = {}
    for key, x in batch.items():
        pad = np.zeros((extra,) + x.shape[1:], x.dtype)
        if key == "tokens":
            pad[:] = pad_id
        elif key == "group_ids":
            pad[:] = PAD_GROUP
        out[key] = np.concatenate([x, pad])
    return out


def pad_to_multiple(batch: dict[str, np.ndarray], divisor: int, pad_id: int) -> dict[str, np.ndarray]:
    """Rows padded up to a multiple of `divisor` (the devices a batch splits over, times microbatches)."""
    rows = batch["tokens"].shape[0]
    return pad_rows(batch, -rows % divisor, pad_id)


def batch_divisor(mesh, microbatches: int) -> int:
    """Rows must come in multiples of this: data * fsdp * expert devices, times the microbatches."""
    return parallel.batch_divisor(mesh) * microbatches


def microbatch_count(rows: int, microbatch_size: int | None, mesh, key: str) -> int:
    """How many microbatches of `microbatch_size` rows a batch of `rows` is cut into (1 with
    none). Each must be a multiple of data * fsdp * expert: every device takes whole rows of every
    microbatch, so a smaller one would be padded with empty rows up to that, in every
    microbatch (256 rows in microbatches of 8 on 32 devices would compute 1024)."""
    if microbatch_size is None:
        return 1
    devices = parallel.batch_divisor(mesh)
    if microbatch_size % devices:
        hint = -(-microbatch_size // devices) * devices
        raise ConfigError(f"{key} ({microbatch_size}) must be a multiple of data*fsdp*expert = {devices}: every device "
                          f"takes whole rows of each microbatch (one row per device per pass: {key}={devices}; "
                          f"nearest: {hint})")
    if rows % microbatch_size:
        raise ConfigError(f"{key} ({microbatch_size}) must divide the {rows} rows of a batch")
    return rows // microbatch_size


def check_microbatch_sizes(cfg, mesh) -> None:
    """Stop a run whose microbatch sizes do not suit its mesh before anything compiles."""
    if "grpo" in cfg.run.stages:
        rows = cfg.grpo.minibatch_size or cfg.rollout.n_per_task * cfg.rollout.tasks_per_step
        microbatch_count(rows, cfg.grpo.microbatch_size, mesh, "grpo.microbatch_size")
    if "sft" in cfg.run.stages:
        microbatch_count(cfg.sft.batch_size, cfg.sft.microbatch_size, mesh, "sft.microbatch_size")


def padded_length(longest: int, multiple: int) -> int:
    return max(1, -(-longest // multiple)) * multiple


def length_buckets(max_len: int, smallest: int = ROLLOUT_LENGTH_MULTIPLE) -> tuple[int, ...]:
    """The default GRPO lengths: `smallest` doubled while below `max_len`, then `max_len`
    rounded up to `smallest` (the longest a rollout can be)."""
    buckets, length = [], smallest
    while length < max_len:
        buckets.append(length)
        length *= 2
    return tuple(buckets) + (padded_length(max_len, smallest),)


def bucket_length(longest: int, buckets: Sequence[int]) -> int:
    """The shortest bucket that holds `longest` tokens."""
    for length in sorted(buckets):
        if length >= longest:
            return length
    raise ValueError(f"a rollout of {longest} tokens is longer than every length bucket {tuple(buckets)} "
                     "(grpo.length_buckets must reach rollout.max_context)")


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all rows share, less one when every row is the prefix
    itself (a forward needs one token after it); 0 for one row: nothing to share."""
    if len(rows) < 2:
        return 0
    n = min(len(r) for r in rows)
    first = np.asarray(rows[0][:n])
    same = np.ones(n, bool)
    for row in rows[1:]:
        same &= np.asarray(row[:n]) == first
    return int(np.argmin(same)) if not same.all() else n - 1


def sft_batch(examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, length: int, *,
              context_weight: float = 0.0, context_start: int = 0) -> dict[str, np.ndarray]:
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


def collate_routing(trajectories: Sequence[Trajectory], length: int, layers: int, k: int, dtype) -> np.ndarray:
    """Routing replay's batch field: each trajectory's experts [B, T, L, k] (its `experts`).
    Positions without any (its newest token, which the engine never fed back, and padding)
    take experts 0..k-1: a position's experts reach only its own and later positions, and
    neither predicts a token the loss reads. A trajectory that did not fail must have them."""
    out = np.broadcast_to(np.arange(k, dtype=dtype), (len(trajectories), length, layers, k)).copy()
    for i, t in enumerate(trajectories):
        if t.experts is None:
            if t.failed:
                continue
            raise ValueError(f"trajectory {t.task_id}/{t.rollout_index} has no experts for grpo.routing_replay "
                             "(its engine must record them: Engine(record_experts=True))")
        if t.experts.shape[1:] != (layers, k) or len(t.experts) > len(t.tokens):
            raise ValueError(f"trajectory {t.task_id}/{t.rollout_index}: experts {t.experts.shape} for "
                             f"{len(t.tokens)} tokens of a model of {layers} layers with {k} experts per token")
        out[i, :len(t.experts)] = t.experts
    return out


def collate(trajectories: Sequence[Trajectory], *, pad_id: int = PAD_ID, length: int | None = None,
            multiple: int = 1, routing: tuple | None = None) -> dict[str, np.ndarray]:
    """The GRPO batch: tokens int32 [B, T] (right-padded with `pad_id`), loss_mask int32
    [B, T], old_logprobs float32 [B, T], rewards float32 [B], group_ids int32 [B]; with
    `routing` = (layers, k, dtype) also `routing` [B, T, L, k] (`collate_routing`).

    T is `length` if given, else the longest trajectory rounded up to `multiple` (fewer
    distinct shapes, fewer compilations). Group ids are renumbered densely 0..G-1 by
    (task_id, group_id), so batches from several rollout calls can be joined.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    longest = max(len(t.tokens) for t in trajectories)
    if length is None:
        length = max(1, -(-longest // multiple) * multiple)
    elif length < longest:
        raise ValueError(f"length={length} is shorter than the longest trajectory ({longest} tokens)")
    b = len(trajectories)
    tokens = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    logprobs = np.zeros((b, length), np.float32)
    rewards = np.zeros((b,), np.float32)
    group_ids = np.zeros((b,), np.int32)
    groups: dict[tuple[str, int], int] = {}
    for i, t in enumerate(trajectories):
        n = len(t.tokens)
        if len(t.loss_mask) != n or len(t.logprobs) != n:
            raise ValueError(f"trajectory {i} ({t.task_id}/{t.rollout_index}): tokens, loss_mask and logprobs "
                             "have different lengths")
        tokens[i, :n] = t.tokens
        mask[i, :n] = t.loss_mask
        logprobs[i, :n] = t.logprobs
        rewards[i] = t.reward
        group_ids[i] = groups.setdefault((t.task_id, t.group_id), len(groups))
    batch = {"tokens": tokens, "loss_mask": mask, "old_logprobs": logprobs, "rewards": rewards,
             "group_ids": group_ids}
    if routing is not None:
        batch["routing"] = collate_routing(trajectories, length, *routing)
    return batch


def collate_share(trajectories: Sequence[Trajectory], *, pad_id: int, length_of: Callable[[int], int],
                  first_group: int, routing: tuple | None = None) -> dict:
    """`collate` of this process's trajectories, at the length every process agrees on (the
    largest `length_of(longest)`; a non-decreasing `length_of`, such as a bucket), with group
    ids counted from `first_group` (its first task's global index)."""
    length = length_of(max(len(t.tokens) for t in trajectories))
    if not distributed.multiprocess():
        return collate(trajectories, pad_id=pad_id, length=length, routing=routing)
    length = max(distributed.allgather_ints(length))
    batch = collate(trajectories, pad_id=pad_id, length=length, routing=routing)
    batch["group_ids"] = batch["group_ids"] + np.int32(first_group)
    return batch


def _rows_by_process(sharding: NamedSharding, shape: tuple[int, ...]) -> dict[int, frozenset[int]]:
    rows: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        rows.setdefault(device.process_index, set()).update(range(*index[0].indices(shape[0])))
    return {p: frozenset(r) for p, r in rows.items()}


def _blocks_are_disjoint(sharding: NamedSharding, shape: tuple[int, ...], per_process: int) -> bool:
    """True when each process's devices hold exactly `per_process` rows that no other process
    holds: then each process supplies just its own rows. Computed from the sharding alone,
    so every process reaches the same answer."""
    rows = _rows_by_process(sharding, shape)
    if len(rows) != jax.process_count() or any(len(r) != per_process for r in rows.values()):
        return False
    return len(frozenset().union(*rows.values())) == shape[0]


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, divisor: int, *, pad_id: int) -> dict[str, jax.Array]:
    """This process's rows → global jax.Arrays with the train step's batch sharding.

    Every process pads its block to the same size so that the global batch is a multiple of
    `divisor` (data*fsdp*expert*microbatches). Normally each process's devices hold exactly its
    own block; on a mesh where the batch axes do not split across processes (e.g. only
    tensor parallelism between hosts) every process needs every row, and the blocks are
    all-gathered first.
    """
    sizes = {x.shape[0] for x in local.values()}
    if len(sizes) != 1:
        raise ValueError(f"every batch array needs the same number of rows, got {sorted(sizes)}")
    (rows,) = sizes
    count = jax.process_count()
    everyone = distributed.allgather_ints(rows)
    if len(set(everyone)) != 1:
        raise RuntimeError(f"processes hold different numbers of rows {everyone}: each must roll out an equal "
                           "share of the step")
    step = divisor // math.gcd(divisor, count)
    per = -(-rows // step) * step
    local = pad_rows(local, per - rows, pad_id)
    out = {}
    for key, x in local.items():
        sharding = parallel.batch_sharding(mesh, x.ndim)
        shape = (per * count,) + x.shape[1:]
        if _blocks_are_disjoint(sharding, shape, per):
            out[key] = jax.make_array_from_process_local_data(sharding, x, shape)
        else:
            full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
            out[key] = jax.make_array_from_callback(shape, sharding, lambda index, full=full: full[index])
    return out


def same_on_every_process(batch: dict[str, np.ndarray], mesh: Mesh):
    """A batch every process built identically (SFT) → global jax.Arrays with the batch
    sharding; each process places only its own devices' rows. Unchanged with one process."""
    if not distributed.multiprocess():
        return batch
    return {key: jax.make_array_from_callback(x.shape, parallel.batch_sharding(mesh, x.ndim),
                                              lambda index, x=x: x[index])
            for key, x in batch.items()}


def mask_uniform_groups(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """DAPO's dynamic sampling: groups whose rollouts all scored alike carry no signal; their
    rows keep their place but lose their loss mask."""
    batch = dict(batch)
    keep = np.ones(len(batch["rewards"]), bool)
    for gid in np.unique(batch["group_ids"]):
        rows = batch["group_ids"] == gid
        if np.ptp(batch["rewards"][rows]) == 0:
            keep[rows] = False
    batch["loss_mask"] = batch["loss_mask"] * keep[:, None]
    return batch


def mask_failed(batch: dict[str, np.ndarray], failed: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of rollouts whose user or setup failed keep their place but leave the update:
    loss mask 0, and group `PAD_GROUP`, so their group's mean and std are those of the
    rollouts that did not fail."""
    failed = np.asarray(failed, bool)
    if failed.shape != batch["group_ids"].shape:
        raise ValueError(f"one failed flag per row: got {failed.shape[0]} for {batch['group_ids'].shape[0]} rows")
    batch = dict(batch)
    batch["loss_mask"] = batch["loss_mask"] * ~failed[:, None]
    batch["group_ids"] = np.where(failed, np.int32(PAD_GROUP), batch["group_ids"]).astype(np.int32)
    return batch


def minibatches(batch: dict[str, np.ndarray], size: int | None) -> list[dict[str, np.ndarray]]:
    """The batch in consecutive mini-batches of `size` rows (None: the whole batch), as verl
    splits a rollout batch for its PPO updates. The rows must carry their advantages already:
    a group's advantage is computed over the whole group, never within a mini-batch."""
    rows = batch["tokens"].shape[0]
    if size is None or size >= rows:
        return [batch]
    if rows % size:
        raise ValueError(f"mini-batches of {size} rows do not divide the batch of {rows}")
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def with_advantages(batch: dict[str, np.ndarray], grpo) -> dict[str, np.ndarray]:
    """The batch with each row's group advantage in place of its reward and group id
    (`grpo.advantage_scale`, `grpo.advantage_eps`); rows in no group get 0."""
    out = {k: v for k, v in batch.items() if k not in ("rewards", "group_ids")}
    groups = int(max(batch["group_ids"].max(), 0)) + 1
    out["advantages"] = np.asarray(group_advantages(batch["rewards"], batch["group_ids"], groups,
                                                    scale=grpo.advantage_scale, eps=grpo.advantage_eps))
    return out


def place(batch: dict[str, np.ndarray], mesh: Mesh, divisor: int, pad_id: int) -> dict:
    """Host rows -> the step's batch: padded to a multiple of `divisor` (one process), or
    joined with the other processes' rows into global arrays."""
    if distributed.multiprocess():
        return global_batch(batch, mesh, divisor, pad_id=pad_id)
    return pad_to_multiple(batch, divisor, pad_id)


def place_shared(batch: dict[str, np.ndarray], mesh: Mesh, divisor: int, pad_id: int) -> dict:
    """A batch every process built identically (SFT, the warm-ups) -> the step's batch:
    padded to a multiple of `divisor`; with several processes each places its own rows."""
    return same_on_every_process(pad_to_multiple(batch, divisor, pad_id), mesh)


def grpo_rows(trajectories: Sequence[Trajectory], grpo, *, pad_id: int, buckets: Sequence[int], first_group: int,
              shared_prefix: int = 0, routing: tuple | None = None) -> dict[str, np.ndarray]:
    """A step's trajectories -> this process's rows, collated (with their experts: `routing`,
    see `collate`), masked, with advantages."""
    batch = collate_share(trajectories, pad_id=pad_id, first_group=first_group, routing=routing,
                          length_of=lambda longest: bucket_length(longest, buckets))
    batch = mask_failed(batch, np.array([t.failed for t in trajectories]))
    if common_prefix(batch["tokens"]) < shared_prefix:
        raise RuntimeError(f"rollouts no longer share the {shared_prefix}-token system prompt")
    if grpo.dynamic_sampling:  # DAPO: groups with one outcome carry no signal
        batch = mask_uniform_groups(batch)
    return with_advantages(batch, grpo)


def grpo_update_batches(trajectories: Sequence[Trajectory], grpo, *, mesh: Mesh, pad_id: int,
                        buckets: Sequence[int], first_group: int, divisor: int,
                        shared_prefix: int = 0, routing: tuple | None = None) -> list[dict]:
    """A step's trajectories -> the placed batch of each of its updates (one, or one per
    mini-batch of `grpo.minibatch_size` rows): collate, mask, advantages, place."""
    batch = grpo_rows(trajectories, grpo, pad_id=pad_id, buckets=buckets, first_group=first_group,
                      shared_prefix=shared_prefix, routing=routing)
    local_size = None if grpo.minibatch_size is None else grpo.minibatch_size // jax.process_count()
    return [place(part, mesh, divisor, pad_id) for part in minibatches(batch, local_size)]
