"""The engine's KV cache: one row per slot, allocated once, sharded over slots and kv heads.

Work on a subset of slots happens on a compact copy of their rows (`take_rows`), written
back afterwards (`put_rows`), so that slots waiting on a user or a tool cost nothing.
Row index `num_slots` is the padding row of a bucketed batch: reads of it are clamped,
writes to it are dropped.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from muajax import parallel
from muajax.models.qwen3 import CACHE_AXES, KVCache, Qwen3Config, cache_shape


def cache_shardings(cfg: Qwen3Config, num_slots: int, max_len: int, mesh: Mesh) -> KVCache:
    shape = cache_shape(cfg, num_slots, max_len)
    kv = NamedSharding(mesh, parallel.logical_to_spec(shape, CACHE_AXES, mesh))
    lengths = NamedSharding(mesh, parallel.logical_to_spec((num_slots,), ("cache_batch",), mesh))
    return KVCache(kv, kv, lengths)


def allocate(cfg: Qwen3Config, num_slots: int, max_len: int, mesh: Mesh | None, dtype=None) -> KVCache:
    dtype = cfg.compute_dtype if dtype is None else dtype
    shape = cache_shape(cfg, num_slots, max_len)

    def zeros():
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_slots,), jnp.int32))

    if mesh is None:
        return jax.jit(zeros)()
    return jax.jit(zeros, out_shardings=cache_shardings(cfg, num_slots, max_len, mesh))()


def take_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    return KVCache(
        jnp.take(cache.k, rows, axis=1, mode="clip"),
        jnp.take(cache.v, rows, axis=1, mode="clip"),
        jnp.take(cache.lengths, rows, axis=0, mode="clip"),
    )


def take_layer_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """`take_rows`, as a per-layer cache (`KVCache.per_layer`): one buffer per layer."""
    def take(stacked):
        return tuple(jnp.take(stacked[i], rows, axis=0, mode="clip") for i in range(stacked.shape[0]))

    return KVCache(take(cache.k), take(cache.v), jnp.take(cache.lengths, rows, axis=0, mode="clip"))


def put_layer_rows(cache: KVCache, rows: jax.Array, sub: KVCache) -> KVCache:
    def put(stacked, layers):
        for i, layer in enumerate(layers):
            stacked = stacked.at[i, rows].set(layer, mode="drop")
        return stacked

    return KVCache(put(cache.k, sub.k), put(cache.v, sub.v), cache.lengths.at[rows].set(sub.lengths, mode="drop"))


def put_rows(cache: KVCache, rows: jax.Array, sub: KVCache) -> KVCache:
    return KVCache(
        cache.k.at[:, rows].set(sub.k, mode="drop"),
        cache.v.at[:, rows].set(sub.v, mode="drop"),
        cache.lengths.at[rows].set(sub.lengths, mode="drop"),
    )


def constrain(cache: KVCache, shardings: KVCache | None) -> KVCache:
    if shardings is None:
        return cache
    return KVCache(*(jax.lax.with_sharding_constraint(x, s) for x, s in zip(cache, shardings)))
