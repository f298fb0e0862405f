"""Parameters read to the host a block at a time, and their fingerprint.

A 32B model's params are ~131 GB in float32, sharded over many devices and hosts. Export
and the fingerprint each need every byte on a host once, never all at once: `host_block`
returns one block of a leaf (one layer of a stacked leaf, or a range of rows) as numpy,

- built from this process's addressable shards when the leaf is fully addressable (each
  shard's part of the block is sliced on its device and copied; replicas are read once);
- otherwise (a leaf split across processes) by a jitted slice of the block, gathered to
  every process (`multihost_utils.process_allgather` of that block alone): every process
  must then call it in the same order, as with any collective.

So a host holds one block, and a device at most one block beside its shards; no leaf is
ever replicated to every device.

`fingerprint(params)` is sha256 over every leaf's bytes in tree order, each leaf in C order:
the definition `params_fingerprint` always had (its value for the same params is unchanged),
now fed block by block (`row_blocks`: consecutive ranges of the leading axes whose bytes are
consecutive in C order, at most `block_bytes` each where a row allows). It does not depend on
how the params are sharded, and every process computes the same digest.
"""
from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np

BLOCK_BYTES = 64 << 20  # the fingerprint's block: 64 MiB of a leaf on the host at a time

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, sizes), one of each per axis


def row_blocks(shape: Sequence[int], itemsize: int, block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """Blocks of an array of `shape` whose C-order bytes, concatenated in the order given,
    are the array's C-order bytes: the leading axes are fixed one index at a time down to
    the first axis whose one index holds at most `block_bytes`, and that axis is cut into
    ranges of as many indices as fit (at least one)."""
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) == 0:
        return
    if not shape:
        yield (), ()
        return
    axis = next((a for a in range(len(shape)) if math.prod(shape[a + 1:]) * itemsize <= block_bytes),
                len(shape) - 1)
    per_index = math.prod(shape[axis + 1:]) * itemsize
    rows = max(1, block_bytes // per_index)
    for prefix in np.ndindex(*shape[:axis]):
        for start in range(0, shape[axis], rows):
            size = min(rows, shape[axis] - start)
            yield ((*prefix, start) + (0,) * (len(shape) - axis - 1),
                   (1,) * axis + (size,) + shape[axis + 1:])


def _overlap(index: tuple, starts: Sequence[int], sizes: Sequence[int], shape: Sequence[int]):
    """(slices into the shard, slices into the block) where the shard at `index` (a tuple of
    slices of the global array) meets the block; None when they do not meet."""
    in_shard, in_block = [], []
    for sl, start, size, dim in zip(index, starts, sizes, shape):
        lo, hi, _ = sl.indices(dim)
        a, b = max(lo, start), min(hi, start + size)
        if a >= b:
            return None
        in_shard.append(slice(a - lo, b - lo))
        in_block.append(slice(a - start, b - start))
    return tuple(in_shard), tuple(in_block)


def _from_shards(x: jax.Array, starts: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    out = np.empty(tuple(sizes), x.dtype)
    seen = set()
    for shard in x.addressable_shards:
        key = tuple(sl.indices(d)[:2] for sl, d in zip(shard.index, x.shape))
        if key in seen:  # a replica of a part already copied
            continue
        seen.add(key)
        where = _overlap(shard.index, starts, sizes, x.shape)
        if where is None:
            continue
        in_shard, in_block = where
        data = shard.data
        whole = all(s.start == 0 and s.stop == n for s, n in zip(in_shard, data.shape))
        if whole or shard.device.platform == "cpu":  # a host shard's numpy view costs nothing
            out[in_block] = np.asarray(data)[in_shard]
        else:  # only the part needed leaves the accelerator
            out[in_block] = np.asarray(data[in_shard])
    return out


@functools.lru_cache(maxsize=64)
def _slicer(sizes: tuple[int, ...]):
    return jax.jit(lambda x, starts: jax.lax.dynamic_slice(x, list(starts), sizes))


def _gathered(x: jax.Array, starts: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    from jax.experimental import multihost_utils

    block = _slicer(tuple(sizes))(x, np.asarray(starts, np.int32))
    return np.asarray(multihost_utils.process_allgather(block, tiled=True))


def host_block(x, starts: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """x[starts : starts + sizes] (per axis) as a numpy array on this host (see the module
    docstring for how a sharded leaf is read). A leaf split across processes is a collective."""
    if not isinstance(x, jax.Array):
        index = tuple(slice(s, s + n) for s, n in zip(starts, sizes))
        return np.ascontiguousarray(np.asarray(x)[index])
    if x.is_fully_addressable:
        return _from_shards(x, starts, sizes)
    return _gathered(x, starts, sizes)


def host_index(x, i: int) -> np.ndarray:
    """x[i] (along the leading axis) on the host: one layer of a stacked leaf."""
    shape = tuple(x.shape)
    return host_block(x, (i,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]


def host_array(x) -> np.ndarray:
    """The whole of `x` on the host."""
    return host_block(x, (0,) * len(x.shape), tuple(x.shape))


def fingerprint(params, block_bytes: int = BLOCK_BYTES) -> str:
    """sha256 over every leaf's bytes in tree order (each leaf C-ordered): equal iff the
    params are bitwise equal, whatever their sharding; the same on every process."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        dtype = np.dtype(leaf.dtype)
        for starts, sizes in row_blocks(leaf.shape, dtype.itemsize, block_bytes):
            digest.update(host_block(leaf, starts, sizes).tobytes())
    return digest.hexdigest()
