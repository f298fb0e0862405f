"""Attention on a mesh whose `sequence` axis splits each row's positions (context parallelism).

Every op of the model but attention is per position, so only attention needs the rest of
the row. Each device keeps its own queries, all-gathers the keys and values of the whole
row over the sequence axis (as MaxText's context parallelism does) and runs an ordinary
attention with its queries' global indices (shard index x local length + local index), so
causal masking is that of the whole row. In the backward the gather's transpose is a
reduce-scatter of dK and dV. Batch goes over (data, fsdp) and heads over tensor, as the
logical-axis rules place the activations around it.

Causal work is unbalanced across the shards (the first sees a quarter of what the last
sees with 2 shards); `chunked` skips the key blocks past its queries, so the early shards
finish sooner rather than wasting flops.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from muajax import parallel

SEQ = parallel.SEQUENCE_AXIS


def current_platform() -> str:
    """The platform of the mesh in context (`jax.set_mesh`), else the default backend:
    compiling for a TPU topology on a CPU host counts as TPU."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def mesh_axis(mesh, size: int, logical: str):
    """The mesh axes (or None) that the logical-axis rules give a dimension of `size`."""
    return parallel.logical_to_spec((size,), (logical,), mesh)[0]


def sequence_split(mesh, length: int) -> int:
    """How many shards a row of `length` positions is split into on `mesh` (in context or
    given): the sequence axis's size when the rules shard the length over it, else 1."""
    if mesh.empty or parallel.sequence_shards(mesh) == 1:
        return 1
    return parallel.sequence_shards(mesh) if mesh_axis(mesh, length, "activation_length") == SEQ else 1


def head_layout(mesh, q, k, v):
    """(batch axes, head axes, k, v): where the rules put q's batch and heads, with k and v
    repeated to one kv head per query head when the tensor axis divides the query heads but
    not the kv heads (every device then holds the kv heads of its query heads)."""
    n = q.shape[2]
    batch_axes = mesh_axis(mesh, q.shape[0], "activation_batch")
    head_axes = mesh_axis(mesh, n, "activation_heads")
    if head_axes is not None and mesh_axis(mesh, k.shape[1], "activation_heads") != head_axes:
        k, v = (jnp.repeat(x, n // x.shape[1], axis=1) for x in (k, v))
    return batch_axes, head_axes, k, v


def gather_row(x, axis: int):
    """Inside shard_map: the whole row's positions of `x` from every sequence shard."""
    return jax.lax.all_gather(x, SEQ, axis=axis, tiled=True)


def shard_offset(local_length: int):
    """Inside shard_map: the global index of this shard's first position."""
    return jax.lax.axis_index(SEQ) * local_length


LocalAttention = Callable[..., jax.Array]


def context_parallel(local: LocalAttention, q, k, v, *, segment_ids=None, q_index=None, kv_valid=None):
    """`local(q, k, v, q_index, q_seg, kv_seg, kv_valid)` on each device's share of the
    queries, under shard_map over the mesh in context; same shapes and masks as
    `muajax.models.attention.attention` (q [B, T, N, H], k, v [B, K, S, H]).

    Self-attention (q_index None): k, v and segment_ids are split like the queries and
    gathered whole inside. Cache form: k, v are a cache every shard holds whole, and
    q_index [B, T] is split with the queries.
    """
    mesh = jax.sharding.get_abstract_mesh()
    t = q.shape[1]
    batch_axes, head_axes, k, v = head_layout(mesh, q, k, v)
    cache_form = q_index is not None
    q_spec = PartitionSpec(batch_axes, SEQ, head_axes, None)
    kv_spec = PartitionSpec(batch_axes, head_axes, None if cache_form else SEQ, None)
    rows = PartitionSpec(batch_axes, SEQ)
    args = {"q": (q, q_spec), "k": (k, kv_spec), "v": (v, kv_spec)}
    if segment_ids is not None:
        args["segment_ids"] = (segment_ids, rows)
    if cache_form:
        args["q_index"] = (q_index.astype(jnp.int32), rows)
        args["kv_valid"] = (kv_valid, PartitionSpec(batch_axes, None))

    def body(*values):
        named = dict(zip(args, values))
        q, k, v = named["q"], named["k"], named["v"]
        q_seg = kv_seg = named.get("segment_ids")
        if cache_form:
            index = named["q_index"]
        else:
            k, v = gather_row(k, 2), gather_row(v, 2)
            kv_seg = None if q_seg is None else gather_row(q_seg, 1)
            local_t = q.shape[1]
            index = jnp.broadcast_to(shard_offset(local_t) + jnp.arange(local_t, dtype=jnp.int32),
                                     q.shape[:2])
        return local(q, k, v, index, q_seg, kv_seg, named.get("kv_valid"))

    if t % parallel.sequence_shards(mesh):
        raise ValueError(f"context_parallel: length {t} does not split over {parallel.sequence_shards(mesh)} "
                         "sequence shards")
    values, specs = zip(*args.values())
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*values)
