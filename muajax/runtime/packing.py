"""SFT conversations packed into rows of a fixed length, with segment ids.

A step's conversations go into as few rows as first-fit decreasing finds, each row holding
whole conversations one after another: `segment_ids` number them 1, 2, ... in the row and
0 marks the padding after them. The model then attends only within a conversation and
restarts positions in each (`muajax.models.qwen3.forward(segment_ids=...)`), so a packed
row computes exactly what its conversations compute alone, and the token-mean loss over
the same assistant tokens is the same loss. A conversation's last position would predict
the next one's first token: that target's mask is 0 (a conversation opens with a system
or user turn, never an assistant token, and the packer makes sure).

Every step must have the same number of rows (one compilation): `plan_packing` packs every
step of the stage ahead (cheap: a sort per step) and takes the most rows any step needs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

Example = tuple[Sequence[int], Sequence[int]]  # (token ids, assistant mask)


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths` whose lengths sum to at most `capacity` each (first-fit
    decreasing); within a bin, indices keep the order they were placed in."""
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"a conversation of {max(too_long)} tokens does not fit a packed row of {capacity}")
    bins: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[index] <= room:
                bins[b].append(index)
                free[b] -= lengths[index]
                break
        else:
            bins.append([index])
            free.append(capacity - lengths[index])
    return bins


def packed_batch(examples: Sequence[Example], bins: Sequence[Sequence[int]], pad_id: int, length: int, rows: int, *,
                 context_weight: float = 0.0, context_start: int = 0) -> dict[str, np.ndarray]:
    """tokens, loss_mask and segment_ids [rows, length] of `examples` packed as `bins` say
    (rows beyond the bins are all padding); with a `context_weight`, a `context_mask` of that
    weight on each conversation's other tokens from `context_start` on (the end of the
    system prompt), as `muajax.runtime.host_batch.sft_batch` gives unpacked rows."""
    if len(bins) > rows:
        raise ValueError(f"{len(bins)} packed rows do not fit a batch of {rows}")
    tokens = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
    segments = np.zeros((rows, length), np.int32)
    context = np.zeros((rows, length), np.float32)
    for r, members in enumerate(bins):
        start = 0
        for segment, index in enumerate(members, 1):
            ids, m = examples[index]
            end = start + len(ids)
            if end > length:
                raise ValueError(f"row {r}: its conversations take {end} tokens, more than {length}")
            tokens[r, start:end] = ids
            mask[r, start:end] = m
            mask[r, start] = 0  # predicted from the previous conversation's last token
            segments[r, start:end] = segment
            context[r, start + context_start:end] = context_weight
            context[r, start] = 0.0
            start = end
    batch = {"tokens": tokens, "loss_mask": mask, "segment_ids": segments}
    if context_weight:
        batch["context_mask"] = np.where(mask == 0, context, 0.0).astype(np.float32)
    return batch


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """How a stage's steps are packed: the row length, the rows of every step's batch, and
    whether packing is on at all (`decide_packing`)."""

    enabled: bool
    length: int
    rows: int
    packed_tokens: int    # rows * length: what one packed step computes
    unpacked_tokens: int  # what one unpacked step computes (its shared prefix counted once)


def plan_packing(step_lengths: Callable[[int], Sequence[int]], steps: int, *, length: int, batch_size: int,
                 row_multiple: int, shared_prefix: int, mode: str) -> PackingPlan:
    """Pack every step's conversation lengths (`step_lengths(index)` for index < steps) into
    rows of `length`; rows per step = the most any step needs, rounded up to `row_multiple`.
    `mode` "on" packs, "off" does not, "auto" packs when a packed step computes fewer
    tokens than an unpacked one whose rows share a `shared_prefix`-token system prompt."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"packing mode {mode!r}: expected auto, on or off")
    unpacked = batch_size * length - (batch_size - 1) * shared_prefix
    if mode == "off":
        return PackingPlan(False, length, batch_size, 0, unpacked)
    most = max(len(pack(step_lengths(index), length)) for index in range(steps))
    rows = -(-most // row_multiple) * row_multiple
    packed = rows * length
    return PackingPlan(mode == "on" or packed < unpacked, length, rows, packed, unpacked)
