"""Grouped matmul: `jax.lax.ragged_dot`'s result without its dense all-groups lowerings.

`grouped_matmul(lhs [M, D], rhs [E, D, F], group_sizes [E]) -> [M, F]`: lhs's rows sorted
by group (group g holds `group_sizes[g]` consecutive rows, from row 0), each row times its
group's [D, F]; rows past sum(group_sizes) give 0. The same contract as `ragged_dot`.

Why not `ragged_dot` alone (jax 0.10.2):
- XLA:CPU has no ragged dot: jax lowers it (forward and both transposes) to a masked dense
  dot over every group, E times the FLOPs the rows need.
- XLA:TPU compiles the forward to its native ragged-dot kernel, but jax's transpose rule for
  the weights is a `ragged_dot_general` in RAGGED_CONTRACTING mode, which XLA:TPU expands to
  one convolution over every local group with the other groups' rows masked.

So a `jax.custom_vjp`:
- forward, and d lhs (the cotangent times rhs transposed, the same grouped matmul):
  the native `ragged_dot` where the platform has a kernel (TPU, GPU); on CPU `_blocked`.
- d rhs on every platform: `_weight_grad`, a scan over the same blocks adding
  lhs_block^T @ dout_block into its group's [D, F] (float32), never a product over all groups.
The platform is the mesh's in context (`context_parallel.current_platform`): compiling for a
TPU topology on this CPU host counts as TPU.

Blocks: each group's rows cut into blocks of `b` rows, `ceil(M / b) + E` blocks in all (a
static bound: a group of s rows takes ceil(s / b) <= s / b + 1 of them); the ones past the
groups are empty. A block is one [b, D] x [D, F] dot against its group's weight over b
consecutive rows (from its first row, or the last b rows of all when that runs past them: no
padded copy of the operands); its rows outside its group (other groups', or past the groups)
are computed but never written (forward) or masked to 0 (weight gradient). An empty block skips its dot (`lax.cond`), so a
run costs the groups' own blocks; a static count (what the planner's HLO analysis counts)
is the bound, at most (M + (E + 1) * b) rows' worth of FLOPs.

`block_rows(M, E)`: b = the largest power of two not above a quarter of the mean group size
M / E, within [8, 1024]. A group wastes less than b rows on its last block, so the padding
stays under M / 4 (an eighth on average) while the blocks stay few (M / b + E < 9E where b
is not at a limit); at the mean group size itself, a group a little over the mean would take
a second, nearly empty block (up to twice the rows' FLOPs). Not below 8: a block of 8 rows
reads its group's weight once as a block of 1 would (decode's few rows are weight-read
bound), and 8 float32 rows fill whole vector registers on XLA:CPU. Not above 1024: the
weight gradient reads and writes its group's [D, F] float32 sum per block (8 D F bytes for
2 b D F FLOPs, b / 4 FLOPs a byte), compute-bound on a v5p (about 460 TFLOP/s over 2.8 TB/s,
166 FLOPs a byte) from b of about 700; training's groups (tens of thousands of rows) then pad
E x 1024 rows at most. A power of two keeps the count of distinct programs small. A row's
result is one row of a [b, D] x [D, F] dot, whatever the other rows of its block: the same
bits whatever other rows share the call (tests/models/test_grouped_matmul.py checks it).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from muajax.models.context_parallel import current_platform

MIN_BLOCK = 8
MAX_BLOCK = 1024
NATIVE = ("tpu", "gpu", "cuda", "rocm")  # platforms whose XLA compiles ragged_dot to a grouped kernel
_TRANSPOSED_RHS = jax.lax.RaggedDotDimensionNumbers(  # lhs [M, F] x rhs [E, D, F] -> [M, D]
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def block_rows(rows: int, groups: int) -> int:
    """The block size b for `rows` rows in `groups` groups (see the module's docstring)."""
    quarter = max(rows // (4 * max(groups, 1)), 1)
    return int(min(max(1 << (quarter.bit_length() - 1), MIN_BLOCK), MAX_BLOCK))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int | None = None,
                   platform: str | None = None) -> jax.Array:
    """lhs [M, D] (rows sorted by group), rhs [E, D, F], group_sizes [E] -> [M, F], in the
    dtype `ragged_dot` gives. `block`: the rows per block (default `block_rows`); `platform`:
    where it compiles (default the mesh's in context, else the default backend)."""
    b = block or block_rows(lhs.shape[0], rhs.shape[0])
    native = (platform or current_platform()) in NATIVE
    return _grouped(native, b, lhs, rhs, group_sizes.astype(jnp.int32))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(native, b, lhs, rhs, group_sizes):
    return _forward(native, b, lhs, rhs, group_sizes)


def _grouped_fwd(native, b, lhs, rhs, group_sizes):
    return _forward(native, b, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _grouped_bwd(native, b, res, dout):
    lhs, rhs, group_sizes = res
    if native:
        d_lhs = jax.lax.ragged_dot_general(dout, rhs.astype(dout.dtype), group_sizes, _TRANSPOSED_RHS)
    else:
        d_lhs = _blocked(dout, rhs, group_sizes, b, transposed=True)
    d_rhs = _weight_grad(lhs, dout, group_sizes, b, rhs.shape[0])
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _forward(native, b, lhs, rhs, group_sizes):
    if native:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return _blocked(lhs, rhs, group_sizes, b)


def blocks(group_sizes: jax.Array, rows: int, b: int):
    """The blocks of `rows` rows in groups of `group_sizes` [E], `ceil(rows / b) + E` of them,
    as (group [n], first row [n], real rows [n]) int32: a group's blocks in order, the groups
    in order, then empty blocks (0 rows) at the last group's end."""
    sizes = group_sizes.astype(jnp.int32)
    num = sizes.shape[0]
    count = -(-rows // b) + num
    starts = jnp.cumsum(sizes) - sizes
    per_group = (sizes + b - 1) // b
    block_end = jnp.cumsum(per_group)
    i = jnp.arange(count, dtype=jnp.int32)
    group = jnp.minimum(jnp.sum(block_end[None, :] <= i[:, None], axis=1, dtype=jnp.int32), num - 1)
    within = i - (jnp.take(block_end, group) - jnp.take(per_group, group))
    first = jnp.take(starts, group) + within * b
    real = jnp.clip(jnp.take(sizes, group) - within * b, 0, b)
    return group, jnp.clip(first, 0, rows), real


def _at_least(x: jax.Array, b: int) -> jax.Array:
    """x, with rows of zeros after it up to b rows when it has fewer (a block fits)."""
    short = b - x.shape[0]
    return x if short <= 0 else jnp.concatenate([x, jnp.zeros((short, *x.shape[1:]), x.dtype)])


def _window(first, real, rows: int, b: int):
    """(where a block's b rows are read and written, [b, 1] which of them are its real rows):
    the block's first row, moved back so that the window ends by the last row (no copy of the
    operands with padding rows: at training's sizes that is gigabytes a matmul)."""
    at = jnp.clip(first, 0, max(rows - b, 0))
    i = jnp.arange(b, dtype=jnp.int32)[:, None] - (first - at)
    return at, (i >= 0) & (i < real)


def _blocked(lhs, rhs, group_sizes, b: int, transposed: bool = False):
    """The forward on CPU: each block's [b, D] x [D, F] dot (rhs[g] transposed: [b, F] x
    [F, D]) written back to its own real rows of a zero output."""
    rows = lhs.shape[0]
    dtype = jnp.result_type(lhs, rhs)
    width = rhs.shape[1] if transposed else rhs.shape[2]
    spec = "bf,df->bd" if transposed else "bd,df->bf"
    source = _at_least(lhs.astype(dtype), b)
    weights = rhs.astype(dtype)

    def product(at, group):
        x = jax.lax.dynamic_slice_in_dim(source, at, b)
        w = jax.lax.dynamic_index_in_dim(weights, group, keepdims=False)
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(dtype)

    def step(out, block):
        group, first, real = block
        at, keep = _window(first, real, source.shape[0], b)
        y = jax.lax.cond(real > 0, product, lambda *_: jnp.zeros((b, width), dtype), at, group)
        old = jax.lax.dynamic_slice_in_dim(out, at, b)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), at, 0), None

    out, _ = jax.lax.scan(step, jnp.zeros((source.shape[0], width), dtype), blocks(group_sizes, rows, b))
    return out[:rows]


def _weight_grad(lhs, dout, group_sizes, b: int, num_groups: int):
    """d rhs [E, D, F] float32: for each block, its real rows' lhs^T @ dout added into its
    group's [D, F]; groups without rows stay 0."""
    rows, d = lhs.shape
    f = dout.shape[1]
    dtype = jnp.result_type(lhs, dout)
    x_all, dy_all = _at_least(lhs.astype(dtype), b), _at_least(dout.astype(dtype), b)

    def product(at, keep):
        x = jax.lax.dynamic_slice_in_dim(x_all, at, b)
        dy = jax.lax.dynamic_slice_in_dim(dy_all, at, b)
        x = jnp.where(keep, x, jnp.zeros((), dtype))  # the rows of other groups, padding
        return jnp.einsum("bd,bf->df", x, dy, preferred_element_type=jnp.float32)

    def step(acc, block):
        group, first, real = block
        at, keep = _window(first, real, x_all.shape[0], b)
        part = jax.lax.cond(real > 0, product, lambda *_: jnp.zeros((d, f), jnp.float32), at, keep)
        mine = jax.lax.dynamic_index_in_dim(acc, group, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(acc, mine + part, group, 0), None

    acc, _ = jax.lax.scan(step, jnp.zeros((num_groups, d, f), jnp.float32), blocks(group_sizes, rows, b))
    return acc
