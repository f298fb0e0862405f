"""What the trainer measures around its updates: model TFLOP/s per device and MFU, the HBM
high-water mark, and a `jax.profiler` trace of chosen steps.

    peak = device_peak_flops(jax.devices())   # the chip's, or this CPU's measured matmul peak (once a run)
    (state, metrics), seconds = call_without_compile(lambda: update(state, batch))
    flops = train_step_flops(model_cfg, rows, length, reference=...)   # muajax.models.flops
    record.update(perf_record(flops, seconds, mesh.size, peak))   # perf/tflops_per_device, perf/mfu, ...

MFU is model FLOPs (useful work: real tokens only, no padding, no remat recompute, causal
attention's lower triangle) per second over the peak: the chip's dense bf16 FLOP/s from `muajax.chips`, or on a CPU the best
rate of a float32 matmul measured on it, as `python -m muajax.bench train` measures it.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from muajax.chips import chip_for_device_kind
from muajax.train.compilation import CompileClock

T = TypeVar("T")
PEAK_MATMUL_SIZE = 2048  # [n, n] @ [n, n] float32: big enough to reach a CPU's peak


def peak_flops(device) -> float | None:
    """The chip's dense bf16 peak FLOP/s, or None when the table does not know the device."""
    chip = chip_for_device_kind(getattr(device, "device_kind", ""))
    return chip.peak_flops if chip else None


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call of `fn`, waiting for the arrays it returns
    (jax dispatches asynchronously)."""
    cpu0, wall0 = process_cpu_seconds(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - wall0, process_cpu_seconds() - cpu0


@dataclasses.dataclass(frozen=True)
class MatmulPeak:
    per_second: float      # FLOP per wall-clock second
    per_cpu_second: float  # FLOP per second of this process's CPU time (all its threads)


def measure_matmul_peak(size: int = PEAK_MATMUL_SIZE, repeat: int = 5, device=None) -> MatmulPeak:
    """The best rate of a float32 [size, size] @ [size, size] matmul on `device` (default:
    the first): the ceiling a CPU's steps are measured against. Best of `repeat`, the first
    call (the compile) not counted: the peak is what the hardware does when undisturbed."""
    device = device or jax.devices()[0]
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.device_put(jax.random.normal(k, (size, size), jnp.float32), device) for k in keys)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    walls, cpus = zip(*(timed(lambda: matmul(a, b)) for _ in range(repeat)))
    flops = 2.0 * size**3
    return MatmulPeak(flops / min(walls), flops / max(min(cpus), 1e-9))


def device_peak_flops(devices: Sequence) -> float | None:
    """Peak FLOP/s of one of `devices` (a run's, all of one kind): the chip table's, or on a
    CPU the measured float32 matmul peak shared out over this process's CPU devices (fake
    devices share the same cores), so that MFU is the host's model FLOP/s over its peak.
    None for an accelerator the table does not know."""
    device = devices[0]
    peak = peak_flops(device)
    if peak is None and device.platform == "cpu":
        local = [d for d in devices if d.process_index == jax.process_index()]
        peak = measure_matmul_peak(device=device).per_second / max(len(local), 1)
    return peak


def step_throughput(model_flops: float, seconds: float, devices: int, peak: float | None) -> dict[str, float]:
    """{"perf/tflops_per_device", "perf/mfu"} of work of `model_flops` done in `seconds` on
    `devices` devices; MFU only when the per-device peak is known."""
    if seconds <= 0 or devices < 1:
        raise ValueError(f"need seconds > 0 and devices >= 1, got {seconds}, {devices}")
    per_device = model_flops / seconds / devices
    out = {"perf/tflops_per_device": per_device / 1e12}
    if peak:
        out["perf/mfu"] = per_device / peak
    return out


def call_without_compile(fn: Callable[[], T]) -> tuple[T, float]:
    """`fn()` (which must wait for its results) and the wall seconds it took less the time
    jax spent compiling during it: what a step's work is timed by."""
    clock = CompileClock()
    start = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - start
    return out, max(0.0, wall - clock.take())


def perf_record(model_flops: float, seconds: float, devices: int, peak: float | None, *,
                padded_flops: float | None = None) -> dict[str, float]:
    """The perf/* metrics of an update of `model_flops` (over all its devices: real tokens
    only) that ran `seconds` without compiling, on `devices` devices of `peak` FLOP/s each.
    `padded_flops`: the same update counted over every position it computed, padding
    included, logged apart as perf/padded_* (with power-of-two length buckets up to 2x the
    real figure: it is not useful work)."""
    out = {"perf/model_flops": model_flops, "perf/update_s": seconds}
    if padded_flops is not None:
        out["perf/padded_model_flops"] = padded_flops
    if seconds > 0:  # a step too short for the clock has no rate
        out.update(step_throughput(model_flops, seconds, devices, peak))
        if padded_flops is not None:
            padded = step_throughput(padded_flops, seconds, devices, peak)
            out.update({k.replace("perf/", "perf/padded_"): v for k, v in padded.items()})
    high_water = hbm_high_water()
    if high_water is not None:
        out["perf/hbm_peak_bytes"] = high_water
    return out


def hbm_high_water(devices=None) -> int | None:
    """The largest `peak_bytes_in_use` (since the process started) over the devices
    (default: this process's), or None where the backend reports no memory statistics
    (XLA:CPU)."""
    peaks = []
    for device in devices if devices is not None else jax.local_devices():
        stats = device.memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class ProfileWindow:
    """Traces steps first..last (inclusive; the 1-based steps of metrics.jsonl) with
    `jax.profiler` into `log_dir`: an .xplane.pb that TensorBoard's profile plugin opens
    (`tensorboard --logdir LOG_DIR`) and a perfetto_trace.json.gz that
    https://ui.perfetto.dev opens."""

    def __init__(self, log_dir: str, steps: Sequence[int] | None):
        self.log_dir = log_dir
        self.steps = None if steps is None else tuple(int(s) for s in steps)
        if self.steps is not None and (len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1]):
            raise ValueError(f"profile steps must be [first, last] with 1 <= first <= last, got {list(steps)}")
        self.active = False

    def step_started(self, step: int) -> None:
        if self.steps is not None and self.steps[0] <= step <= self.steps[1] and not self.active:
            os.makedirs(self.log_dir, exist_ok=True)
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active = True

    def step_finished(self, step: int, outputs: Any = None) -> None:
        """Call with the step's outputs: they are waited for, so the trace holds the whole step."""
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
