"""Host-side batches for the train steps, with one padding convention.

Rows are padded with rows that contribute nothing: every token the pad id, an all-zero
loss mask, and group id `PAD_GROUP`, which lies outside [0, num_groups) so the step gives
such a row advantage 0 (`muajax.rl.advantages.group_advantages`). Columns are padded by
`muajax.agent.trajectory.collate` (GRPO) and `sft_batch` (SFT) to a multiple of a length
step, so that few shapes, hence few compilations, occur.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from muajax import parallel
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
    """Rows must come in multiples of this: data * fsdp devices, times the microbatches."""
    return parallel.batch_divisor(mesh) * microbatches


def microbatch_count(rows: int, microbatch_size: int | None, mesh, key: str) -> int:
    """How many microbatches of `microbatch_size` rows a batch of `rows` is cut into (1 with
    none). Each must be a multiple of data * fsdp: every device takes whole rows of every
    microbatch, so a smaller one would be padded with empty rows up to that, in every
    microbatch (256 rows in microbatches of 8 on 32 devices would compute 1024)."""
    if microbatch_size is None:
        return 1
    devices = parallel.batch_divisor(mesh)
    if microbatch_size % devices:
        hint = -(-microbatch_size // devices) * devices
        raise ConfigError(f"{key} ({microbatch_size}) must be a multiple of data*fsdp = {devices}: every device "
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
