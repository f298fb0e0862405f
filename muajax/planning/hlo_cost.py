"""FLOPs, HBM bytes and collective bytes of a compiled program, every loop iteration counted.

XLA's `cost_analysis()` visits every computation once, so the body of a while loop (the
layer scan, the microbatch scan, a windowed collective matmul) counts as one iteration:
for a 36-layer model in 8 microbatches it undercounts the step ~288x. `analyze` adds
(multiplier - 1) x what each computation does (`hlo.multipliers`) to XLA's totals.

FLOPs counted here: dot and convolution (what the TPU compiler turns dots into), 2 per
multiply-add, valid window positions only. Bytes: each instruction outside fusions reads
its operands and writes its result; a fusion operand only sliced inside the fusion counts
as the slices, and an in-place dynamic-update-slice as its update. These are close to, not
identical with, XLA's own rules; they only scale the loop bodies' share.

Pallas kernels (custom calls) are opaque to XLA, which counts them as 0 FLOPs and 0 bytes:
`kernel_cost` costs the ones it recognises (splash and ragged paged attention) from their
own formulas, and each is added times its runs (`kernels`); the others are listed by name
as `uncounted`, with how many times they run.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from muajax.planning import kernel_cost
from muajax.planning.hlo import (
    HloModule,
    Instruction,
    Loop,
    array_sizes,
    called,
    dims_of,
    multipliers,
    parse_module,
)

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota", "async-done", "call-done", "copy-done",
               "all-gather-done", "all-reduce-done", "collective-permute-done", "reduce-scatter-done",
               "opt-barrier", "add-dependency"}
_SLICES = {"dynamic-slice", "slice", "gather"}


def _braced_ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _window_field(window: str, key: str, count: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([\dx_]+)", window)
    if not m:
        return [default] * count
    return [int(x) for x in m.group(1).split("x")]


def _valid_pairs(out: int, kernel: int, size: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output index, kernel index) pairs of one spatial dim that land on a real input element."""
    o = np.arange(out, dtype=np.int64)
    base = o * stride - pad_lo  # input position (in the dilated input) of kernel index 0
    last = (size - 1) * lhs_dil
    lo = np.maximum(np.ceil(-base / rhs_dil), 0)
    hi = np.minimum(np.floor((last - base) / rhs_dil), kernel - 1)
    count = np.maximum(hi - lo + 1, 0)
    if lhs_dil > 1:  # only every lhs_dil-th position of the dilated input is real
        count = np.ceil(count / lhs_dil)
    return int(count.sum())


def _conv_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
    if not labels or len(instr.operands) < 2:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs, out = dims_of(shapes.get(instr.operands[0], "")), dims_of(shapes.get(instr.operands[1], "")), \
        dims_of(instr.shape)
    if not lhs or not rhs or not out:
        return 0.0
    spatial = sorted(c for c in out_l if c.isdigit())
    window = re.search(r"window=\{([^}]*)\}", instr.attrs)
    window = window.group(1) if window else ""
    n = len(spatial)
    strides = _window_field(window, "stride", n, 1)
    lhs_dil, rhs_dil = _window_field(window, "lhs_dilate", n, 1), _window_field(window, "rhs_dilate", n, 1)
    pads = re.search(r"\bpad=([\d_x\-]+)", window)
    pad_lo = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * n
    pairs = 1
    for i, d in enumerate(spatial):
        pairs *= _valid_pairs(out[out_l.index(d)], rhs[rhs_l.index(d)], lhs[lhs_l.index(d)], strides[i], pad_lo[i],
                              lhs_dil[i], rhs_dil[i])
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs


def instruction_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    """Matmul FLOPs (2 per multiply-add) of a dot or convolution; 0 for anything else."""
    if instr.opcode == "dot" and instr.operands:
        lhs = dims_of(shapes.get(instr.operands[0], ""))
        contracted = math.prod(lhs[i] for i in _braced_ints(instr.attrs, "lhs_contracting_dims") if i < len(lhs))
        return 2.0 * math.prod(dims_of(instr.shape)) * contracted
    if instr.opcode == "convolution":
        return _conv_flops(instr, shapes)
    return 0.0


def _sliced_read(module: HloModule, pname: str, uses: list[Instruction], depth: int = 3) -> int | None:
    """Bytes read of fusion parameter `pname` when every use only slices it — directly, or
    as the operand of a nested fusion that only slices it (the layer scan's stacked weights
    reach the matmul's fusion whole and are sliced one fusion further in) — else None."""
    if not uses:
        return None
    total = 0
    for use in uses:
        if use.opcode in _SLICES and use.operands[0] == pname:
            total += sum(array_sizes(use.shape))
            continue
        inner = module.computations.get(dict(called(use)).get("calls", "")) if use.opcode == "fusion" else None
        if inner is None or depth == 0:
            return None
        for index in (i for i, o in enumerate(use.operands) if o == pname):
            param = next((j for j in inner.instructions.values()
                          if j.opcode == "parameter" and int(j.args.strip() or 0) == index), None)
            nested = [j for j in inner.instructions.values() if param is not None and param.name in j.operands]
            bytes_ = None if param is None else _sliced_read(module, param.name, nested, depth - 1)
            if bytes_ is None:
                return None
            total += bytes_
    return total


def _fusion_operand_bytes(module: HloModule, instr: Instruction, shapes: dict[str, str]) -> tuple[int, int]:
    """(bytes read, bytes written) by a fusion: a parameter the fusion only slices counts as
    its slices, an in-place dynamic-update-slice or scatter root as its update (the buffer it
    updates neither read nor written whole)."""
    fused = module.computations.get(dict(called(instr)).get("calls", ""))
    read = [sum(array_sizes(shapes.get(o, ""))) for o in instr.operands]
    written = sum(array_sizes(instr.shape))
    if fused is None:
        return sum(read), written
    users: dict[str, list[Instruction]] = {}
    params: dict[int, str] = {}
    for inner in fused.instructions.values():
        if inner.opcode == "parameter":
            params[int(inner.args.strip() or 0)] = inner.name
        for operand in inner.operands:
            users.setdefault(operand, []).append(inner)
    for k, pname in params.items():
        sliced = _sliced_read(module, pname, users.get(pname, []))
        if k < len(read) and sliced is not None:
            read[k] = sliced
    root = fused.root
    if root.opcode in ("dynamic-update-slice", "scatter") and len(root.operands) > 1:
        update = root.operands[1] if root.opcode == "dynamic-update-slice" else root.operands[-1]  # in place
        written = sum(array_sizes(fused.instructions[update].shape)) if update in fused.instructions else written
        for k, pname in params.items():  # the buffer updated in place is read only where sliced
            others = [u for u in users.get(pname, []) if u is not root]
            if pname == root.operands[0] and k < len(read) and all(u.opcode in _SLICES for u in others):
                read[k] = sum(sum(array_sizes(u.shape)) for u in others)
    return sum(read), written


def instruction_bytes(module: HloModule, instr: Instruction, shapes: dict[str, str]) -> int:
    """HBM bytes one instruction outside a fusion reads and writes."""
    if instr.opcode in _NO_TRAFFIC:
        return 0
    if instr.opcode == "fusion":
        return sum(_fusion_operand_bytes(module, instr, shapes))
    read = sum(sum(array_sizes(shapes.get(o, ""))) for o in instr.operands)
    return read + sum(array_sizes(instr.shape))


def collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


def collective_bytes_of(instr: Instruction, shapes: dict[str, str]) -> int:
    """The size of the whole array a collective moves, per device: the gathered result of an
    all-gather, the scattered input of a reduce-scatter, the buffer of the others. An async
    `-start` returns (operand, result, ...) together, so the largest array covers every kind."""
    sizes = array_sizes(instr.shape) + [s for o in instr.operands for s in array_sizes(shapes.get(o, ""))]
    return max(sizes, default=0)


@dataclasses.dataclass
class KernelCount:
    """One Pallas kernel's share of a program call, every call counted (`kernel_cost`)."""
    name: str
    calls: float
    flops: float
    bytes: float

    def to_json(self) -> dict:
        return {"name": self.name, "calls": self.calls, "flops": self.flops, "bytes": self.bytes}


@dataclasses.dataclass
class HloSummary:
    collective_bytes: dict[str, float]    # per kind, per program call, loops counted
    collective_counts: dict[str, float]
    loops: list[Loop]
    extra_flops: float                    # to add to XLA's flops (loop bodies beyond their first run, kernels)
    extra_bytes: float                    # to add to XLA's bytes accessed
    matmul_flops: float                   # every dot/convolution, loops counted (a cross-check)
    kernels: list[KernelCount] = dataclasses.field(default_factory=list)  # recognised custom calls
    uncounted: dict[str, float] = dataclasses.field(default_factory=dict)  # other custom calls: name -> calls

    @property
    def unknown_loops(self) -> list[Loop]:
        return [loop for loop in self.loops if loop.trips is None]

    @property
    def kernel_flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def kernel_bytes(self) -> float:
        return sum(k.bytes for k in self.kernels)


def _custom_calls(comp, shapes: dict[str, str], times: float, kernels: dict[str, KernelCount],
                  uncounted: dict[str, float]) -> tuple[set[str], list[float]]:
    """Count the computation's custom calls (`times` runs each) into `kernels` or
    `uncounted`; returns the names of the instructions costed as kernels and what XLA's own
    cost analysis already counts of them (FLOPs, bytes). XLA gives a Pallas kernel neither
    FLOPs nor bytes, so its whole cost is added; a kernel with a cost_estimate XLA reads
    (`KernelCost.xla_counted`: the ragged dot) it counts once, the runs beyond it are added."""
    costed, counted = set(), [0.0, 0.0]
    for instr in comp.instructions.values():
        if instr.opcode != "custom-call":
            continue
        name, cost = kernel_cost.custom_call_cost(instr, shapes)
        if cost is None:
            uncounted[name] = uncounted.get(name, 0.0) + times
            continue
        if name in kernel_cost.XLA_BOOKKEEPING:  # no matmuls: XLA's own counts stand
            continue
        entry = kernels.setdefault(name, KernelCount(name, 0.0, 0.0, 0.0))
        entry.calls += times
        entry.flops += times * cost.flops
        entry.bytes += times * cost.bytes
        costed.add(instr.name)
        if cost.xla_counted:
            counted[0] += cost.flops
            counted[1] += cost.bytes
    return costed, counted


def analyze(text: str, unknown_trips: int = 1) -> HloSummary:
    """Collectives, loop corrections and Pallas kernels of one compiled program's HLO text."""
    module = parse_module(text)
    mult, loops, fused = multipliers(module, unknown_trips)
    coll = {k: 0.0 for k in COLLECTIVES}
    counts = {k: 0.0 for k in COLLECTIVES}
    kernels: dict[str, KernelCount] = {}
    uncounted: dict[str, float] = {}
    extra_flops = extra_bytes = matmul = 0.0
    for name, times in mult.items():
        comp = module.computations[name]
        shapes = {i.name: i.shape for i in comp.instructions.values()}
        flops = sum(instruction_flops(i, shapes) for i in comp.instructions.values())
        matmul += times * flops
        extra_flops += (times - 1) * flops
        costed, counted = _custom_calls(comp, shapes, times, kernels, uncounted)
        extra_flops -= counted[0]  # XLA's own totals hold one run of these
        extra_bytes -= counted[1]
        if name not in fused:
            extra_bytes += (times - 1) * sum(instruction_bytes(module, i, shapes) for i in comp.instructions.values()
                                             if i.name not in costed)
        for instr in comp.instructions.values():
            kind = collective_kind(instr.opcode)
            if kind:
                coll[kind] += times * collective_bytes_of(instr, shapes)
                counts[kind] += times
    found = sorted(kernels.values(), key=lambda k: -k.flops)
    extra_flops += sum(k.flops for k in found)
    extra_bytes += sum(k.bytes for k in found)
    return HloSummary(coll, counts, loops, extra_flops, extra_bytes, matmul, found, uncounted)
