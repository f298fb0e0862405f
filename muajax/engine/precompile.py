"""Compiling an engine's programs before they are needed.

Every static shape a call can take is one compilation, paid (seconds on a CPU host) by
whichever conversation first needs it: decode per rows bucket (and on the pure-JAX
"reference" decode per gather length, `batching.dense_pages`, a bucket of the longest
row's pages, or every row's max_len with fixed rows), extend per rows bucket (packed: one width, the tile; fixed rows: per
width). `warm_programs` runs each of them once on rows
that have nothing to do (no token to write, no step to take), so the pool is unchanged.
"""
from __future__ import annotations

import numpy as np

from muajax.engine import batching


def static_shapes(engine, max_tokens: int | None = None) -> list[tuple[str, int, int, int | None]]:
    """(program, rows per shard, width, dense pages) of every call a conversation of up to
    `max_tokens` tokens can make (width 1: decode; dense pages None: the Pallas path)."""
    spec = engine.spec.pool
    top = min(max_tokens or engine.max_len, engine.max_len)
    reference = engine.spec.dense_decode  # gathers a dense copy: one program per gather length

    def dense(low: int):
        if engine.batch_rows is not None and reference:  # fixed rows: the whole max_len (Engine._decode_call)
            return (spec.max_pages,)
        return batching.dense_buckets(spec, low, max(low, top)) if reference else (None,)

    shapes = [("decode", rows, 1, d) for rows in engine.batch_buckets for d in dense(1)]
    if engine.batch_rows is None:  # packed: at most every slot's `top` tokens in tiles
        tiles = engine.num_slots * -(-top // engine.extend_tile)
        return shapes + [("extend", rows, engine.extend_tile, None) for rows in engine.extend_buckets
                         if rows == engine.extend_buckets[0] or rows // 2 < tiles]
    previous = 0
    for width in engine.extend_widths:
        if previous >= top:
            break
        for rows in batching.extend_rows(width, engine.batch_buckets, engine.max_extend_tokens, True):
            shapes.append(("extend", rows, width, None))
        previous = width
    return shapes


def warm_programs(engine, max_tokens: int | None = None) -> int:
    """Run every call of `static_shapes` once on idle rows; returns how many there were."""
    spec = engine.spec.pool
    saved = dict(engine.stats)
    shapes = static_shapes(engine, max_tokens)
    for program, rows, width, dense in shapes:
        total = spec.num_shards * rows
        table = np.zeros((total, spec.max_pages), np.int32)
        zeros = np.zeros((total,), np.int32)
        if program == "decode":
            ones = np.ones((total,), np.float32)
            arrays = (table, zeros, zeros, zeros.astype(np.uint32), ones, ones, zeros, zeros, zeros)
            engine._run(engine._programs.decode, arrays, dense_pages=dense)
        else:
            arrays = (table, zeros, np.zeros((total, width), np.int32), zeros)
            engine._run(engine._programs.extend, arrays, live=0)
    engine.stats.update(saved)
    return len(shapes)
