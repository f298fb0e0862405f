"""GRPO's packed rows: a step's trajectories packed into rows of the length bucket with
segment ids, so that an update computes close to the real tokens instead of every row at
the bucket of the longest conversation.

A packed row is `length` columns (the bucket the padded rows would have, so no trajectory
is cut and the attention per row is what a padded row's is). With a shared prefix of P
tokens (`muajax.runtime.grpo_layout.shared_prefix_tokens`) its first P columns are that
prefix, once, and the rest holds the trajectories without it; without one, the row holds
whole trajectories. First-fit decreasing (`muajax.runtime.packing.pack`) places them.
Every per-token field moves with its token: tokens, the loss mask, the old logprobs, the
routing replay's experts (`routing`, when the batch has them; the shared prefix takes its
first trajectory's), and the advantage (now per token, each its trajectory's). `segment_ids` number the trajectories
1, 2, ... across the (mini-)batch (0: padding) and `sum_norm` carries the padded length
(what "seq-mean-token-sum-norm" divides by), so the loss (`muajax.rl.losses`) treats each
segment as the row it would have had. A trajectory's first packed token is predicted by
the previous segment's last: its loss mask must be 0 there (a user or tool turn always
follows the system prompt), and the packer refuses a batch where it is not.

The number of rows is a function of how the lengths pack, rounded up to one of
`row_buckets` (sixteenths of the padded rows, in multiples of the batch divisor), so few
shapes, hence few compilations, occur.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from muajax.agent.trajectory import Trajectory
from muajax.runtime import distributed
from muajax.runtime.host_batch import grpo_rows, minibatches, place
from muajax.runtime.packing import pack

ROW_STEPS = 16  # row counts come in this many steps up to the padded rows


def row_buckets(padded_rows: int, divisor: int) -> tuple[int, ...]:
    """The row counts a packed (mini-)batch may have: multiples of a step (a multiple of
    `divisor`, about `padded_rows / ROW_STEPS`) up to `padded_rows`."""
    units = padded_rows // divisor
    step = divisor * max(1, -(-units // ROW_STEPS))
    return tuple(sorted({*range(step, padded_rows, step), padded_rows}))


def rows_for(bins: int, buckets: Sequence[int]) -> int:
    """The fewest rows of `buckets` that hold `bins` packed rows."""
    for rows in buckets:
        if rows >= bins:
            return rows
    raise ValueError(f"{bins} packed rows are more than the batch's {max(buckets)}")


def pack_bins(lengths: Sequence[int], length: int, shared_prefix: int) -> list[list[int]]:
    """Which trajectories (indices into `lengths`) share each row of `length` columns."""
    return pack([n - shared_prefix for n in lengths], length - shared_prefix)


def packed_rows(batch: dict[str, np.ndarray], lengths: Sequence[int], bins: Sequence[Sequence[int]], rows: int, *,
                shared_prefix: int, pad_id: int, first_segment: int = 1) -> dict[str, np.ndarray]:
    """A collated batch's rows (tokens, loss_mask, old_logprobs [n, T], advantages [n];
    row i's real length lengths[i]) packed as `bins` say into `rows` rows of T columns;
    trajectory bins[r][j] gets segment id first_segment + its index in the batch."""
    n, length = batch["tokens"].shape
    p = shared_prefix
    if len(bins) > rows:
        raise ValueError(f"{len(bins)} packed rows do not fit a batch of {rows}")
    out = {"tokens": np.full((rows, length), pad_id, np.int32), "loss_mask": np.zeros((rows, length), np.int32),
           "old_logprobs": np.zeros((rows, length), np.float32), "advantages": np.zeros((rows, length), np.float32),
           "segment_ids": np.zeros((rows, length), np.int32), "sum_norm": np.full((rows,), length, np.float32)}
    per_token = ("tokens", "loss_mask", "old_logprobs")
    if "routing" in batch:  # positions out of every segment keep experts 0..k-1, as collate pads
        k = batch["routing"].shape[-1]
        out["routing"] = np.broadcast_to(np.arange(k, dtype=batch["routing"].dtype),
                                         (rows, length, *batch["routing"].shape[2:])).copy()
        per_token += ("routing",)
    for r, members in enumerate(bins):
        if p:
            for key in ("tokens", "routing") if "routing" in out else ("tokens",):
                out[key][r, :p] = batch[key][members[0], :p]
            out["segment_ids"][r, :p] = first_segment + members[0]
        start = p
        for i in members:
            if batch["loss_mask"][i, p]:
                raise ValueError(f"row {i}: its token {p}, the first after the shared prefix, is on the loss mask; "
                                 "packed, it would be predicted by another trajectory's last token")
            end = start + lengths[i] - p
            if end > length:
                raise ValueError(f"packed row {r}: its trajectories take {end} columns, more than {length}")
            for key in per_token:
                out[key][r, start:end] = batch[key][i, p:lengths[i]]
            out["advantages"][r, start:end] = batch["advantages"][i]
            out["segment_ids"][r, start:end] = first_segment + i
            start = end
    return out


def computed_positions(lengths: Sequence[int], length: int, *, shared_prefix: int, row_buckets_: Sequence[int],
                       microbatches: int = 1) -> dict[str, int]:
    """Positions one update computes over trajectories of `lengths` at bucket `length`,
    packed and padded (a shared prefix counted once per microbatch), and the real ones."""
    p = shared_prefix
    rows = rows_for(len(pack_bins(lengths, length, p)), row_buckets_)
    padded_rows = max(row_buckets_)
    prefix = microbatches * p  # the prefix runs once per microbatch
    return {"real": int(sum(n - p for n in lengths) + prefix), "packed": rows * (length - p) + prefix,
            "padded": padded_rows * (length - p) + prefix, "rows": rows, "padded_rows": padded_rows}


def grpo_packed_batches(trajectories: Sequence[Trajectory], grpo, *, mesh: Mesh, pad_id: int,
                        buckets: Sequence[int], first_group: int, divisor: int, shared_prefix: int,
                        padded_rows: int, routing: tuple | None = None) -> list[dict]:
    """`muajax.runtime.host_batch.grpo_update_batches` with each (mini-)batch's rows packed:
    the same rows, masks and advantages, then `packed_rows` at the fewest of `row_buckets`
    (with several processes: the most any process needs), placed."""
    batch = grpo_rows(trajectories, grpo, pad_id=pad_id, buckets=buckets, first_group=first_group,
                      shared_prefix=shared_prefix, routing=routing)
    batch["lengths"] = np.array([len(t.tokens) for t in trajectories], np.int64)
    local_size = None if grpo.minibatch_size is None else grpo.minibatch_size // jax.process_count()
    length = batch["tokens"].shape[1]
    allowed = row_buckets(padded_rows, divisor)
    out = []
    for part in minibatches(batch, local_size):
        lengths = [int(n) for n in part.pop("lengths")]
        bins = pack_bins(lengths, length, shared_prefix)
        if distributed.multiprocess():
            rows = max(distributed.allgather_ints(len(bins)))
        else:
            rows = rows_for(len(bins), allowed)
        first = 1 + jax.process_index() * len(lengths)  # segment ids unique across processes
        packed = packed_rows(part, lengths, bins, rows, shared_prefix=shared_prefix, pad_id=pad_id,
                             first_segment=first)
        out.append(place(packed, mesh, divisor, pad_id))
    return out
