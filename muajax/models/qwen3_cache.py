"""The Qwen3 KV cache (`KVCache`): its layout, logical axes and an empty one.

The cache is explicit and functional: `muajax.models.qwen3.forward` takes a cache and
returns the updated one. Each row has its own length; a chunk of new tokens is written at
each row's own offset, so one call serves ragged extend (a user/tool turn appended to every
conversation) and single-token decode alike.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from muajax.models.qwen3_config import Qwen3Config


class KVCache(NamedTuple):
    """k, v: [layers, batch, kv_heads, max_len, head_dim]; lengths: [batch] valid tokens per row.

    Heads come before positions so that one layer's keys and values are already in the
    [batch, kv_heads, positions, head_dim] layout the attention dots consume: with
    positions first, XLA transposed every layer's whole cache on every decode step."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return (self.k[0] if isinstance(self.k, tuple) else self.k).shape[-2]

    @property
    def per_layer(self) -> bool:
        """k and v are tuples of per-layer [batch, kv_heads, max_len, head_dim] arrays."""
        return isinstance(self.k, tuple)


CACHE_AXES = ("layers", "cache_batch", "cache_kv_heads", "cache_length", "head_dim")


def cache_shape(cfg: Qwen3Config, batch: int, max_len: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    dtype = cfg.compute_dtype if dtype is None else dtype
    shape = cache_shape(cfg, batch, max_len)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))
