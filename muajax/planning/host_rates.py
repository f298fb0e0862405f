"""This host's rates for a step-time model, by microbenchmarks (nothing fitted to a run).
Each is the best of its repeats (what the host does undisturbed) or, with
statistic="typical", their median (what it does under the load it has: on a shared box,
the rates a run beside the same other jobs gets):

- peak FLOP/s: the best float32 [2048, 2048] matmul, as `muajax.train.step_metrics.measure_matmul_peak`
  measures it for the trainer's MFU on a CPU, shared out over the host's devices;
- memory bandwidth: the best of a few copies of a 256 MiB array (read and write counted),
  far larger than the caches (STREAM's copy);
- fresh-buffer writes: XLA:CPU allocates a program's temporaries at every call, and a new
  buffer's first write faults its pages in: the same elementwise op into a new output and
  into its donated input, the difference per byte;
- dispatch: the host time of one small jitted call on the device as the engine makes them:
  its row arrays put on the device, the call, its outputs fetched (median of many).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from muajax.planning.step_time import Rates

COPY_BYTES = 256 * 2**20
PEAK_MATMUL_SIZE = 2048  # as muajax.train.step_metrics: big enough to reach a CPU's peak
DISPATCH_ARRAYS = 9  # an engine decode call's per-row arrays (batching.decode_rows)
STATISTICS = {"best": min, "typical": lambda times: float(np.median(times))}


def _timed(fn, repeat: int, statistic: str) -> float:
    """Seconds of `fn()` over `repeat` runs: their least, or their median."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return STATISTICS[statistic](times)


def matmul_peak(device=None, size: int = PEAK_MATMUL_SIZE, repeat: int = 5, statistic: str = "best") -> float:
    """FLOP/s of a float32 [size, size] @ [size, size] matmul over `repeat` runs, the compile
    not counted: the measurement `muajax.train.step_metrics.measure_matmul_peak` makes for
    the trainer's MFU on a CPU (the planner stands below the trainer, so it is made here the
    same way)."""
    device = device or jax.devices()[0]
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.device_put(jax.random.normal(k, (size, size), jnp.float32), device) for k in keys)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    return 2.0 * size**3 / _timed(lambda: jax.block_until_ready(matmul(a, b)), repeat, statistic)


def memory_bandwidth(nbytes: int = COPY_BYTES, repeat: int = 7, statistic: str = "best") -> float:
    """Bytes per second of a copy of `nbytes` (read + written)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2.0 * nbytes / _timed(lambda: np.copyto(dst, src), repeat, statistic)


def fresh_write_rate(nbytes: int = COPY_BYTES, repeat: int = 5, device=None, statistic: str = "best") -> float:
    """Bytes per second at which XLA:CPU first writes a freshly allocated buffer: the same
    elementwise op over `nbytes` into a new output and into its donated input, the
    difference per output byte (the new buffer's page faults)."""
    device = device or jax.devices()[0]
    op = lambda x: x * 1.0001 + 1.0  # noqa: E731
    fresh, donated = jax.jit(op), jax.jit(op, donate_argnums=0)
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    held = [donated(jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device))]
    jax.block_until_ready((fresh(x), held[0]))

    def in_place():
        held[0] = jax.block_until_ready(donated(held[0]))

    new = _timed(lambda: jax.block_until_ready(fresh(x)), repeat, statistic)
    return nbytes / max(new - _timed(in_place, repeat, statistic), 1e-9)


def dispatch_seconds(device=None, rows: int = 32, repeat: int = 200) -> float:
    """Median host seconds of one tiny jitted call with the engine's per-call traffic."""
    device = device or jax.devices()[0]
    step = jax.jit(lambda *xs: tuple(x + 1 for x in xs))
    host = [np.arange(rows, dtype=np.int32) for _ in range(DISPATCH_ARRAYS)]

    def call():
        out = step(*jax.device_put(host, device))
        return [np.asarray(x) for x in jax.device_get(out)]

    call()  # compile
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_host_rates(devices: int = 1, device=None, statistic: str = "best") -> Rates:
    """This CPU's rates, per device when the host is split into `devices` XLA:CPU devices
    (they share its cores and memory). XLA:CPU runs a program's operations one after
    another, so a call's time is the sum of its compute and memory terms (overlap off)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic {statistic!r}: one of {', '.join(STATISTICS)}")
    device = device or jax.devices()[0]
    peak = matmul_peak(device, statistic=statistic) / devices
    bandwidth = memory_bandwidth(statistic=statistic) / devices
    dispatch = dispatch_seconds(device)
    fresh = fresh_write_rate(device=device, statistic=statistic) / devices
    word = "" if statistic == "best" else f" ({statistic}: medians)"
    return Rates("host cpu", peak, bandwidth, None, dispatch, overlap=False, fresh_bytes_per_s=fresh,
                 source=f"measured here{word}: float32 matmul peak {peak / 1e9:.1f} GFLOP/s, copy bandwidth "
                        f"{bandwidth / 1e9:.1f} GB/s, fresh-buffer writes {fresh / 1e9:.1f} GB/s, dispatch "
                        f"{dispatch * 1e3:.2f} ms per call")


def main(argv: list[str] | None = None) -> int:
    """`python -m muajax.planning.host_rates [--statistic typical] [--devices N] [--out FILE]`:
    this host's rates as JSON (e.g. measured just before and after a run, for calibrate's `rates`)."""
    import argparse
    import dataclasses
    import json

    p = argparse.ArgumentParser(prog="python -m muajax.planning.host_rates", description=main.__doc__.split("\n")[0])
    p.add_argument("--statistic", choices=tuple(STATISTICS), default="best")
    p.add_argument("--devices", type=int, default=1, help="XLA:CPU devices the host is split into")
    p.add_argument("--out", default=None, help="write the rates here as JSON (Rates(**json.load(...)) reads them)")
    args = p.parse_args(argv)
    rates = dataclasses.asdict(measure_host_rates(args.devices, statistic=args.statistic))
    print(rates["source"])
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(rates, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
