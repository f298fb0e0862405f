"""Batch-invariant token-wise compute: the projections and the MLP in fixed tiles of tokens.

A matmul kernel picks its blocking (and so the order in which it adds up each output) from
the shapes it is given: XLA:CPU's dot rounds a row of [M, K] x [K, N] differently at
different M (measured on this project's CPU box: K=1024, N=256 gives one result at M=1 and
another at M >= 2; K=256, N=1024 a third for 2 <= M < 64). An engine that packs whatever
tokens are waiting into one call would then give a conversation different bits depending
on who shares its call. Run every token-wise dot on a fixed [tile, K] slice instead, in a
loop over the tiles, and a token's numbers depend only on its own row: the kernel sees one
shape whatever the call holds, and a row of it does not read the others.

`TokenTiles(tile, shards)` is static (part of `Qwen3Config.token_tiles`): the token axis
[M] is `shards` groups (the engine's data-parallel shards: each device keeps its own rows
and a dot never mixes them) of M / shards tokens, each cut into tiles of `tile`. Only the
first `live` tiles of each group run (a dynamic count: the engine packs real tokens first),
so padding costs nothing; the rest come out zero.

Not only dots: XLA:CPU's row reductions change too (an RMSNorm over [M, 64] rounds a row
differently from M = 64 on, measured), and elementwise code may be vectorised differently
at different lengths. So with a KV cache hook the whole decoder layer runs per tile
(`tiled_layer`): norms, projections, rotary tables, the cache write and the attention, the
MLP; and the final norm, the LM head (`map_tiles`) and sampling likewise.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TokenTiles:
    tile: int
    shards: int = 1

    def __post_init__(self):
        if self.tile < 1 or self.shards < 1:
            raise ValueError(f"TokenTiles needs tile >= 1 and shards >= 1, got {self.tile}, {self.shards}")

    def tiles_per_shard(self, tokens: int) -> int:
        if tokens % (self.tile * self.shards):
            raise ValueError(f"{tokens} tokens do not split into {self.shards} shard(s) of {self.tile}-token tiles")
        return tokens // (self.tile * self.shards)


def map_tiles(tiles: TokenTiles, live, fn, *xs):
    """`fn` over [tile, ...] slices of each x [M, ...] (M = shards x n x tile): for tile j of
    every shard with j < `live` (a traced int32 scalar; None: all n), zeros beyond. `fn`
    returns a tuple of [tile, ...] arrays; so does this, each [M, ...]."""
    n = tiles.tiles_per_shard(xs[0].shape[0])
    grouped = [x.reshape(tiles.shards, n, tiles.tile, *x.shape[1:]) for x in xs]
    # each shard's tile j as one [shards, tile, ...] slice: under a mesh the shard axis is the
    # rows' data-parallel split, so every device runs its own [tile, ...] dot
    run = jax.vmap(fn)
    shapes = jax.eval_shape(run, *(g[:, 0] for g in grouped))
    outs = tuple(jnp.zeros((tiles.shards, n, *s.shape[1:]), s.dtype) for s in shapes)

    def body(j, outs):
        results = run(*(jax.lax.dynamic_index_in_dim(g, j, 1, keepdims=False) for g in grouped))
        return tuple(jax.lax.dynamic_update_index_in_dim(o, r, j, 1) for o, r in zip(outs, results))

    count = n if live is None else jnp.clip(live, 0, n)
    outs = jax.lax.fori_loop(0, count, body, outs)
    return tuple(o.reshape(tiles.shards * n * tiles.tile, *o.shape[3:]) for o in outs)


def tiled_layer(tiles: TokenTiles, rope, pre_attention, post_attention, cache_attention, x, cache, layer, ctx,
                extra=None):
    """One decoder layer over x [R, W, D] a tile (tile / W rows) at a time, for the first
    `ctx.live_tiles` tiles of each shard: `pre_attention(x, cos, sin) -> q, k, v`, the cache
    hook `cache_attention(q, k, v, cache, layer, ctx) -> (out, cache)` on the tile's rows
    of every rows-first array of `ctx` (q_index, pages, routing), `post_attention(x, out, ctx)
    -> (x, tile extra)`; `rope(q_index) -> cos, sin`. Tiles run in order, so a row sees the
    cache writes of the rows before it. `extra`: None, or a pair (rows, sums) of pytrees
    (e.g. a mixture of experts' `LayerRouting`): each tile's rows' leaves [tile rows, W, ...]
    are written at its rows, its sums' leaves added up. Returns (x, cache, extra)."""
    rows, width = x.shape[:2]
    if tiles.tile % width or rows % (tiles.shards * (tiles.tile // width)):
        raise ValueError(f"tiles of {tiles.tile} tokens over {tiles.shards} shard(s) do not cut [{rows}, {width}] rows")
    per_tile = tiles.tile // width
    n = rows // (tiles.shards * per_tile)
    group = lambda a: a.reshape(tiles.shards, n, per_tile, *a.shape[1:])
    take = lambda a, j: jax.lax.dynamic_index_in_dim(group(a), j, 1, keepdims=False).reshape(-1, *a.shape[1:])
    put = lambda g, a, j: jax.lax.dynamic_update_index_in_dim(g, a.reshape(tiles.shards, per_tile, *a.shape[1:]), j, 1)

    def body(j, carry):
        grouped, cache, extra = carry
        xt = jax.lax.dynamic_index_in_dim(grouped, j, 1, keepdims=False).reshape(-1, *x.shape[1:])
        q_index = take(ctx.q_index, j)
        cos, sin = rope(q_index)
        sub = ctx._replace(q_index=q_index, cos=cos, sin=sin, pages=jax.tree.map(lambda a: take(a, j), ctx.pages),
                           routing=None if ctx.routing is None else take(ctx.routing, j))
        attn, cache = cache_attention(*pre_attention(xt, cos, sin), cache, layer, sub)
        out, tile_extra = post_attention(xt, attn, sub)
        if extra is not None:
            (rows_out, sums), (tile_rows, tile_sums) = extra, tile_extra
            extra = type(extra)(jax.tree.map(lambda g, a: put(g, a, j), rows_out, tile_rows),
                                jax.tree.map(jnp.add, sums, tile_sums))
        return put(grouped, out, j), cache, extra

    live = n if ctx.live_tiles is None else jnp.clip(ctx.live_tiles, 0, n)
    if extra is not None:
        extra = type(extra)(jax.tree.map(group, extra[0]), extra[1])
    grouped, cache, extra = jax.lax.fori_loop(0, live, body, (group(x), cache, extra))
    if extra is not None:
        extra = type(extra)(jax.tree.map(lambda g: g.reshape(rows, *g.shape[3:]), extra[0]), extra[1])
    return grouped.reshape(x.shape), cache, extra
