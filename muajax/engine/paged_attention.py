"""Attention over the paged pool: a pure-JAX path (CPU, GPU, the reference) and jax's Pallas
`ragged_paged_attention` kernel (TPU). `resolve_attention` picks one by backend.

Pure JAX, in place ("paged", `paged_reference.py`): every layer writes its new keys and
values into their pages, then attends over each row's pages block by block. Every extend
off TPU runs this way, and the decode on GPU.

Pure JAX, dense ("reference", the CPU decode): the pages a decode chunk's rows use (a
bucket of its longest row, not the pool) are gathered, shard-locally, once per chunk into a
dense cache, and the model's own dot attention runs on it; the chunk's new keys and values
are written back to their pages at its end. `ragged_reference` below is the Pallas kernel's
contract in these terms (its tests' reference).

Pallas ("pallas"): the kernel takes the queries of all sequences concatenated (`cu_q_lens`
bounds each), `kv_lens`, `page_indices` and reads the pages in place, mixing prefill and
decode rows. It is the model's `cache_attention` hook: per layer the new keys and values
are written into their pages, then the kernel attends. All of it runs inside `shard_map`
(each shard's rows on its own pages and heads), with explicit block sizes and VMEM limit:
the kernel's own tuned-size lookup reads the local device, which is not the target when
compiling for a TPU topology from a CPU host. The kernel needs head_dim % 128 == 0 (Qwen3's
is 128). The layer index is added to the page ids against a [layers * pages] view of the
pool, so no layer is sliced out of it (a slice feeding a custom call would be a copy).

GPU: jax's Pallas GPU `paged_attention` is decode-only (one query per sequence) and wants
separate key and value pools, heads first; the pool here has the TPU kernel's layout, so
GPUs take the pure-JAX path that reads the pages in place (`paged_reference.py`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ragged_paged_attention,
)

from muajax.engine import kv_cache
from muajax.engine.kv_cache import PoolSpec
from muajax.models.attention import attention
from muajax.models.qwen3 import AttentionContext, Qwen3Config, rope_tables

ATTENTION_CHOICES = ("auto", "reference", "paged", "pallas")


def kernel_supports(cfg: Qwen3Config) -> bool:
    return cfg.head_dim % 128 == 0


def resolve_attention(requested: str, cfg: Qwen3Config, mesh=None) -> str:
    """"auto" -> "pallas" on TPU (when the kernel supports the model), "paged" on GPU, else
    "reference". Extends read the pages in place on every path; the decode differs:
    reference gathers a chunk's pages once into a dense cache (fastest on CPU, where a decode
    step is short and the gather is paid once per chunk), paged reads them in place every
    step (a GPU's memory holds no dense copy of every layer)."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention={requested!r}: expected one of {ATTENTION_CHOICES}")
    if requested == "pallas" and not kernel_supports(cfg):
        raise ValueError(f"the Pallas ragged paged attention kernel needs head_dim % 128 == 0, got {cfg.head_dim}")
    if requested != "auto":
        return requested
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    if platform == "tpu" and kernel_supports(cfg):
        return "pallas"
    return "paged" if platform in ("gpu", "cuda", "rocm") else "reference"


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """The kernel's tuning knobs. `kv_pages_per_block=None`: as many pages as make 512 tokens."""

    kv_pages_per_block: int | None = None
    queries_per_block: int = 32
    vmem_limit_bytes: int = 32 * 2**20

    def pages(self, page_size: int, pages_per_seq: int) -> int:
        wanted = self.kv_pages_per_block or max(1, 512 // page_size)
        return max(1, min(wanted, pages_per_seq))


DEFAULT_BLOCKS = KernelBlocks()


# ---------------------------------------------------------------------- pure JAX


def ragged_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, max_q_len: int,
                     dense_pages: int):
    """The kernel's contract in pure JAX, through the engine's own pieces (the shard-local page
    gather and the model's attention): queries [T, N, H] of sequences i < num_seqs[0] at
    [cu_q_lens[i], cu_q_lens[i+1]), each the last q_len of its kv_lens[i] positions; reads
    the first `dense_pages` pages of each row (>= every used one), at most `max_q_len` queries
    per row. Rows past num_seqs and queries past cu_q_lens[num_seqs] give zeros."""
    rows = page_indices.shape[0]
    real = jnp.arange(rows) < num_seqs[0]
    q_lens = jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(real, kv_lens, 0)
    offsets = jnp.arange(max_q_len, dtype=jnp.int32)[None, :]
    padded = q[jnp.clip(cu_q_lens[:-1, None] + offsets, 0, q.shape[0] - 1)]  # [R, W, N, H]
    dense = kv_cache._gather_local(dense_pages, False, kv_pages[None], page_indices, kv_lens)
    q_index = (kv_lens - q_lens)[:, None] + offsets
    kv_valid = jnp.arange(dense.max_len)[None, :] < kv_lens[:, None]
    out = attention(padded, dense.k[0], dense.v[0], implementation="xla", q_index=q_index, kv_valid=kv_valid)
    token_row = jnp.searchsorted(cu_q_lens[1:], jnp.arange(q.shape[0]), side="right")
    token_row = jnp.clip(token_row, 0, rows - 1)
    position = jnp.arange(q.shape[0]) - cu_q_lens[token_row]
    flat = out[token_row, jnp.clip(position, 0, max_q_len - 1)]
    keep = jnp.arange(q.shape[0]) < cu_q_lens[num_seqs[0]]
    return jnp.where(keep[:, None, None], flat, 0)


# ---------------------------------------------------------------------- Pallas (the model's hook)


class KernelBatch(NamedTuple):
    """A batch [R rows, W] in the kernel's terms, per shard (every array rows-first, sharded
    like the rows): rows with new tokens are moved first (`page_indices`, `kv_lens`,
    `cu_q_lens`, `num_seqs`); `src` [R*W] gathers the packed queries from the padded
    [R*W] layout, `dst` [R, W] takes the outputs back; `slots` [R, W] are the new tokens'
    flat page slots (out of range for padding)."""

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    src: jax.Array
    dst: jax.Array
    slots: jax.Array


def _kernel_batch_local(width: int, num_pages: int, page_size: int, page_table, lengths, num_new) -> KernelBatch:
    rows = lengths.shape[0]
    order = jnp.argsort(num_new == 0, stable=True)  # rows with queries first, in row order
    q_lens = num_new[order]
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    packed = jnp.arange(rows * width, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu[1:], packed, side="right"), 0, rows - 1)
    src = jnp.where(packed < cu[-1], order[row] * width + packed - cu[row], 0)
    rank = jnp.argsort(order)
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :]
    dst = jnp.where(offsets < num_new[:, None], cu[rank][:, None] + offsets, 0)
    slots = kv_cache.token_slots(page_table, lengths, num_new, width, num_pages, page_size)
    return KernelBatch((lengths + num_new)[order], page_table[order], cu,
                       jnp.sum(num_new > 0, dtype=jnp.int32).reshape(1), src, dst, slots)


def kernel_batch(spec: PoolSpec, page_table, lengths, num_new, width: int) -> KernelBatch:
    fn = functools.partial(_kernel_batch_local, width, spec.pages_per_shard, spec.page_size)
    rows = spec.rows_spec()
    out = KernelBatch(rows, spec.rows_spec(2), rows, rows, rows, spec.rows_spec(2), spec.rows_spec(2))
    return spec.local(fn, (spec.rows_spec(2), rows, rows), out)(page_table, lengths, num_new)


def paged_context(cfg: Qwen3Config, lengths, width: int, batch: KernelBatch) -> AttentionContext:
    q_index = lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    return AttentionContext(q_index, None, None, cos, sin, pages=batch)


def _attend_local(blocks: KernelBlocks, q, k, v, pool, layer, batch: KernelBatch):
    rows, width, heads, dim = q.shape
    layers, pages = pool.shape[:2]
    pool = kv_cache.put_tokens(pool, layer, kv_cache.interleave(k, v), batch.slots)
    packed = q.reshape(rows * width, heads, dim)[batch.src]
    out = ragged_paged_attention(
        packed, pool.reshape(layers * pages, *pool.shape[2:]), batch.kv_lens, batch.page_indices + layer * pages,
        batch.cu_q_lens, batch.num_seqs, sm_scale=dim**-0.5,
        num_kv_pages_per_block=blocks.pages(pool.shape[2], batch.page_indices.shape[1]),
        num_queries_per_block=min(blocks.queries_per_block, rows * width), vmem_limit_bytes=blocks.vmem_limit_bytes)
    return out[batch.dst.reshape(-1)].reshape(rows, width, heads, dim), pool


def pallas_cache_attention(spec: PoolSpec, blocks: KernelBlocks, q, k, v, pool, layer, ctx: AttentionContext):
    """The `cache_attention` hook (see `muajax.models.qwen3.DecoderLayer`) for the TPU kernel."""
    heads = spec.heads_spec(4, 2)
    rows = spec.rows_spec()
    batch_specs = KernelBatch(rows, spec.rows_spec(2), rows, rows, rows, spec.rows_spec(2), spec.rows_spec(2))
    fn = spec.local(functools.partial(_attend_local, blocks),
                    (heads, heads, heads, spec.pool_spec(), jax.sharding.PartitionSpec(), batch_specs),
                    (heads, spec.pool_spec()))
    return fn(q, k, v, pool, layer, ctx.pages)
