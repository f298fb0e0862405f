"""Compile one program ahead of time and read what the compiler says about it.

A program is anything that can be lowered from abstract arguments: `AbstractProgram.lower`
is a thunk returning a `jax.stages.Lowered` (a jitted function's `.lower(*abstract args)`,
or `TrainStep.lower(state, batch, ref)` which sets the activation sharding rules itself).
The args carry their NamedShardings over the topology's mesh; nothing is allocated.

On TPU the compiler refuses a program that does not fit its chip. Two modes:
  default    the compiler gives up as soon as it sees the program cannot fit, and the size
             in its message becomes a lower bound of the temporaries (seconds);
  exact_oom  (`xla_tpu_no_crash_on_oom`) compiles it to the end anyway, so the memory
             analysis says by how much it does not fit — slowly: today's engine decode for
             qwen3-8b on v5p-64 ran 30 minutes on this 2-core machine before a single
             buffer larger than the whole HBM stopped it (that size is then the bound).
"""
from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

from muajax.planning import hlo_cost

MEMORY_FIELDS = ("arguments", "outputs", "aliased", "temporaries", "code")
COLLECTIVE_SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
                    "collective-permute": "CP"}
_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass
class AbstractProgram:
    """A program to compile: its name, a thunk that lowers it, and which of its arguments
    are resident state (bytes per device, e.g. {"train state": ..., "KV cache": ...}) rather
    than per-call inputs, whose bytes per device are `input_bytes`. `unknown_trips`: how
    many times a loop whose trip count the HLO does not fix runs (the decode chunk's
    while_loop: up to its step count)."""

    name: str
    lower: Callable[[], Any]
    resident_args: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_trips: int = 1
    input_bytes: int = 0
    attention: str | None = None  # the attention implementation the program runs


@dataclasses.dataclass
class ProgramCost:
    name: str
    compiler: str                 # "tpu" or "cpu"
    memory: dict[str, int]        # per device: MEMORY_FIELDS, total, peak (when the compiler says)
    resident_args: dict[str, int]
    xla_flops: float = 0.0        # cost_analysis(): loop bodies counted once
    xla_bytes: float = 0.0
    flops: float = 0.0            # loop bodies counted with their trip counts, Pallas kernels included
    bytes_accessed: float = 0.0
    collectives: dict[str, float] = dataclasses.field(default_factory=dict)
    collective_counts: dict[str, float] = dataclasses.field(default_factory=dict)
    loops: list[dict] = dataclasses.field(default_factory=list)
    lower_s: float = 0.0
    compile_s: float = 0.0
    error: str | None = None      # the compiler refused it (out of memory): memory is a lower bound
    input_bytes: int = 0          # the per-call (not resident) arguments, from their shardings
    kernel_flops: float = 0.0     # the Pallas kernels' share of flops (kernel_cost), runs counted
    kernel_bytes: float = 0.0     # and of bytes_accessed
    kernels: list[dict] = dataclasses.field(default_factory=list)   # per kernel: name, calls, flops, bytes
    uncounted: dict[str, float] = dataclasses.field(default_factory=dict)  # custom calls not costed: name -> calls
    attention: str | None = None  # the attention implementation the program runs

    @property
    def fits_compiler(self) -> bool:
        return self.error is None

    @property
    def transient(self) -> dict[str, int]:
        """What the program needs on top of its resident arguments, by part. With the
        resident arguments these add up to memory["total"], or to more when the compiler
        dropped an argument the program never reads (the engine's extend skips the LM head):
        what is resident stays in memory whether read or not, so the resident parts are
        counted whole and the inputs are the larger of what the compiler reports beyond them
        (which includes the layout padding of small arrays) and their own size."""
        m = self.memory
        inputs = max(m.get("arguments", 0) - sum(self.resident_args.values()), self.input_bytes)
        return {"inputs (+ layout padding)": inputs, "temporaries": m.get("temporaries", 0),
                "outputs (not donated)": max(m.get("outputs", 0) - m.get("aliased", 0), 0), "code": m.get("code", 0)}

    def to_json(self) -> dict:
        return {"compiler": self.compiler, "memory": self.memory, "resident_args": self.resident_args,
                "transient": self.transient, "xla_flops": self.xla_flops, "xla_bytes_accessed": self.xla_bytes,
                "flops": self.flops, "bytes_accessed": self.bytes_accessed, "collective_bytes": self.collectives,
                "collective_counts": self.collective_counts, "loops": self.loops, "lower_s": round(self.lower_s, 2),
                "compile_s": round(self.compile_s, 2), "error": self.error, "attention": self.attention,
                "kernel_flops": self.kernel_flops,
                "kernel_bytes": self.kernel_bytes, "kernels": self.kernels, "uncounted": self.uncounted}


def memory_of(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
           "code": m.generated_code_size_in_bytes}
    # Donated inputs are reused for outputs: count them once.
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["code"]
    peak = getattr(m, "peak_memory_in_bytes", 0)
    if peak:
        out["peak"] = int(peak)  # the compiler's own live-range peak (TPU); the total above is what it reserves
    return out


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return cost or {}


def oom_bytes(message: str) -> int | None:
    """The size an out-of-memory compile error names: the temporaries it needed, or the
    one buffer that alone exceeds the HBM."""
    for pattern in (r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)", r"Requires ([\d.]+)([KMGT]?)",
                    r"Allocation \(size=(\d+)()\)"):
        m = re.search(pattern, message)
        if m:
            return int(float(m.group(1)) * _SIZE[m.group(2)])
    return None


def is_oom(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error)


def compile_program(program: AbstractProgram, *, platform: str, exact_oom: bool = False) -> ProgramCost:
    """Lower and compile `program`; its memory, costs (loops counted), collectives and timings."""
    t0 = time.perf_counter()
    lowered = program.lower()
    t1 = time.perf_counter()
    options = {"xla_tpu_no_crash_on_oom": True} if platform == "tpu" and exact_oom else None
    try:
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    except Exception as error:  # the compiler's out-of-memory refusal is a result, not a failure
        if not is_oom(error):
            raise
        needed = oom_bytes(str(error)) or 0
        memory = {"arguments": sum(program.resident_args.values()), "outputs": 0, "aliased": 0,
                  "temporaries": needed, "code": 0}
        memory["total"] = memory["arguments"] + needed
        return ProgramCost(program.name, platform, memory, dict(program.resident_args), lower_s=t1 - t0,
                           compile_s=time.perf_counter() - t1, error=str(error).strip().splitlines()[0][:400],
                           input_bytes=program.input_bytes, attention=program.attention)
    t2 = time.perf_counter()
    cost = _cost(compiled)
    summary = hlo_cost.analyze(compiled.as_text(), program.unknown_trips)
    xla_flops, xla_bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    loops = [{"computation": loop.computation, "trips": loop.trips, "runs": loop.multiplier} for loop in summary.loops]
    return ProgramCost(program.name, platform, memory_of(compiled), dict(program.resident_args), xla_flops, xla_bytes,
                       xla_flops + summary.extra_flops, xla_bytes + summary.extra_bytes, summary.collective_bytes,
                       summary.collective_counts, loops, t1 - t0, t2 - t1, input_bytes=program.input_bytes,
                       kernel_flops=summary.kernel_flops, kernel_bytes=summary.kernel_bytes,
                       kernels=[k.to_json() for k in summary.kernels], uncounted=dict(summary.uncounted),
                       attention=program.attention)
