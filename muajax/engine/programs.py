"""The engine's device programs: extend (write a chunk of new tokens into the pool) and decode
(up to `decode_chunk` sample steps on device), for either attention path, and their
abstract arguments so that a planner can compile them for hardware it does not have.

Both programs take host-made per-row arrays laid out by shard (see kv_cache.py): the page
table [R, max_pages] (shard-local page ids), `lengths` [R] (tokens already cached), and
donate the pool, which they return updated in place.

Compilations: per rows bucket and width (extend) or rows bucket (decode), and with the
pure-JAX path per dense-length bucket (the pages gathered, a power of two of the longest
row); the Pallas path reads the page table as it is and has no such bucket.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muajax import parallel
from muajax.engine import (
    batching,
    dense_decode,
    kv_cache,
    paged_attention,
    paged_reference,
)
from muajax.engine.decode_loop import decode_loop, live_tiles  # noqa: F401 (live_tiles: re-exported)
from muajax.engine.experts import expert_dtype
from muajax.engine.kv_cache import PoolSpec
from muajax.engine.paged_attention import DEFAULT_BLOCKS, KernelBlocks
from muajax.models import qwen3
from muajax.models.qwen3 import (
    AttentionContext,
    Qwen3,
    Qwen3Config,
    forward,
    rope_tables,
)
from muajax.models.sharding import param_shardings
from muajax.models.token_tiles import TokenTiles


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """Everything static about the programs (hashable)."""

    pool: PoolSpec
    max_len: int
    decode_chunk: int
    attention: str  # "reference", "paged" or "pallas" (resolved)
    blocks: KernelBlocks = DEFAULT_BLOCKS
    # Token tiles (muajax.models.token_tiles): an extend's dots one row (its width) at a time,
    # a decode step's `decode_tile` rows at a time; a row's numbers then do not depend on
    # what else is in the call. False: each dot over the whole call.
    tiled: bool = False
    decode_tile: int = 4
    # A mixture of experts' chosen experts out of every extend and decode (engine/experts.py):
    # the extend returns (pool, experts [R, W, L, k]) and the decode's outputs gain experts
    # [R, steps, L, k], in `experts.expert_dtype`. The CPU decode then reads pages in place.
    record_experts: bool = False

    @property
    def dense_decode(self) -> bool:
        """The decode gathers a dense copy of each chunk's pages (`_decode_reference`)."""
        return self.attention == "reference" and not self.tiled and not self.record_experts

    @property
    def cfg(self) -> Qwen3Config:
        return self.pool.cfg

    def model_cfg(self, tile: int) -> Qwen3Config:
        """The model's config for a program whose dots take `tile` tokens at a time."""
        if not self.tiled:
            return self.cfg
        return self.cfg.replace(token_tiles=TokenTiles(tile, self.pool.num_shards))


def build_spec(cfg: Qwen3Config, mesh, *, num_slots: int, max_len: int, kv_cache_tokens: int | None = None,
               page_size: int | None = None, decode_chunk: int = 32, attention: str = "auto",
               blocks: KernelBlocks = DEFAULT_BLOCKS, tiled: bool = False, decode_tile: int = 4,
               record_experts: bool = False) -> ProgramSpec:
    """The programs' static spec from the Engine's arguments (the Engine and planners both
    come through here). Defaults: a pool of max(num_slots, shards) * max_len tokens (room for
    every conversation at full length: no preemption), pages of 128 tokens for the Pallas
    kernel (few pages per sequence: its page table lives in scalar memory) and 16 otherwise."""
    attention = paged_attention.resolve_attention(attention, cfg, mesh)
    page_size = page_size or (128 if attention == "pallas" else 16)
    shards = 1 if mesh is None else parallel.batch_divisor(mesh)
    tokens = kv_cache_tokens or max(num_slots, shards) * max_len
    pool = make_pool_spec(cfg, mesh, kv_cache_tokens=tokens, page_size=page_size, max_len=max_len)
    if record_experts and not cfg.is_moe:
        raise ValueError("record_experts: the model is not a mixture of experts (cfg.num_experts == 0)")
    return ProgramSpec(pool, max_len, decode_chunk, attention, blocks, tiled, decode_tile, record_experts)


def make_pool_spec(cfg: Qwen3Config, mesh, *, kv_cache_tokens: int, page_size: int, max_len: int) -> PoolSpec:
    """A pool of at least `kv_cache_tokens` tokens in `page_size` pages, split evenly over the
    mesh's data-parallel shards; each shard must hold one `max_len` sequence."""
    if page_size < 1 or kv_cache_tokens < 1 or max_len < 2:
        raise ValueError(f"need page_size >= 1, kv_cache_tokens >= 1, max_len >= 2; got {page_size}, "
                         f"{kv_cache_tokens}, {max_len}")
    shards = 1 if mesh is None else parallel.batch_divisor(mesh)
    max_pages = -(-max_len // page_size)
    per_shard = -(-kv_cache_tokens // (shards * page_size))
    if per_shard < max_pages:
        raise ValueError(f"kv_cache_tokens={kv_cache_tokens} gives each of {shards} shard(s) {per_shard} pages of "
                         f"{page_size} tokens, fewer than one max_len={max_len} sequence needs ({max_pages})")
    return PoolSpec(cfg, mesh, per_shard, page_size, max_pages)


class Program:
    """A jitted program that traces and runs under the mesh's activation rules."""

    def __init__(self, fn, mesh, static_argnames=(), donate_argnums=(1,)):
        self.mesh = mesh
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnums=donate_argnums)

    def __call__(self, *args, **static):
        if self.mesh is None:
            return self.jitted(*args, **static)
        with parallel.activation_rules(self.mesh):
            return self.jitted(*args, **static)

    def lower(self, *args, **static):
        if self.mesh is None:
            return self.jitted.lower(*args, **static)
        with parallel.activation_rules(self.mesh):
            return self.jitted.lower(*args, **static)


class Programs:
    """extend(params, pool, page_table, lengths, tokens [R, W], num_new [R], live) -> pool (with
           `spec.record_experts`: (pool, experts [R, W, L, k]))
    decode(params, pool, layer_params, page_table, lengths, last, seeds, temperature, top_p,
           top_k, budget, limit, stop_ids, *, dense_pages) -> (pool, (tokens, logprobs, counts, reasons, computed))
    `live`: rows with tokens in the fullest shard (they come first in each shard): with token
    tiles only those are computed. `dense_pages`: the pure-JAX decode's gather bucket
    (ignored by the paged and Pallas decodes). `computed`: the row-steps the layers ran; with
    `spec.record_experts` the decode's outputs end with experts [R, steps, L, k]."""

    def __init__(self, spec: ProgramSpec):
        self.spec = spec
        mesh = spec.pool.mesh
        extend = _extend_pallas if spec.attention == "pallas" else _extend_paged
        # with token tiles the CPU decode reads pages in place too: the dense decode's whole-call
        # attention and gather are not cut into tiles
        decode = {"pallas": _decode_pallas, "paged": _decode_paged,
                  "reference": _decode_reference if spec.dense_decode else _decode_paged}[spec.attention]
        self.extend = Program(functools.partial(extend, spec), mesh)
        self.decode = Program(functools.partial(decode, spec), mesh, static_argnames=("dense_pages",))


# ---------------------------------------------------------------------- program bodies


def _hooked_forward(spec: ProgramSpec, hook, pages, params, pool, lengths, tokens, live, logits_index=None,
                    return_hidden=False):
    """The model over `tokens` [R, W] at positions `lengths` + [0, W), with a paged
    `cache_attention` hook that reads `pages` (carried in the context): (logits or hidden,
    pool, experts [R, W, L, k] with `spec.record_experts`, else None)."""
    width = tokens.shape[1]
    q_index = lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(q_index, spec.cfg.head_dim, spec.cfg.rope_theta, spec.cfg.compute_dtype)
    ctx = AttentionContext(q_index, None, None, cos, sin, pages=pages, live_tiles=live)
    cfg = spec.model_cfg(width if width > 1 else spec.decode_tile)
    out, pool, *routing = Qwen3(cfg, cache_attention=hook).apply({"params": params}, tokens, ctx, pool, logits_index,
                                                                 return_hidden, True,
                                                                 return_routing=spec.record_experts)
    if not routing:
        return out, pool, None
    return out, pool, routing[0].experts.transpose(1, 2, 0, 3).astype(expert_dtype(spec.cfg))


def _paged_forward(spec: ProgramSpec, params, pool, page_table, lengths, tokens, num_new, live, logits_index=None,
                   return_hidden=False):
    """Pure JAX over the pages in place (paged_reference.py)."""
    rows = paged_reference.paged_rows(spec.pool, page_table, lengths, num_new, tokens.shape[1])
    hook = functools.partial(paged_reference.paged_cache_attention, spec.pool)
    return _hooked_forward(spec, hook, rows, params, pool, lengths, tokens, live, logits_index, return_hidden)


def _pallas_forward(spec: ProgramSpec, params, pool, page_table, lengths, tokens, num_new, live, logits_index=None,
                    return_hidden=False):
    """The TPU kernel over the pages in place (paged_attention.py). With token tiles the
    kernel's packed batch is made per tile (its arrays are not rows-first: a tile cannot
    slice them), from the tile's rows."""
    width = tokens.shape[1]
    hook = functools.partial(paged_attention.pallas_cache_attention, spec.pool, spec.blocks)
    if not spec.tiled:
        batch = paged_attention.kernel_batch(spec.pool, page_table, lengths, num_new, width)
        return _hooked_forward(spec, hook, batch, params, pool, lengths, tokens, live, logits_index, return_hidden)

    def tile_hook(q, k, v, pool, layer, ctx):
        rows = ctx.pages
        batch = paged_attention.kernel_batch(spec.pool, rows["page_table"], rows["lengths"], rows["num_new"], width)
        return hook(q, k, v, pool, layer, ctx._replace(pages=batch))

    rows = {"page_table": page_table, "lengths": lengths, "num_new": num_new}
    return _hooked_forward(spec, tile_hook, rows, params, pool, lengths, tokens, live, logits_index, return_hidden)


def _extend(forward_fn, spec: ProgramSpec, params, pool, page_table, lengths, tokens, num_new, live):
    # only the cache is wanted: returning the hidden state lets XLA drop the LM head
    _, pool, experts = forward_fn(spec, params, pool, page_table, lengths, tokens, num_new, live, return_hidden=True)
    return pool if experts is None else (pool, experts)


def _decode_reference(spec: ProgramSpec, params, pool, layer_params, page_table, lengths, last, seeds, temperature,
                      top_p, top_k, budget, limit, stop_ids, *, dense_pages):
    """With `layer_params` (per-layer weight buffers, see `Engine._layer_views`) the dense
    cache is gathered per layer and the layers run unrolled, so a step slices nothing out of
    a stacked array (see `forward`). Without, the layer scan over the stacked params.
    Up to `dense_decode.TAIL_MAX_ROWS` rows, the chunk's new tokens go into a tail instead of
    the gathered cache (see dense_decode.py). Never token-tiled: a tiled engine decodes in place."""
    per_layer = layer_params is not None
    dense = kv_cache.gather_dense(spec.pool, pool, page_table, lengths, dense_pages, per_layer)
    if last.shape[0] <= dense_decode.TAIL_MAX_ROWS:
        tail = dense_decode.empty_tail(spec.pool, last.shape[0], spec.decode_chunk, per_layer)

        def tail_step(tail, last, num_new, now):
            return dense_decode.run_step(spec.cfg, params, layer_params, dense, tail, last, now, num_new > 0)

        tail, out = decode_loop(tail_step, tail, lengths, last, seeds, temperature, top_p, top_k, budget, limit,
                                stop_ids, steps=spec.decode_chunk, max_len=spec.max_len)
        return kv_cache.scatter_dense(spec.pool, pool, tail, page_table, lengths, out[2], spec.decode_chunk,
                                      from_start=False), out
    zeros = jnp.zeros((last.shape[0], 1), jnp.int32)

    def step(dense, last, num_new, lengths):
        logits, dense = forward(params, spec.cfg, last[:, None], cache=dense, num_new=num_new, logits_index=zeros,
                                layer_params=layer_params)
        return logits[:, 0], dense

    dense, out = decode_loop(step, dense, lengths, last, seeds, temperature, top_p, top_k, budget, limit, stop_ids,
                             steps=spec.decode_chunk, max_len=spec.max_len)
    return kv_cache.scatter_dense(spec.pool, pool, dense, page_table, lengths, out[2], spec.decode_chunk), out


def _tiles(spec: ProgramSpec) -> TokenTiles | None:
    return TokenTiles(spec.decode_tile, spec.pool.num_shards) if spec.tiled else None


def _decode_in_place(forward_fn, spec: ProgramSpec, params, pool, layer_params, page_table, lengths, last, seeds,
                     temperature, top_p, top_k, budget, limit, stop_ids, *, dense_pages=None):
    """A decode that reads and writes the pages in place every step (no dense copy)."""
    del layer_params, dense_pages
    zeros = jnp.zeros((last.shape[0], 1), jnp.int32)
    shards = spec.pool.num_shards

    def step(pool, last, num_new, lengths):
        live = live_tiles(num_new > 0, shards, spec.decode_tile)
        logits, pool, experts = forward_fn(spec, params, pool, page_table, lengths, last[:, None], num_new, live,
                                           zeros)
        return (logits[:, 0], pool) if experts is None else (logits[:, 0], pool, experts[:, 0])

    c = spec.cfg
    experts = jax.ShapeDtypeStruct((c.num_layers, c.num_experts_per_tok), expert_dtype(c)) \
        if spec.record_experts else None
    return decode_loop(step, pool, lengths, last, seeds, temperature, top_p, top_k, budget, limit, stop_ids,
                       steps=spec.decode_chunk, max_len=spec.max_len, tiles=_tiles(spec), experts=experts)


_decode_pallas = functools.partial(_decode_in_place, _pallas_forward)
_decode_paged = functools.partial(_decode_in_place, _paged_forward)
_extend_pallas = functools.partial(_extend, _pallas_forward)
_extend_paged = functools.partial(_extend, _paged_forward)


# ---------------------------------------------------------------------- abstract arguments (planning)


def row_shardings(spec: PoolSpec, rows: int, width: int | None = None):
    """Shardings of the per-row host inputs: rows over the batch axes."""
    if spec.mesh is None:
        return None
    return NamedSharding(spec.mesh, spec.rows_spec(1 if width is None else 2))


def abstract_extend_args(spec: ProgramSpec, params, rows: int, width: int):
    pool = spec.pool
    rows_sh, table_sh = row_shardings(pool, rows), row_shardings(pool, rows, 1)
    i32 = jnp.int32
    return (params, kv_cache.abstract_pool(pool), jax.ShapeDtypeStruct((rows, pool.max_pages), i32, sharding=table_sh),
            jax.ShapeDtypeStruct((rows,), i32, sharding=rows_sh),
            jax.ShapeDtypeStruct((rows, width), i32, sharding=table_sh),
            jax.ShapeDtypeStruct((rows,), i32, sharding=rows_sh),
            jax.ShapeDtypeStruct((), i32, sharding=None if pool.mesh is None else NamedSharding(pool.mesh, P())))


def abstract_decode_args(spec: ProgramSpec, params, rows: int, num_stop_ids: int = 1):
    pool = spec.pool
    rows_sh, table_sh = row_shardings(pool, rows), row_shardings(pool, rows, 1)
    row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype, sharding=rows_sh)
    stop_sh = None if pool.mesh is None else NamedSharding(pool.mesh, P())
    return (params, kv_cache.abstract_pool(pool), None,
            jax.ShapeDtypeStruct((rows, pool.max_pages), jnp.int32, sharding=table_sh), row(jnp.int32),
            row(jnp.int32), row(jnp.uint32), row(jnp.float32), row(jnp.float32), row(jnp.int32), row(jnp.int32),
            row(jnp.int32), jax.ShapeDtypeStruct((num_stop_ids,), jnp.int32, sharding=stop_sh))


@dataclasses.dataclass
class ProgramCall:
    """One program with abstract arguments: `lower()` (then `.compile()`) allocates nothing."""

    name: str
    program: Program
    args: tuple
    static: dict

    def lower(self):
        return self.program.lower(*self.args, **self.static)


def abstract_params(cfg: Qwen3Config, mesh):
    """ShapeDtypeStructs of the params, in the training layout (`muajax.models.sharding.param_shardings`)."""
    shapes = nn.meta.unbox(qwen3.abstract_params(cfg))
    if mesh is None:
        return shapes
    return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), shapes,
                        param_shardings(cfg, mesh))


def abstract_programs(cfg: Qwen3Config, mesh, *, kv_cache_tokens: int, page_size: int | None = None,
                      max_seqs: int, max_len: int, widths=(32, 128, 512, 2048), decode_chunk: int = 16,
                      max_extend_tokens: int = 8192, attention: str = "auto", blocks: KernelBlocks = DEFAULT_BLOCKS,
                      dense_tokens: int | None = None, params=None, extend_tile: int | None = 16,
                      deterministic: bool = False, decode_tile: int = 4,
                      record_experts: bool = False) -> list[ProgramCall]:
    """The engine's decode program (every shard full: `max_seqs` conversations) and its
    extend program, as an `Engine` with these arguments would build them, on abstract
    arguments: packed (`extend_tile`, the default: one program of as many `extend_tile`
    rows as `max_extend_tokens` allows) or, with `extend_tile=None`, fixed rows at each of
    `widths`. `deterministic`: token tiles (decode rows a multiple of `decode_tile`).
    `dense_tokens` (the pure-JAX dense decode): the positions gathered (default max_len,
    the worst case). `params`: abstract params (default: the training layout on `mesh`).
    `record_experts`: a mixture of experts' programs that also return each token's experts."""
    spec = build_spec(cfg, mesh, num_slots=max_seqs, max_len=max_len, kv_cache_tokens=kv_cache_tokens,
                      page_size=page_size, decode_chunk=decode_chunk, attention=attention, blocks=blocks,
                      tiled=deterministic, decode_tile=decode_tile, record_experts=record_experts)
    programs = Programs(spec)
    params = abstract_params(cfg, mesh) if params is None else params
    shards, per_shard = spec.pool.num_shards, -(-max_seqs // spec.pool.num_shards)
    decode_rows = max(batching.MIN_TILES, -(-per_shard // decode_tile)) * decode_tile if deterministic else per_shard
    dense = spec.dense_decode
    static = {"dense_pages": batching.dense_pages(dense_tokens or max_len, spec.pool) if dense else None}
    calls = [ProgramCall("decode", programs.decode, abstract_decode_args(spec, params, shards * decode_rows), static)]
    if extend_tile:
        rows = max(batching.MIN_TILES if deterministic else 1, max_extend_tokens // extend_tile)
        return calls + [ProgramCall(f"extend_{extend_tile}x{rows}", programs.extend,
                                    abstract_extend_args(spec, params, shards * rows, extend_tile), {})]
    row_buckets = batching.buckets(per_shard)
    for width in sorted({min(w, max_len) for w in widths}):
        rows = batching.bucket(max(1, min(max_extend_tokens // width, row_buckets[-1])), row_buckets)
        calls.append(ProgramCall(f"extend_{width}", programs.extend,
                                 abstract_extend_args(spec, params, shards * rows, width), {}))
    return calls
