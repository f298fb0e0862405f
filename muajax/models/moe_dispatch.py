"""The experts of a mixture-of-experts layer on a mesh with an `expert` axis (expert parallelism).

`expert_ffn(x, index, weight, gate, up, down)` computes what `muajax.models.moe.grouped_experts`
computes (same arguments, same result up to float summation order), with the experts' weights
split over the mesh's expert axis: each device holds E / expert of them. Without the axis (or
with E not divisible by it) it is `grouped_experts`, laid out by XLA.

With it, under `jax.shard_map` over the mesh in context:
- tokens split over the expert axis (the rules' `activation_tokens` include it, as the batch's
  rows are split over it): each device sorts its tokens' k copies by expert, so by the device
  holding the expert, and one `jax.lax.all_to_all` sends each device the copies for its
  experts; `grouped_experts` runs them through the local experts, a second all_to_all returns
  the results, and each token adds its k results weighted, in ascending expert order as
  `grouped_experts` does. Exact: nothing is dropped. The send buffer is static, n*k rows per
  destination (every copy could go to one device), so a device receives expert * n*k rows of
  which n*k are real on average; the padding rows carry expert id E_local, which
  `grouped_experts` leaves out of its groups (`grouped_matmul` gives rows past the groups 0;
  its CPU blocks and weight gradient skip them, XLA:TPU's ragged-dot estimate counts them).
  `jax.lax.ragged_all_to_all` would send only the real rows, but XLA:CPU does not implement
  it (jax 0.10.2: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"),
  and every mesh here must also run on CPU.
- tokens not split over the expert axis (a row count it does not divide): every device of an
  expert group holds the same tokens, runs only the copies routed to its own experts, and a
  psum over the expert axis adds the groups' results.
The experts' F axis may be split over `tensor` (the rules' `moe_mlp`): each device computes
its part of the down projection and a psum over tensor adds them. The data, fsdp and
sequence axes only split the tokens (the expert weights are gathered over fsdp and sequence
like every weight).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from muajax import parallel
from muajax.models.moe import grouped_experts

EXPERT = parallel.EXPERT_AXIS


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_entry(mesh, size: int, logical: str):
    return parallel.logical_to_spec((size,), (logical,), mesh)[0]


def expert_ffn(x: jax.Array, index: jax.Array, weight: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array) -> jax.Array:
    """x [N, D], index and weight [N, k], gate and up [E, D, F], down [E, F, D] -> [N, D]:
    `grouped_experts`'s result, expert-parallel on the mesh in context (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or parallel.expert_shards(mesh) == 1:
        return grouped_experts(x, index, weight, gate, up, down)
    n, f = x.shape[0], gate.shape[2]
    experts = _spec_entry(mesh, gate.shape[0], "exp")
    if _axes(experts) != (EXPERT,):
        return grouped_experts(x, index, weight, gate, up, down)
    tokens = _spec_entry(mesh, n, "activation_tokens")
    mlp = _spec_entry(mesh, f, "moe_mlp")
    rows = PartitionSpec(tokens, None)
    reduce_axes = _axes(mlp)
    if EXPERT in _axes(tokens):
        body = _dispatched
    else:
        body = _local_only
        reduce_axes = (EXPERT,) + reduce_axes

    def run(x, index, weight, gate, up, down):
        out = body(x, index, weight, gate, up, down)
        return jax.lax.psum(out, reduce_axes) if reduce_axes else out

    specs = (rows, rows, rows, PartitionSpec(experts, None, mlp), PartitionSpec(experts, None, mlp),
             PartitionSpec(experts, mlp, None))
    return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False)(
        x, index, weight, gate, up, down)


def _ascending(index, weight):
    """Each token's k experts (and weights) in ascending expert order: the order in which
    `grouped_experts` adds a token's results."""
    by_expert = jnp.argsort(index, axis=-1, stable=True)
    return jnp.take_along_axis(index, by_expert, axis=-1), jnp.take_along_axis(weight, by_expert, axis=-1)


def _weighted_sum(results, weight):
    """[n, k, D] expert results and [n, k] weights -> [n, D], added from zero over k in order."""
    out = results * weight[..., None]
    total = jnp.zeros_like(out[:, 0])
    for j in range(out.shape[1]):
        total = total + out[:, j]
    return total


def _dispatched(x, index, weight, gate, up, down):
    """Inside shard_map, tokens split over the expert axis: this device's n tokens to their
    experts' devices by all_to_all, through the local experts, and back."""
    ep = jax.lax.axis_size(EXPERT)
    local = gate.shape[0]
    n, k = index.shape
    copies = n * k
    index, weight = _ascending(index, weight)
    flat = index.reshape(copies)
    dest = flat // local  # the device (along the expert axis) holding each copy's expert
    order = jnp.argsort(flat, stable=True)  # copies by expert, hence by destination
    counts = jnp.bincount(dest, length=ep).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(copies, dtype=jnp.int32)
    # send buffer [ep, copies]: block q holds the copies for device q, then padding
    valid = slot[None, :] < counts[:, None]
    source = jnp.take(order, jnp.minimum(starts[:, None] + slot[None, :], copies - 1))
    send_x = jnp.where(valid[..., None], jnp.take(x, source // k, axis=0), jnp.zeros((), x.dtype))
    send_id = jnp.where(valid, jnp.take(flat, source) % local, local)  # `local`: padding
    recv_x = jax.lax.all_to_all(send_x.reshape(ep * copies, -1), EXPERT, 0, 0, tiled=True)
    recv_id = jax.lax.all_to_all(send_id.reshape(ep * copies), EXPERT, 0, 0, tiled=True)
    real = (recv_id < local).astype(x.dtype)[:, None]
    results = grouped_experts(recv_x, recv_id[:, None], real, gate, up, down)
    back = jax.lax.all_to_all(results, EXPERT, 0, 0, tiled=True)  # block q: what device q computed for us
    rank = jnp.zeros_like(order).at[order].set(slot, unique_indices=True)  # each copy's place in `order`
    at = dest * copies + rank - jnp.take(starts, dest)
    return _weighted_sum(jnp.take(back, at, axis=0).reshape(n, k, -1), weight)


def _local_only(x, index, weight, gate, up, down):
    """Inside shard_map, tokens the same on every device of the expert axis: the copies
    routed to this device's experts only (the others count zero); the caller's psum over the
    expert axis adds the devices' parts."""
    local = gate.shape[0]
    index, weight = _ascending(index, weight)
    mine = index // local == jax.lax.axis_index(EXPERT)
    local_index = jnp.where(mine, index % local, local)  # `local`: not here (no group, result 0)
    results = grouped_experts_per_copy(x, local_index, gate, up, down)
    return _weighted_sum(results, jnp.where(mine, weight, jnp.zeros((), weight.dtype)))


def grouped_experts_per_copy(x, index, gate, up, down):
    """[n, k, D]: each of a token's k copies through its expert (unweighted, not summed), by
    `grouped_experts` on the copies as rows; an index of E (the local expert count) gives 0."""
    n, k = index.shape
    rows = jnp.repeat(x, k, axis=0)
    flat = index.reshape(n * k, 1)
    ones = (flat < gate.shape[0]).astype(x.dtype)
    return grouped_experts(rows, flat, ones, gate, up, down).reshape(n, k, -1)
