"""Pallas TPU splash attention (causal, segment ids, GQA) under `jax.shard_map` over the mesh
in context: batch over (data, fsdp), heads over tensor, and, on a mesh with a `sequence`
axis, each row's queries over it (context parallelism, `muajax.models.context_parallel`).

The kernel is built once for the whole row, with `q_seq_shards` = the sequence shards, and
passed into the shard_map as an argument sharded by its own `manual_sharding_spec`: each
shard then holds the mask blocks of its own queries, so the causal mask is the row's
(global offsets), while it all-gathers the row's keys and values. This is how MaxText runs
splash with context parallelism. Off TPU the kernel runs in Pallas interpret mode (slow:
for tests and parity only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import NamedSharding, PartitionSpec

from muajax.models.context_parallel import SEQ, current_platform, gather_row, head_layout, sequence_split

# Splash's block on every axis (forward, dq, dkv), as MaxText sets it for long sequences;
# shorter sequences use one block of their length rounded up to the 128 TPU lanes.
SPLASH_BLOCK = 512
SPLASH_LANES = 128


def _lanes(x: int) -> int:
    return -(-x // SPLASH_LANES) * SPLASH_LANES


def _kernel(heads: int, length: int, block: int, *, head_shards: int, q_seq_shards: int, interpret: bool):
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                              block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=head_shards, q_seq_shards=q_seq_shards,
                                  interpret=interpret)


def splash_attention(q, k, v, segment_ids=None, *, block: int = SPLASH_BLOCK) -> jax.Array:
    """Causal splash attention; q [B, T, N, H], k, v [B, K, T, H]. T is padded inside to a
    multiple of the block times the sequence shards (padding keys come after every real
    query, so causality hides them). Splash takes no scale: q is scaled before the kernel."""
    b, t, n, h = q.shape
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else sequence_split(mesh, t)
    block = min(_lanes(block), _lanes(-(-t // shards)))  # every splash block is whole lanes
    padded = -(-t // (block * shards)) * block * shards
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, padded - t), (0, 0)])
    q = pad((q.astype(jnp.float32) * h**-0.5).astype(q.dtype).transpose(0, 2, 1, 3))
    k, v = pad(k), pad(v)
    seg = None if segment_ids is None else jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, padded - t)])
    interpret = current_platform() != "tpu"

    if mesh.empty:
        kernel = _kernel(n, padded, block, head_shards=1, q_seq_shards=1, interpret=interpret)
        if seg is None:
            out = jax.vmap(kernel)(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(q, k, v, seg)
        return out[:, :, :t].transpose(0, 2, 1, 3)

    # head_layout reads [B, T, N, H] queries: hand it q's shape in that order
    batch_axes, head_axes, k, v = head_layout(mesh, q.transpose(0, 2, 1, 3), k, v)
    seq_axis = SEQ if shards > 1 else None
    head_shards = 1 if head_axes is None else _size(mesh, head_axes)
    kernel = _kernel(n, padded, block, head_shards=head_shards, q_seq_shards=shards, interpret=interpret)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(head_axes, seq_axis)))
    spec = PartitionSpec(batch_axes, head_axes, seq_axis, None)

    def body(kernel, q, k, v, *seg):
        if shards > 1:
            k, v = gather_row(k, 2), gather_row(v, 2)
        if not seg:
            return jax.vmap(kernel)(q, k, v)
        kv_seg = gather_row(seg[0], 1) if shards > 1 else seg[0]
        return jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=splash.SegmentIds(qs, ks)))(
            q, k, v, seg[0], kv_seg)

    args, specs = (kernel, q, k, v), (kernel_spec, spec, spec, spec)
    if seg is not None:
        args, specs = args + (seg,), specs + (PartitionSpec(batch_axes, seq_axis),)
    out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)(*args)
    return out[:, :, :t].transpose(0, 2, 1, 3)


def _size(mesh, axes) -> int:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    shape = dict(mesh.shape)
    out = 1
    for name in names:
        out *= shape[name]
    return out
