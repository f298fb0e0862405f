"""XLA:CPU programs' loops counted: the trip counts XLA states itself (its loop conditions
are fusions there), and a buffer updated in place in a loop counted as its updates."""
import jax
import jax.numpy as jnp
import pytest

from muajax.planning import hlo_cost


def _text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("layers", [3, 7])
def test_a_scan_s_trip_count_on_xla_cpu(layers):
    def f(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    w = jax.ShapeDtypeStruct((layers, 64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    summary = hlo_cost.analyze(_text(f, w, x))
    assert [loop.trips for loop in summary.loops] == [layers]
    assert summary.matmul_flops == layers * 2 * 32 * 64 * 64


@pytest.mark.parametrize("update", ["slice", "scatter"])
def test_a_buffer_updated_in_place_in_a_loop_counts_its_updates_not_itself(update):
    rows = 64

    def f(buf, row):
        def body(i, b):
            if update == "slice":
                return jax.lax.dynamic_update_slice(b, row[None] * i, (i, 0))
            return b.at[jnp.array([i])].set(row[None] * i)
        return jax.lax.fori_loop(0, rows, body, buf)

    buf = jax.ShapeDtypeStruct((rows, 4096), jnp.float32)  # 1 MiB, updated a 16 KiB row at a time
    row = jax.ShapeDtypeStruct((4096,), jnp.float32)
    summary = hlo_cost.analyze(_text(f, buf, row))
    assert [loop.trips for loop in summary.loops] == [rows]
    whole = rows * 4096 * 4
    # beyond XLA's own pass over the body: 63 more iterations of row-sized traffic, not 63 MiB
    assert summary.extra_bytes < 0.5 * (rows - 1) * whole / 4
