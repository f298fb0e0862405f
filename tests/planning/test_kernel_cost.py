"""The Pallas kernels' FLOPs and bytes in a compiled program: splash attention's forward,
dq and dkv kernels compiled by the TPU compiler against a hand count, a kernel inside a
scan counted every run, a kernel nobody knows listed as uncounted, and the ragged paged
attention formula at real lengths."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from muajax.planning import hlo_cost, kernel_cost
from muajax.planning.compile import AbstractProgram, compile_program
from muajax.planning.topology import libtpu_available, parse_topology, tpu_devices

NEEDS_LIBTPU = pytest.mark.skipif(not libtpu_available(), reason='libtpu (the TPU compiler) is not installed: '
                                  'pip install -e ".[tpu]" to run the TPU planning tests')
B, N, K, T, H = 2, 4, 2, 1024, 128  # rows, query heads, kv heads, positions, head_dim
# different blocks per kernel, so that each kernel's own sizes must be read from its metadata
SIZES = dict(block_q=256, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=256,
             block_kv_dkv_compute=256, block_q_dq=512, block_kv_dq=256)


def matmul(m, n, h=H):
    return 2 * m * n * h


# Causal blocks by hand, T = 1024: q block i (of bq rows) sees every kv block holding a key at
# or before its last row, (bq * (i + 1) - 1) // bkv + 1 of them.
FWD_PAIRS = 2 + 4 + 6 + 8                  # bq 256, bkv 128
DKV_PAIRS = sum(i // 2 + 1 for i in range(8))  # bq 128, bkv 256: 1, 1, 2, 2, 3, 3, 4, 4
DQ_PAIRS = 2 + 4                           # bq 512, bkv 256
HAND = {"splash_mha_fwd_residuals": B * N * FWD_PAIRS * 2 * matmul(256, 128),
        "splash_mha_dq_no_residuals": B * N * DQ_PAIRS * 3 * matmul(512, 256),
        "splash_mha_dkv_no_residuals": B * N * DKV_PAIRS * 4 * matmul(128, 256)}


@pytest.fixture(scope="module")
def one_device():
    return Mesh(tpu_devices(parse_topology("v5p:2x2x1"))[:1], ("x",))


def _kernel():
    mask = splash.MultiHeadMask([splash.CausalMask((T, T))] * N)
    return splash.make_splash_mha(mask, block_sizes=splash.BlockSizes(**SIZES), head_shards=1, q_seq_shards=1)


def _args(mesh, rows=B):
    s = NamedSharding(mesh, PartitionSpec())
    return (jax.ShapeDtypeStruct((rows, N, T, H), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((rows, K, T, H), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((rows, K, T, H), jnp.bfloat16, sharding=s))


def test_causal_block_pairs_by_hand():
    assert kernel_cost.causal_block_pairs(T, T, 256, 128) == FWD_PAIRS
    assert kernel_cost.causal_block_pairs(T, T, 128, 256) == DKV_PAIRS
    assert kernel_cost.causal_block_pairs(512, 512, 512, 512) == 1  # one block: computed whole
    # a row split into 2 query shards of 512 over the 1024 keys (context parallelism): the
    # first shard sees 1 + 2 blocks of 256, the second 3 + 4, on average half the whole row's
    assert kernel_cost.splash_pairs(512, T, 256, 256) == (3 + 7) / 2
    assert kernel_cost.splash_attention_flops(T, heads=N, head_dim=H, block=256, batch=B, forwards=2) == \
        B * N * 10 * (2 * 2 + 3 + 4) * matmul(256, 256)


@NEEDS_LIBTPU
def test_splash_forward_and_backward_against_a_hand_count(one_device):
    kernel = _kernel()
    loss = lambda q, k, v: jax.vmap(kernel)(q, k, v).astype(jnp.float32).sum()
    program = AbstractProgram("splash", lambda: jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*_args(one_device)))
    cost = compile_program(program, platform="tpu")
    assert {k["name"]: k["flops"] for k in cost.kernels} == HAND
    assert all(k["calls"] == 1 for k in cost.kernels) and cost.uncounted == {}
    assert cost.kernel_flops == sum(HAND.values())
    assert cost.flops >= cost.xla_flops + sum(HAND.values())  # the kernels are in the program's FLOPs
    # bytes: at least every q, k, v, output read or written once, k and v again per forward pair
    qkv = (B * N + 2 * B * K) * T * H * 2
    fwd = next(k for k in cost.kernels if k["name"] == "splash_mha_fwd_residuals")
    assert fwd["bytes"] >= qkv + B * N * FWD_PAIRS * 2 * 128 * H * 2
    assert cost.bytes_accessed >= cost.xla_bytes + cost.kernel_bytes - 1


@NEEDS_LIBTPU
def test_a_kernel_inside_a_scan_counts_every_run(one_device):
    kernel = _kernel()

    def layers(q, k, v):
        step = lambda h, _: (jax.vmap(kernel)(h, k, v), None)
        return jax.lax.scan(step, q, None, length=5)[0]

    program = AbstractProgram("scan", lambda: jax.jit(layers).lower(*_args(one_device)))
    cost = compile_program(program, platform="tpu")
    assert [loop["trips"] for loop in cost.loops] == [5]
    (fwd,) = cost.kernels
    assert fwd["name"] == "splash_mha_fwd_no_residuals" and fwd["calls"] == 5
    assert fwd["flops"] == 5 * HAND["splash_mha_fwd_residuals"]


@NEEDS_LIBTPU
def test_an_unknown_kernel_is_listed_as_uncounted(one_device):
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    f = lambda x: pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="add_one_kernel")(x)
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(one_device, PartitionSpec()))
    summary = hlo_cost.analyze(jax.jit(f).lower(x).compile().as_text())
    assert summary.kernels == [] and summary.uncounted == {"add_one_kernel": 1.0}


def test_ragged_paged_attention_at_real_lengths():
    # 3 sequences packed: 1 query (decode) over 300 keys, 40 queries (a prefill) over 40,
    # 1 query over 1000; 32 queries a block, kv blocks of 256 keys. Query blocks [0, 32)
    # hold sequences 0 and 1, [32, 64) sequences 1 and 2: each (block, sequence) pair runs
    # all of that sequence's kv blocks, the whole query block each time.
    per_block = 4 * 32 * 8 * 256 * 128  # 2 matmuls of (32 queries x 8 heads) x 256 keys x 128
    pairs = 2 + 1 + 1 + 4  # seq 0: 2 kv blocks; seq 1: 1 kv block in each of 2 query blocks; seq 2: 4
    got = kernel_cost.ragged_paged_flops([1, 40, 1], [300, 40, 1000], heads=8, head_dim=128, queries_per_block=32,
                                         kv_block=256)
    assert got == pairs * per_block
    bound, kv_blocks = kernel_cost.ragged_paged_bound(tokens=64, seqs=3, pages_per_seq=64, page_size=16, heads=8,
                                                      head_dim=128, queries_per_block=32, pages_per_block=16)
    assert kv_blocks == (2 + 3 - 1) * 4 and bound == kv_blocks * per_block and bound >= got


@NEEDS_LIBTPU
def test_a_ragged_dot_in_a_scan_counts_its_own_groups_every_run(one_device):
    # the mixture of experts' grouped matmul: XLA:TPU's ragged-dot kernel, FLOPs of each row's
    # own group (not all 16), which XLA's cost analysis counts once; the scan runs it 3 times
    rows, d, f, groups, layers = 256, 128, 256, 16, 3

    def experts(x, w, sizes):
        step = lambda h, wl: (jax.lax.ragged_dot(h, wl, sizes)[:, :d], None)
        return jax.lax.scan(step, x, w)[0]

    s = NamedSharding(one_device, PartitionSpec())
    args = (jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((layers, groups, d, f), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=s))
    cost = compile_program(AbstractProgram("moe", lambda: jax.jit(experts).lower(*args)), platform="tpu")
    one = 2 * rows * d * f
    assert cost.xla_flops == one  # one run, by its cost_estimate
    (kernel,) = cost.kernels      # the metadata call is bookkeeping
    assert kernel["name"] == "ragged-dot-none" and kernel["calls"] == layers and kernel["flops"] == layers * one
    assert cost.flops == layers * one and cost.uncounted == {}
    # its bytes: every group's weights read, each run
    assert kernel["bytes"] >= layers * groups * d * f * 2
    assert cost.bytes_accessed >= kernel["bytes"]
