"""Host-side batch building: which rows an extend call or a decode chunk gets, bucketed
shapes, and the per-row arrays the device programs read.

A batch has `num_shards * rows_per_shard` rows, shard s's rows at [s * rows_per_shard,
(s + 1) * rows_per_shard) (see kv_cache.py); `rows_per_shard` is a bucket (a power of
two), padding rows have no tokens and a zero page-table row. Extends are chunked: one call
takes at most the widest extend width per row and `max_extend_tokens` (rows x width) per
shard, so no program is as wide as max_len.

Packed extends (`packed_extend_batches`, the default): the waiting tokens of all sequences
are cut into tiles of `tile` tokens, one tile per row ([R, tile]); rows of one sequence
follow each other and each sees the keys of those before it (the extend writes a layer's
keys before any row attends: see paged_reference.py). A lone 50-token turn is then a call
of 4 rows of 16, not rows x the widest width. Rows per shard are a bucket of the tiles; with
token tiles (`muajax.models.token_tiles`) only the live ones are computed.

Fixed rows (`fixed_rows`, the Engine's `batch_rows`): every call has exactly that many rows
per shard (an extend call: as many as `max_extend_tokens` allows at its width), and each
sequence's tokens are extended at the width of its *own* bucket, so the shape of every call
a sequence takes part in follows from that sequence alone. Matmul kernels round differently
at different row counts (XLA:CPU's change strategy with M, measured), so this is what makes
a row's numbers independent of which other rows share its call.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from muajax.engine.kv_cache import PoolSpec
from muajax.engine.pages import PagedSeq, PageTables

# The pure-JAX decode gathers its rows' pages into a dense cache of a bucketed length, at
# least this many tokens' worth, and attends over all of it each step: buckets are powers of
# two and 1.5x powers of two (at most a quarter of a bucket is padding, an eighth on
# average), so a step reads little more than its rows' caches for twice as many
# compilations as powers of two alone (measured, bench generate: rows at 160-256 positions
# gathered 256 each chunk; now 192, 192, 256, 256). The least is 192, not 128: a conversation
# under 192 tokens compiles one gather length, as under 256 before.
MIN_DENSE_TOKENS = 192


# Packed extends cut waiting tokens into rows of `extend_tile`; deterministic decode steps run
# `decode_tile` rows at a time (batching.py, muajax/models/token_tiles.py). Each tile reads
# every weight again: on CPU, where the weights stay in cache, small tiles waste little; on an
# accelerator a step is bound by reading the weights from HBM, so extend tiles are long and
# a decode step is one tile of every slot (padded rows are nearly free there).
TILES = {"cpu": (16, 2), "accelerator": (128, None)}  # None: every slot of a shard


def default_tiles(platform: str, num_slots: int, shards: int) -> tuple[int, int]:
    """(extend_tile, decode_tile) on `platform` ("cpu", "tpu", "gpu", ...; see TILES)."""
    extend, decode = TILES["cpu" if platform == "cpu" else "accelerator"]
    return extend, decode or -(-num_slots // shards)


def buckets(limit: int, minimum: int = 1) -> tuple[int, ...]:
    return tuple(sorted({min(max(2**i, minimum), limit) for i in range(limit.bit_length() + 1)}))


# With token tiles a call has at least this many tiles per shard: XLA compiles the loop over
# one tile differently (a dynamic slice of a size-1 axis is simplified away, and the fusions
# around it change), so a conversation alone in a one-tile call rounded differently from the
# same conversation in a call of several (measured: hidden 128, head_dim 32, float32).
MIN_TILES = 2


def decode_buckets(num_slots: int, min_bucket: int, fixed_rows: int | None, tile: int | None) -> tuple[int, ...]:
    """Rows per shard a decode call can have: `fixed_rows` alone; with token tiles whole
    `tile`s, powers of two of them from MIN_TILES up to every slot; else powers of two from
    `min_bucket`. Each is one compilation: a larger minimum trades padded work for fewer."""
    if fixed_rows:
        return (fixed_rows,)
    if tile:
        return tuple(tile * t for t in buckets(max(MIN_TILES, -(-num_slots // tile)), MIN_TILES))
    return buckets(num_slots, min_bucket)


def bucket(n: int, sizes: Sequence[int]) -> int:
    for size in sizes:
        if n <= size:
            return size
    return sizes[-1]


def _dense_sizes(limit: int):
    """Powers of two and 1.5x powers of two up to `limit` (a size >= limit ends it)."""
    size = 1
    while True:
        for candidate in (size, size + size // 2) if size >= 2 else (size,):
            yield min(candidate, limit)
            if candidate >= limit:
                return
        size *= 2


def dense_pages(tokens: int, spec: PoolSpec) -> int:
    """Pages the pure-JAX path gathers to cover `tokens` positions of every row."""
    pages = max(-(-tokens // spec.page_size), -(-MIN_DENSE_TOKENS // spec.page_size), 1)
    return next(size for size in _dense_sizes(spec.max_pages) if size >= min(pages, spec.max_pages))


def dense_buckets(spec: PoolSpec, min_tokens: int = 1, max_tokens: int | None = None) -> tuple[int, ...]:
    """Every `dense_pages` value for `min_tokens`..`max_tokens` (default max_len) positions."""
    low = dense_pages(min_tokens, spec)
    top = dense_pages(max_tokens or spec.max_pages * spec.page_size, spec)
    return tuple(size for size in _dense_sizes(spec.max_pages) if low <= size <= top)


def extend_cap(width: int, row_buckets: Sequence[int], max_tokens: int) -> int:
    """Sequences per shard one extend call at `width` takes."""
    return max(1, min(max_tokens // width, row_buckets[-1]))


def extend_rows(width: int, row_buckets: Sequence[int], max_tokens: int, fixed: bool) -> tuple[int, ...]:
    """The rows-per-shard counts an extend call at `width` can have."""
    cap = extend_cap(width, row_buckets, max_tokens)
    return (cap,) if fixed else tuple(sorted({bucket(n, row_buckets) for n in range(1, cap + 1)}))


def rounds(items: Sequence, shard_of, num_shards: int, cap: int) -> list[list]:
    """`items` in calls of at most `cap` per shard, in order."""
    per_shard = [[] for _ in range(num_shards)]
    for item in items:
        per_shard[shard_of(item)].append(item)
    count = max(map(len, per_shard))
    return [[x for group in per_shard for x in group[i * cap:(i + 1) * cap]] for i in range(-(-count // cap))]


def _by_shard(items, shard_of, spec: PoolSpec, cap: int) -> list[list]:
    groups = [[] for _ in range(spec.num_shards)]
    for item in items:
        if len(groups[shard_of(item)]) < cap:
            groups[shard_of(item)].append(item)
    return groups


@dataclasses.dataclass
class ExtendBatch:
    page_table: np.ndarray  # [R, max_pages]
    lengths: np.ndarray  # [R] tokens cached before the call
    tokens: np.ndarray  # [R, W]
    num_new: np.ndarray  # [R]
    dense_pages: int
    live_rows: int = 0  # rows with tokens in the fullest shard (they come first in each shard)
    seqs: list | None = None  # each row's sequence (None: padding)


def packed_extend_batches(seqs: Sequence[PagedSeq], keep_last: bool, spec: PoolSpec, tile: int,
                          row_buckets: Sequence[int], max_tokens: int, tables: PageTables) -> Iterator[ExtendBatch]:
    """Packed extend calls (see above) writing every queued token (but the last, with
    `keep_last`) of `seqs`, which must already hold their pages; oldest sequences first.
    As `extend_batches`: run each batch before asking for the next."""
    todo = {seq: len(seq.queued) - int(keep_last) for seq in sorted(seqs, key=lambda s: s.priority)}
    todo = {seq: n for seq, n in todo.items() if n > 0}
    cap = max(1, max_tokens // tile)
    while todo:
        groups: list[list[tuple[PagedSeq, int]]] = [[] for _ in range(spec.num_shards)]
        for seq in list(todo):
            group = groups[seq.shard]
            while todo.get(seq, 0) > 0 and len(group) < cap:
                n = min(todo[seq], tile)
                group.append((seq, n))
                todo[seq] -= n
                if todo[seq] == 0:
                    del todo[seq]
        live = max(map(len, groups))
        per_shard = bucket(live, row_buckets)
        rows = spec.num_shards * per_shard
        layout: list[PagedSeq | None] = [None] * rows
        tokens = np.zeros((rows, tile), np.int32)
        lengths, num_new = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
        for shard, group in enumerate(groups):
            for i, (seq, n) in enumerate(group):
                r = shard * per_shard + i
                layout[r] = seq
                tokens[r, :n], lengths[r], num_new[r] = seq.queued[:n], seq.length, n
                seq.cached.extend(seq.queued[:n])
                del seq.queued[:n]
        if int((lengths + num_new).max()) > tables.max_pages * spec.page_size:
            raise RuntimeError("extend past a sequence's page-table width: a bookkeeping bug")
        yield ExtendBatch(tables.rows(layout, spec.max_pages), lengths, tokens, num_new, 0, live, layout)


def extend_batches(seqs: Sequence[PagedSeq], keep_last: bool, spec: PoolSpec, widths: Sequence[int],
                   row_buckets: Sequence[int], max_tokens: int, tables: PageTables,
                   fixed_rows: bool = False) -> Iterator[ExtendBatch]:
    """Extend calls that write every queued token (but the last, with `keep_last`) of `seqs`,
    which must already hold pages for them. Each batch's tokens move from `queued` to
    `cached` as it is yielded: run it before asking for the next. `fixed_rows`: see above."""
    todo = {seq: len(seq.queued) - int(keep_last) for seq in sorted(seqs, key=lambda s: s.priority)}
    todo = {seq: n for seq, n in todo.items() if n > 0}
    while todo:
        if fixed_rows:  # the narrowest own width first; only the sequences of that width
            own = {seq: bucket(min(n, widths[-1]), widths) for seq, n in todo.items()}
            width = min(own.values())
            members = [seq for seq in todo if own[seq] == width]
        else:
            width, members = bucket(max(todo.values()), widths), list(todo)
        cap = extend_cap(width, row_buckets, max_tokens)
        groups = _by_shard(members, lambda s: s.shard, spec, cap)
        per_shard = cap if fixed_rows else bucket(max(map(len, groups)), row_buckets)
        rows = spec.num_shards * per_shard
        layout: list[PagedSeq | None] = [None] * rows
        tokens = np.zeros((rows, width), np.int32)
        lengths, num_new = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
        for shard, group in enumerate(groups):
            for i, seq in enumerate(group):
                r, n = shard * per_shard + i, min(todo[seq], width)
                layout[r] = seq
                tokens[r, :n], lengths[r], num_new[r] = seq.queued[:n], seq.length, n
                seq.cached.extend(seq.queued[:n])
                del seq.queued[:n]
                todo[seq] -= n
                if todo[seq] == 0:
                    del todo[seq]
        if int((lengths + num_new).max()) > tables.max_pages * spec.page_size:
            raise RuntimeError("extend past a sequence's page-table width: a bookkeeping bug")
        yield ExtendBatch(tables.rows(layout, spec.max_pages), lengths, tokens, num_new,
                          dense_pages(int((lengths + num_new).max()), spec), max(map(len, groups)), layout)


@dataclasses.dataclass
class DecodeRows:
    order: list  # the state of each row (None: padding)
    arrays: tuple  # page_table, lengths, last, seeds, temperature, top_p, top_k, budget, limit
    dense_pages: int


def decode_rows(ready: Sequence[tuple], spec: PoolSpec, row_buckets: Sequence[int], tables: PageTables) -> DecodeRows:
    """Rows for one decode chunk: `ready` holds (conversation state, limit) pairs, the state
    having `.seq`, `.seed`, `.sampling` and `.tokens`; `limit` is the tokens its pages take.
    Within a shard, rows with the most steps ahead of them come first: a token-tiled decode
    computes the tiles up to the last running row, and rows that run out of budget (or of
    pages) first then leave whole tiles behind them."""
    steps = lambda item: min(item[1], item[0].sampling.max_new_tokens - len(item[0].tokens))  # noqa: E731
    ready = sorted(ready, key=lambda item: -steps(item))  # stable: ties keep their order
    groups = _by_shard(ready, lambda item: item[0].seq.shard, spec, row_buckets[-1])
    per_shard = bucket(max(map(len, groups)), row_buckets)
    rows = spec.num_shards * per_shard
    order = [None] * rows
    lengths, last, top_k, budget, limit = (np.zeros((rows,), np.int32) for _ in range(5))
    seeds = np.zeros((rows,), np.uint32)
    temperature, top_p = np.ones((rows,), np.float32), np.ones((rows,), np.float32)
    for shard, group in enumerate(groups):
        for i, (state, room) in enumerate(group):
            r, seq, sp = shard * per_shard + i, state.seq, state.sampling
            order[r] = state
            lengths[r], last[r], seeds[r], limit[r] = seq.length, seq.queued[-1], state.seed, room
            temperature[r], top_p[r], top_k[r] = sp.temperature, sp.top_p, sp.top_k
            budget[r] = sp.max_new_tokens - len(state.tokens)
    table = tables.rows([None if s is None else s.seq for s in order], spec.max_pages)
    arrays = (table, lengths, last, seeds, temperature, top_p, top_k, budget, limit)
    return DecodeRows(order, arrays, dense_pages(int((lengths + limit).max()), spec))


def to_device(arrays: Sequence[np.ndarray], spec: PoolSpec) -> list:
    """Per-row host arrays onto the devices, rows split over the shards (one transfer)."""
    if spec.mesh is None:
        return jax.device_put(list(arrays))
    return jax.device_put(list(arrays), [NamedSharding(spec.mesh, spec.rows_spec(a.ndim)) for a in arrays])
