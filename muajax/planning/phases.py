"""What is resident on each device in each phase of a GRPO step, part by part.

An RL step alternates two phases that share the device:
  rollout  the engine decodes and extends: the params it reads, its KV cache, the train
           state and the reference model (both stay resident between updates), and the
           temporaries of the engine's largest program;
  update   the GRPO step: the train state, the reference model, the KV cache if the engine
           keeps it through the update (rollout.keep_kv_pool), and the step's batch,
           temporaries, non-donated outputs and code.
Between them, where the engine decodes from its own copy of the weights, the sync: the
train state and the reference, the copy being cast in the train layout (to the compute
dtype) and the copy in the engine's layout.
A program's part is what it needs beyond its resident arguments (`ProgramCost.transient`),
so the parts of a phase add up to its total and nothing is counted twice. The peak over the
phases is what the run needs per device.
"""
from __future__ import annotations

import dataclasses

from muajax.planning.compile import ProgramCost


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    note: str = ""


@dataclasses.dataclass
class Phase:
    name: str
    parts: list[Part]
    program: str | None = None  # the program whose transients the phase holds
    lower_bound: bool = False   # that program did not compile (out of memory): its part is a lower bound

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def to_json(self) -> dict:
        return {"name": self.name, "total": self.total, "program": self.program, "lower_bound": self.lower_bound,
                "parts": [{"name": p.name, "bytes": p.bytes, **({"note": p.note} if p.note else {})}
                          for p in self.parts]}


def _train_resident(train: dict[str, int]) -> list[Part]:
    parts = [Part(f"train state: {name}", size) for name, size in train.items() if name != "reference"]
    if "reference" in train:
        parts.append(Part("reference model", train["reference"], "fp32 when the params are (the trainer's copy)"))
    return parts


def _program_parts(program: ProgramCost) -> list[Part]:
    note = "lower bound: the compiler ran out of memory" if program.error else ""
    return [Part(f"{program.name}: {name}", size, note if name == "temporaries" else "")
            for name, size in program.transient.items()]


def largest(programs: list[ProgramCost]) -> ProgramCost:
    return max(programs, key=lambda p: sum(p.transient.values()))


def update_phase(train: dict[str, int], engine_state: dict[str, int], step: ProgramCost, *,
                 keep_engine_state: bool = True, name: str = "update") -> Phase:
    """`train`: the train state's resident parts and "reference" (bytes per device);
    `engine_state`: the engine's resident state (the KV cache), kept through the update or not."""
    parts = _train_resident(train)
    if keep_engine_state:
        parts += [Part(f"engine: {n}", size, "kept through the update") for n, size in engine_state.items()]
    return Phase(name, parts + _program_parts(step), step.name, step.error is not None)


def rollout_phase(train: dict[str, int], engine_state: dict[str, int], programs: list[ProgramCost], *,
                  engine_params: int = 0) -> Phase:
    """`engine_params`: bytes of weights the engine holds apart from the train state (0: it
    reads the train state's params in place; the copy is dropped before the update)."""
    worst = largest(programs)
    note = "reads the train state's params in place" if engine_params == 0 else "its own copy"
    parts = [Part("engine: params", engine_params, note)]
    parts += [Part(f"engine: {n}", size) for n, size in engine_state.items()]
    parts += _train_resident(train) + _program_parts(worst)
    return Phase("rollout", parts, worst.name, any(p.error is not None for p in programs))


def sync_phase(train: dict[str, int], copy_bytes: int, cast_bytes: int) -> Phase:
    """The engine's weight sync (`muajax.runtime.rollout_engine.RolloutEngine._copy`): the
    params cast to the compute dtype in the train layout (`cast_bytes`; 0 when they keep
    their dtype), then laid out as the engine's copy (`copy_bytes`), both held at its end."""
    parts = _train_resident(train)
    if cast_bytes:
        parts.append(Part("sync: the params cast, in the train layout", cast_bytes, "freed once laid out"))
    parts.append(Part("engine: params", copy_bytes, "its own copy"))
    return Phase("sync", parts, None)
