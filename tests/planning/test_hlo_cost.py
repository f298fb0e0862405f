"""FLOPs and collective bytes with every loop iteration counted: the hand-written module of
test_hlo.py, and a layer scan compiled by the TPU compiler."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from muajax.planning import hlo_cost
from muajax.planning.topology import libtpu_available, parse_topology, tpu_devices

NEEDS_LIBTPU = pytest.mark.skipif(not libtpu_available(), reason='libtpu (the TPU compiler) is not installed: '
                                  'pip install -e ".[tpu]" to run the TPU planning tests')
from tests.planning.test_hlo import MODULE

F32_8x16 = 8 * 16 * 4


def test_hand_written_module():
    summary = hlo_cost.analyze(MODULE)
    trips = {loop.computation + "/" + str(loop.trips) for loop in summary.loops}
    assert trips == {"main/5", "main/4", "main/None"}
    assert [loop.computation for loop in summary.unknown_loops] == ["main"]
    # the body runs 5 times in the first loop and once (unknown trips count once) in the third
    assert summary.collective_bytes["all-gather"] == 6 * 32 * 16 * 4
    assert summary.collective_bytes["collective-permute"] == 4 * F32_8x16
    assert summary.collective_bytes["all-reduce"] == F32_8x16          # the -start op; -done is not counted again
    assert summary.collective_bytes["reduce-scatter"] == F32_8x16      # the scattered input, not the [2,16] result
    assert summary.collective_bytes["all-to-all"] == 0
    dot = 2 * 8 * 16 * 16
    assert summary.matmul_flops == 6 * dot
    assert summary.extra_flops == 5 * dot  # beyond the one pass over each body that XLA counts
    assert hlo_cost.analyze(MODULE, unknown_trips=3).collective_bytes["all-gather"] == 8 * 32 * 16 * 4


@pytest.fixture(scope="module")
def mesh():
    devices = tpu_devices(parse_topology("v5p:2x2x1"))
    return jax.make_mesh((4,), ("x",), devices=devices, axis_types=(AxisType.Auto,))


@NEEDS_LIBTPU
@pytest.mark.parametrize("layers", [2, 6])
def test_compiled_layer_scan(mesh, layers):
    """h <- tanh(h @ w[i]) over layers, weights split over 4 TPUs: each layer gathers its
    weight and multiplies; XLA's cost analysis counts the loop body once."""
    def f(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    w = jax.ShapeDtypeStruct((layers, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(None, "x")))
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("x")))
    compiled = jax.jit(f, out_shardings=x.sharding).lower(w, x).compile()
    summary = hlo_cost.analyze(compiled.as_text())
    assert [loop.trips for loop in summary.loops] == [layers]
    assert summary.collective_bytes["all-gather"] == layers * 512 * 512 * 2
    per_layer = 2 * (256 // 4) * 512 * 512  # each device multiplies its 64 rows by the whole weight
    assert summary.matmul_flops == layers * per_layer
    xla = compiled.cost_analysis()["flops"]
    assert xla < 2 * per_layer  # one body
    assert xla + summary.extra_flops == pytest.approx(layers * per_layer, rel=0.01)


NESTED = """HloModule nested, entry_computation_layout={(bf16[36,64,32]{2,1,0}, s32[], bf16[8,64]{1,0})->bf16[8,32]{1,0}}

%slice_layer (p0: bf16[36,64,32], p1: s32[]) -> bf16[64,32] {
  %p0 = bf16[36,64,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,32]{2,1,0} dynamic-slice(bf16[36,64,32]{2,1,0} %p0, s32[] %p1, s32[] %zero, s32[] %zero), dynamic_slice_sizes={1,64,32}
  ROOT %b = bf16[64,32]{1,0} bitcast(bf16[1,64,32]{2,1,0} %ds)
}

%matmul (q0: bf16[36,64,32], q1: s32[], q2: bf16[8,64]) -> bf16[8,32] {
  %q0 = bf16[36,64,32]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = bf16[8,64]{1,0} parameter(2)
  %w = bf16[64,32]{1,0} fusion(bf16[36,64,32]{2,1,0} %q0, s32[] %q1), kind=kLoop, calls=%slice_layer
  ROOT %d = bf16[8,32]{1,0} dot(bf16[8,64]{1,0} %q2, bf16[64,32]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[36,64,32], i: s32[], x: bf16[8,64]) -> bf16[8,32] {
  %a = bf16[36,64,32]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[8,64]{1,0} parameter(2)
  ROOT %f = bf16[8,32]{1,0} fusion(bf16[36,64,32]{2,1,0} %a, s32[] %i, bf16[8,64]{1,0} %x), kind=kOutput, calls=%matmul
}
"""


def test_stacked_weights_sliced_one_fusion_further_in_are_read_as_the_slice():
    # the layer scan's [layers, ...] weights reach the matmul's fusion whole and a nested
    # fusion slices one layer: the fusion reads that layer (64 x 32 bf16), not all 36
    module = hlo_cost.parse_module(NESTED)
    entry = module.computations[module.entry]
    shapes = {i.name: i.shape for i in entry.instructions.values()}
    read, written = hlo_cost._fusion_operand_bytes(module, entry.instructions["f"], shapes)
    assert read == 64 * 32 * 2 + 4 + 8 * 64 * 2 and written == 8 * 32 * 2
