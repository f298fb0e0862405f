"""Parse a compiled program's HLO text (`compiled.as_text()`) and find how many times each
computation runs per call: its loops' trip counts. `hlo_cost` builds on this.

Each reachable computation gets a multiplier: the product of the trip counts of the loops
around it.

A loop's trip count is read from its condition, `compare(counter, constant(N)),
direction=LT`, the constant its body adds to the counter (1 for JAX's scans, 2 for XLA's
bidirectional windowed einsums) and the counter's start in the loop's initial tuple (a
constant, or 0 when it is not one). A loop whose condition is anything else
(e.g. `while_loop` until every row stops) has no known count: it is counted `unknown_trips`
times (1 unless the caller knows better) and listed as unknown.
"""
from __future__ import annotations

import dataclasses
import math
import re

_ITEM_BITS = {"pred": 8, "token": 0, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b(pred|token|[fsu]\d+|bf16|c64|c128|f8e\w+|f4e\w+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


def _item_bits(dtype: str) -> int:
    if dtype in _ITEM_BITS:
        return _ITEM_BITS[dtype]
    if dtype.startswith(("f8", "f4")):
        return int(dtype[1])
    return int(dtype[1:])


def array_sizes(shape: str) -> list[int]:
    """Bytes of each array in a shape string (a tuple gives several)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(shape):
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        sizes.append(count * _item_bits(dtype) // 8)
    return sizes


def dims_of(shape: str) -> tuple[int, ...]:
    m = _ARRAY.search(shape)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the raw text between the opcode's parentheses (a constant's literal)
    is_root: bool = False


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions.values() if i.is_root), list(self.instructions.values())[-1])


@dataclasses.dataclass
class HloModule:
    computations: dict[str, Computation]
    entry: str


def _matching(text: str, start: int) -> int:
    """Index just past the bracket closing the one at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_instruction(line: str) -> Instruction | None:
    text = line.strip()
    is_root = text.startswith("ROOT ")
    if is_root:
        text = text[5:]
    m = re.match(r"%?([\w.\-]+)\s*=\s*", text)
    if not m:
        return None
    rest = text[m.end():]
    if rest.startswith("("):
        end = _matching(rest, 0)
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _matching(rest, op.end() - 1)
    args = rest[op.end():close - 1]
    operands = [found.group(1) for found in (re.search(r"%([\w.\-]+)", p) for p in _split_top(args)) if found]
    return Instruction(m.group(1), shape, op.group(1), operands, rest[close:], args, is_root)


def _open_brackets(text: str) -> int:
    """Brackets opened and not closed in `text`, outside quoted strings."""
    if sum(map(text.count, "({[")) == sum(map(text.count, ")}]")):
        return 0  # balanced as it stands (the common case): no need to read the strings
    depth, quoted, escaped = 0, False, False
    for c in text:
        if quoted:
            quoted, escaped = (quoted, False) if escaped else (c != '"', c == "\\")
        elif c == '"':
            quoted = True
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
    return depth


def parse_module(text: str) -> HloModule:
    computations: dict[str, Computation] = {}
    entry, current, pending = None, None, ""
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group(2), {})
                if header.group(1):
                    entry = current.name
            continue
        # an instruction's continuation lines join it: a Pallas kernel's metadata
        # (frontend_attributes) holds newlines, and its backend_config follows them
        line = f"{pending} {line.strip()}" if pending else line
        if _open_brackets(line) > 0:
            pending = line
            continue
        pending = ""
        # a computation ends at "}", or at "}, execution_thread=..." (v5p's SparseCore
        # computations, e.g. the scatter-adds of packed GRPO rows' per-segment sums)
        if line.strip() == "}" or line.startswith("}, "):
            computations[current.name] = current
            current = None
            continue
        instr = parse_instruction(line)
        if instr is not None:
            current.instructions[instr.name] = instr
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(computations, entry)


# ----------------------------------------------------------------------------- loops


def called(instr: Instruction) -> list[tuple[str, str]]:
    """(role, computation) pairs an instruction calls."""
    out = [(role, name) for role, name in re.findall(r"\b(calls|to_apply|body|condition|true_computation|"
                                                      r"false_computation)=%([\w.\-]+)", instr.attrs)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
    if branches:
        out += [("branch", n) for n in re.findall(r"%([\w.\-]+)", branches.group(1))]
    return out


def _int_constant(comp: Computation, name: str, hops: int = 4) -> int | None:
    """The integer a value holds if it is a constant, seen through copies and converts."""
    instr = comp.instructions.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast") and instr.operands and hops > 0:
        instr, hops = comp.instructions.get(instr.operands[0]), hops - 1
    if instr is None or instr.opcode != "constant":
        return None
    try:
        return int(instr.args.strip())
    except ValueError:
        return None


def _is_counter(comp: Computation, name: str, index: int, hops: int = 4) -> bool:
    instr = comp.instructions.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast") and instr.operands and hops > 0:
        instr, hops = comp.instructions.get(instr.operands[0]), hops - 1
    return instr is not None and instr.opcode == "get-tuple-element" and f"index={index}" in instr.attrs


def _loop_step(body: Computation, index: int) -> int | None:
    """How much the body adds to the counter at tuple `index` (XLA's windowed einsums add 2)."""
    root = body.root
    if root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = body.instructions.get(root.operands[index])
    if update is None or update.opcode != "add" or len(update.operands) != 2:
        return None
    for counter, step in (update.operands, update.operands[::-1]):
        value = _int_constant(body, step)
        if value is not None and value > 0 and _is_counter(body, counter, index):
            return value
    return None


def trip_count(module: HloModule, comp: Computation, loop: Instruction) -> int | None:
    """ceil((N - start) / step) for a loop whose condition is `counter < N` and whose body adds
    a constant step to the counter (N, start and step constants), else None. XLA's own count
    (`known_trip_count`, which XLA:CPU states where its conditions are fusions) comes first."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
    if known:
        return int(known.group(1))
    callees = dict(called(loop))
    cond, body = (module.computations.get(callees.get(role, "")) for role in ("condition", "body"))
    if cond is None or body is None:
        return None
    root = cond.root
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    counter = cond.instructions.get(root.operands[0])
    limit = _int_constant(cond, root.operands[1])
    if limit is None or counter is None or counter.opcode != "get-tuple-element":
        return None
    index = int(re.search(r"index=(\d+)", counter.attrs).group(1))
    step = _loop_step(body, index)
    if step is None:
        return None
    init = comp.instructions.get(loop.operands[0]) if loop.operands else None
    start = 0
    if init is not None and init.opcode == "tuple" and index < len(init.operands):
        start = _int_constant(comp, init.operands[index]) or 0
    return max(-(-(limit - start) // step), 0)


@dataclasses.dataclass(frozen=True)
class Loop:
    name: str
    computation: str
    trips: int | None  # None: not known from the HLO
    multiplier: float  # how many times the loop itself runs per program call


def multipliers(module: HloModule, unknown_trips: int = 1) -> tuple[dict[str, float], list[Loop], set[str]]:
    """(runs per program call of every reachable computation, the loops, the fused computations).

    Scalar reducers (`to_apply` of reduce, sort, all-reduce, ...) are not walked: they are
    XLA's per-element lambdas, not program steps. A conditional's branches each count as run."""
    mult: dict[str, float] = {}
    loops: list[Loop] = []
    fused: set[str] = set()

    def visit(name: str, times: float, is_fusion: bool) -> None:
        comp = module.computations.get(name)
        if comp is None:
            return
        mult[name] = mult.get(name, 0.0) + times
        if is_fusion:
            fused.add(name)
        for instr in comp.instructions.values():
            for role, callee in called(instr):
                if instr.opcode == "while" and role == "body":
                    trips = trip_count(module, comp, instr)
                    loops.append(Loop(instr.name, name, trips, times))
                    visit(callee, times * (unknown_trips if trips is None else trips), False)
                elif role in ("calls", "branch", "true_computation", "false_computation") or (
                        role == "to_apply" and instr.opcode in ("call", "call-start", "async-start")):
                    visit(callee, times, is_fusion or instr.opcode == "fusion")

    visit(module.entry, 1.0, False)
    return mult, loops, fused
