"""The grouped matmul (muajax.models.grouped_matmul): `jax.lax.ragged_dot`'s values and
gradients (empty groups, rows past the groups, one group holding every row), each row's bits
whatever other rows share the call, and compiled FLOPs near the rows' own products, not
E times them: forward and backward on XLA:CPU, the backward compiled for a TPU topology."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from muajax.models.grouped_matmul import block_rows, blocks, grouped_matmul
from muajax.planning.compile import AbstractProgram, compile_program
from muajax.planning.topology import libtpu_available, parse_topology, tpu_devices

NEEDS_LIBTPU = pytest.mark.skipif(not libtpu_available(), reason='libtpu (the TPU compiler) is not installed: '
                                  'pip install -e ".[tpu]" to run the TPU planning tests')
M, D, F, E = 37, 16, 24, 6
SIZES = {"some empty": [5, 0, 12, 9, 0, 11], "rows past the groups": [3, 7, 0, 10, 2, 4],
         "one group holds all": [0, 0, M, 0, 0, 0], "no rows": [0] * E}


def _operands(dtype=jnp.float32, m=M, d=D, f=F, e=E, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (m, d), dtype), jax.random.normal(ks[1], (e, d, f), dtype),
            jax.random.normal(ks[2], (m, f), dtype))


def _value_and_grads(fn, lhs, rhs, sizes, dout):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return (out, *vjp(dout))


@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # blocked forward / native ragged_dot forward
@pytest.mark.parametrize("block", [None, 8, 16, 64])  # 64: more than the 37 rows
@pytest.mark.parametrize("case", list(SIZES))
def test_values_and_gradients_are_ragged_dot_s(case, block, platform):
    lhs, rhs, dout = _operands()
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    mine = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, block=block, platform=platform))
    got = _value_and_grads(mine, lhs, rhs, sizes, dout)
    want = _value_and_grads(jax.jit(jax.lax.ragged_dot), lhs, rhs, sizes, dout)
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)
    used = int(sum(SIZES[case]))
    assert not np.asarray(got[0])[used:].any() and not np.asarray(got[1])[used:].any()  # rows past: 0


def test_bfloat16_keeps_ragged_dot_s_dtypes_and_values():
    lhs, rhs, dout = _operands(jnp.bfloat16)
    sizes = jnp.asarray(SIZES["some empty"], jnp.int32)
    got = _value_and_grads(jax.jit(grouped_matmul), lhs, rhs, sizes, dout)
    want = _value_and_grads(jax.jit(jax.lax.ragged_dot), lhs, rhs, sizes, dout)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=3e-2, atol=0.25)


def test_blocks_cover_each_group_s_rows_once():
    sizes = np.array([5, 0, 12, 9, 0, 11])
    group, first, real = (np.asarray(a) for a in blocks(jnp.asarray(sizes), M, 4))
    assert len(group) == -(-M // 4) + len(sizes)
    starts = np.cumsum(sizes) - sizes
    covered = [(g, r) for g, f, n in zip(group, first, real) for r in range(f, f + n)]
    assert covered == [(g, r) for g in range(len(sizes)) for r in range(starts[g], starts[g] + sizes[g])]
    assert block_rows(8, 128) == 8 and block_rows(2048, 16) == 32 and block_rows(1 << 20, 32) == 1024
    assert block_rows(1000, 4) == 32  # the largest power of two <= a quarter of the mean group size 250


def test_a_row_s_output_is_bitwise_the_same_whatever_rows_share_the_call():
    e = 8
    sizes = np.array([80, 0, 190, 47, 1, 150, 0, 132])  # 600 rows: blocks of 16
    lhs, rhs, _ = _operands(m=int(sizes.sum()), d=64, f=48, e=e)
    run = jax.jit(grouped_matmul)
    together = np.asarray(run(lhs, rhs, jnp.asarray(sizes)))
    group = np.repeat(np.arange(e), sizes)
    one_hot = np.eye(e, dtype=np.int32)
    for r in [*range(0, len(group), 7), 317]:  # a row alone (blocks of 8); 317: group 4's one row
        alone = np.asarray(run(lhs[r:r + 1], rhs, jnp.asarray(one_hot[group[r]])))
        assert np.array_equal(alone[0], together[r]), r
    # one group's rows alone (blocks of 8), and every row twice over (1200 rows: blocks of 32)
    start = sizes[:2].sum()
    own = np.asarray(run(lhs[start:start + 190], rhs, jnp.asarray(one_hot[2] * 190)))
    assert np.array_equal(own, together[start:start + 190])
    twice = np.asarray(run(jnp.repeat(lhs, 2, axis=0), rhs, jnp.asarray(2 * sizes)))
    assert np.array_equal(twice[::2], together) and np.array_equal(twice[1::2], together)
    assert (block_rows(1, e), block_rows(190, e), block_rows(600, e), block_rows(1200, e)) == (8, 8, 16, 32)


def _flops(lower, platform, mesh=None) -> tuple[float, float]:
    """(every loop iteration counted, XLA's cost_analysis) FLOPs of one compiled program. XLA's
    own count sees one iteration of a loop (the blocks' scan), so the bounds are on the first
    (the planner's count: `muajax.planning.hlo_cost`, each scan times its trip count)."""
    def lowered():
        if mesh is None:
            return lower()
        with jax.set_mesh(mesh):
            return lower()
    cost = compile_program(AbstractProgram("grouped", lowered), platform=platform)
    return cost.flops, cost.xla_flops


def _programs(fn, args):
    loss = lambda a, b, s, c: jnp.sum(fn(a, b, s) * c)
    return {"forward": lambda: jax.jit(fn).lower(*args[:3]),
            "d rhs": lambda: jax.jit(jax.grad(loss, argnums=1)).lower(*args),
            "d lhs, d rhs": lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args)}


def test_cpu_flops_are_the_rows_own_products_not_every_expert_s():
    m, d, f, e = 2048, 64, 128, 16
    b = block_rows(m, e)
    args = (jax.ShapeDtypeStruct((m, d), jnp.float32), jax.ShapeDtypeStruct((e, d, f), jnp.float32),
            jax.ShapeDtypeStruct((e,), jnp.int32), jax.ShapeDtypeStruct((m, f), jnp.float32))
    active = 2 * m * d * f  # one product of every row with its own group's weight
    bound = (-(-m // b) + e) * b * 2 * d * f  # every block counted, the empty ones too
    products = {"forward": 1, "d rhs": 1, "d lhs, d rhs": 2}
    mine, dense = _programs(grouped_matmul, args), _programs(jax.lax.ragged_dot, args)
    for name, n in products.items():
        flops, xla = _flops(mine[name], "cpu")
        assert n * active <= flops <= n * bound * 1.05 and n * bound <= 1.3 * n * active, (name, flops, xla)
        dense_flops, _ = _flops(dense[name], "cpu")
        assert dense_flops >= 0.9 * e * n * active, (name, dense_flops)  # ragged_dot on XLA:CPU: every expert


@NEEDS_LIBTPU
def test_tpu_backward_flops_are_the_rows_own_products_not_every_expert_s():
    mesh = Mesh(np.array(tpu_devices(parse_topology("v5p:2x2x1"))), ("x",))
    m, d, f, e = 4096, 256, 512, 16
    b = block_rows(m, e)
    s = NamedSharding(mesh, PartitionSpec())
    args = (jax.ShapeDtypeStruct((m, d), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((e,), jnp.int32, sharding=s), jax.ShapeDtypeStruct((m, f), jnp.bfloat16, sharding=s))
    active = 2 * m * d * f
    bound = (-(-m // b) + e) * b * 2 * d * f
    mine, dense = _programs(grouped_matmul, args), _programs(jax.lax.ragged_dot, args)
    flops, _ = _flops(mine["d rhs"], "tpu", mesh)
    assert active <= flops <= 1.05 * bound and bound <= 1.3 * active, flops
    # d lhs as XLA:TPU's ragged-dot kernel (its estimate: every row's own group), d rhs blocked
    flops, _ = _flops(mine["d lhs, d rhs"], "tpu", mesh)
    assert 2 * active <= flops <= 1.05 * (active + bound), flops
    dense_flops, _ = _flops(dense["d rhs"], "tpu", mesh)
    assert dense_flops >= 0.9 * e * active, dense_flops  # jax's transpose: a convolution over every expert
