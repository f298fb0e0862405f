"""The paged KV pool on device, and the shard-local moves between pages and a dense cache.

The pool is one array `[layers, pages, page_size, 2 * kv_heads, head_dim]`, keys and values
interleaved on the head axis (key of head h at 2h, value at 2h + 1): the layout jax's
ragged paged attention kernel reads, so the TPU path attends over it in place.

Sharding: the page axis over the mesh's data-parallel axes (data, fsdp), each device
group holding one shard of `pages_per_shard` consecutive pages (see pages.py); the head
axis over `tensor` when the kv heads divide evenly (else replicated on it). Every access by
a page id runs inside `shard_map` on shard-local ids and the rows of that shard, so no
program gathers or scatters the pool across devices. (Indexing a sharded array with a
runtime index outside shard_map makes XLA all-gather the whole array first.)

Batches are laid out by shard: a batch of R rows holds R / num_shards rows per shard,
rows of shard s first-to-last at [s * R / num_shards, (s + 1) * R / num_shards).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muajax import parallel
from muajax.models.qwen3 import KVCache, Qwen3Config


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """Static shape and layout of the pool (hashable: a jit static argument)."""

    cfg: Qwen3Config
    mesh: Mesh | None
    pages_per_shard: int
    page_size: int
    max_pages: int  # page-table width: the pages of one max_len sequence

    @property
    def num_shards(self) -> int:
        return 1 if self.mesh is None else parallel.batch_divisor(self.mesh)

    @property
    def batch_axes(self) -> tuple[str, ...] | None:
        return None if self.mesh is None else parallel.BATCH_AXES

    @property
    def head_axis(self) -> str | None:
        """`tensor` if it splits the kv heads (and so whole key/value pairs) evenly."""
        if self.mesh is None or self.mesh.shape["tensor"] == 1:
            return None
        return "tensor" if self.cfg.num_kv_heads % self.mesh.shape["tensor"] == 0 else None

    @property
    def shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_layers, self.num_shards * self.pages_per_shard, self.page_size, 2 * c.num_kv_heads, c.head_dim)

    @property
    def tokens(self) -> int:
        return self.num_shards * self.pages_per_shard * self.page_size

    def pool_spec(self) -> P:
        return P(None, self.batch_axes, None, self.head_axis, None)

    def rows_spec(self, ndim: int = 1) -> P:
        return P(self.batch_axes, *([None] * (ndim - 1)))

    def heads_spec(self, ndim: int, head_dim: int) -> P:
        """Rows over the batch axes and dimension `head_dim` over the head axis."""
        spec = [self.batch_axes] + [None] * (ndim - 1)
        spec[head_dim] = self.head_axis
        return P(*spec)

    def sharding(self, spec: P) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, spec)

    def local(self, fn, in_specs, out_specs):
        """`fn` on each shard's block (shard_map), or `fn` itself without a mesh."""
        if self.mesh is None:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def allocate(spec: PoolSpec) -> jax.Array:
    # Committed to its device(s) like the pool every program returns: jit caches committed and
    # uncommitted arguments apart, so an uncommitted first pool would compile each program twice.
    # Without a mesh: this process's default device (jax.devices()[0] may be another host's).
    sharding = spec.sharding(spec.pool_spec()) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.jit(functools.partial(jnp.zeros, spec.shape, spec.cfg.compute_dtype), out_shardings=sharding)()


def abstract_pool(spec: PoolSpec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, spec.cfg.compute_dtype, sharding=spec.sharding(spec.pool_spec()))


# ---------------------------------------------------------------------- shard-local pieces


def interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """[..., K, H] keys and values -> [..., 2K, H] in the pool's head order."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def token_slots(page_table: jax.Array, start: jax.Array, count: jax.Array, width: int, num_pages: int,
                page_size: int) -> jax.Array:
    """Flat slot (page * page_size + offset) of positions start + [0, width) of each row;
    positions past `count` get an out-of-range slot (their writes are dropped)."""
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :]
    positions = start[:, None] + offsets
    index = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    pages = jnp.take_along_axis(page_table, index, axis=1)
    slots = pages * page_size + positions % page_size
    return jnp.where(offsets < count[:, None], slots, num_pages * page_size)


def put_tokens(pool: jax.Array, layer, kv: jax.Array, slots: jax.Array) -> jax.Array:
    """Write `kv` [(layers,) R, W, 2K, H] at `slots` [R, W] of layer `layer` (an index, or
    `slice(None)` for all layers at once). Out-of-range slots are dropped. In place when the
    pool is donated."""
    layers, pages, size, heads, dim = pool.shape
    flat = pool.reshape(layers, pages * size, heads, dim)
    rows = slots.reshape(-1)
    values = kv.reshape(*kv.shape[:-4], rows.shape[0], heads, dim).astype(pool.dtype)
    return flat.at[layer, rows].set(values, mode="drop").reshape(pool.shape)


def _gather_local(dense_pages: int, per_layer: bool, pool, page_table, lengths) -> KVCache:
    layers, pages, size, heads, dim = pool.shape
    rows, kv_heads = page_table.shape[0], heads // 2
    flat = pool.reshape(layers * pages, size, heads, dim)  # a bitcast: no layer is sliced out
    index = page_table[:, :dense_pages]

    def split(g):  # [..., R, n, S, 2K, H] -> k, v [..., R, K, n * S, H]
        g = g.reshape(*g.shape[:-5], rows, dense_pages * size, kv_heads, 2, dim)
        return tuple(jnp.swapaxes(g[..., j, :], -2, -3) for j in (0, 1))

    if per_layer:
        ks, vs = _gather_rows(flat.reshape(layers * pages, size, kv_heads, 2, dim), index, layers, pages)
        return KVCache(ks, vs, lengths)
    k, v = split(flat[index[None] + (jnp.arange(layers, dtype=jnp.int32) * pages)[:, None, None]])
    return KVCache(k, v, lengths)


def _gather_rows(pages, index, layers: int, pages_per_layer: int):
    """Per layer, keys and values [R, K, n * S, H] of each row's pages `index` [R, n] in
    `pages` [layers * pages_per_layer, S, K, 2, H]. A scan over the rows: each row's pages of
    a layer (n * S * 2K * H values, a few hundred KB) are gathered and transposed into the
    attention's layout while they are in cache. Gathering every row's pages first and then
    transposing the whole [R, n * S, K, H] arrays made XLA on CPU move 256-byte vectors from
    memory twice: 20-23 ms a call against 12-15 (bench model, 8 rows x 256 positions, 8
    layers; CPU time, one thread)."""
    rows, n = index.shape
    size, kv_heads, _, dim = pages.shape[1:]

    def row(_, ids):
        out = []
        for layer in range(layers):
            g = pages[ids + layer * pages_per_layer].reshape(n * size, kv_heads, 2, dim)
            kv = jnp.transpose(g, (2, 1, 0, 3))  # [2, K, n * S, H]
            out += [kv[0], kv[1]]
        return None, tuple(out)

    _, per_row = jax.lax.scan(row, None, index)  # each [R, K, n * S, H]
    return per_row[0::2], per_row[1::2]


def _scatter_local(width: int, page_size: int, from_start: bool, pool, dense: KVCache, page_table, start, count):
    first = start if from_start else jnp.zeros_like(start)
    positions = jnp.clip(first[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], 0, dense.max_len - 1)
    if dense.per_layer:  # [R, K, D, H] per layer
        pick = lambda x: jnp.take_along_axis(x, positions[:, None, :, None], axis=2)
        k, v = jnp.stack([pick(x) for x in dense.k]), jnp.stack([pick(x) for x in dense.v])
    else:  # [L, R, K, D, H]
        pick = lambda x: jnp.take_along_axis(x, positions[None, :, None, :, None], axis=3)
        k, v = pick(dense.k), pick(dense.v)
    kv = interleave(jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3))  # [L, R, W, 2K, H]
    slots = token_slots(page_table, start, count, width, pool.shape[1], page_size)
    return put_tokens(pool, slice(None), kv, slots)


# ---------------------------------------------------------------------- whole-mesh entry points


def dense_spec(spec: PoolSpec, per_layer: bool) -> KVCache:
    kv = spec.heads_spec(4, 1) if per_layer else P(None, spec.batch_axes, spec.head_axis, None, None)
    layers = spec.cfg.num_layers
    return KVCache((kv,) * layers if per_layer else kv, (kv,) * layers if per_layer else kv, spec.rows_spec())


def gather_dense(spec: PoolSpec, pool, page_table, lengths, dense_pages: int, per_layer: bool = False) -> KVCache:
    """The first `dense_pages` pages of every row as a dense cache (`KVCache`, lengths =
    `lengths`): keys and values [layers, R, K, dense_pages * page_size, H], or per layer."""
    fn = functools.partial(_gather_local, dense_pages, per_layer)
    rows = spec.rows_spec()
    return spec.local(fn, (spec.pool_spec(), spec.rows_spec(2), rows), dense_spec(spec, per_layer))(
        pool, page_table, lengths)


def scatter_dense(spec: PoolSpec, pool, dense: KVCache, page_table, start, count, width: int,
                  from_start: bool = True):
    """Write positions [start, start + count) (count <= width) of each row of `dense` into its
    pages. `from_start=False`: `dense` holds just those tokens, at its positions [0, count)."""
    fn = functools.partial(_scatter_local, width, spec.page_size, from_start)
    rows = spec.rows_spec()
    in_specs = (spec.pool_spec(), dense_spec(spec, dense.per_layer), spec.rows_spec(2), rows, rows)
    return spec.local(fn, in_specs, spec.pool_spec())(pool, dense, page_table, start, count)


def read_tokens(pool: jax.Array, spec: PoolSpec, shard: int, pages, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [layers, K, count, H] of a sequence's first `count` tokens (tests, debugging)."""
    host = np.asarray(jax.device_get(pool))
    ids = np.asarray(pages, np.int64) + shard * spec.pages_per_shard
    tokens = host[:, ids].reshape(host.shape[0], -1, host.shape[3], host.shape[4])[:, :count]
    return tokens[:, :, 0::2].transpose(0, 2, 1, 3), tokens[:, :, 1::2].transpose(0, 2, 1, 3)
