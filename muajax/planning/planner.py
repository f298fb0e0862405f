"""Plan one run: compile its programs for a topology and sum what each phase keeps resident.

`plan_run(cfg, devices=..., mesh=..., settings=...)` builds the programs the trainer and the
engine run (`programs.py`), compiles them for the devices (TPU devices from libtpu's
topologies, or CPU devices), and returns a `Plan`: its phases part by part, the peak per
device, `fits` against the chip, and each program's costs and roofline.

`PlanSettings` carries the trainer's own settings objects (GRPOConfig, SFTConfig), so a plan
from a run config (`from_train_config`) and one from command-line flags go through the same
code.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from muajax import parallel
from muajax.config.schema import SFTConfig, TrainConfig
from muajax.models.qwen3 import Qwen3Config
from muajax.chips import Chip
from muajax.planning.compile import ProgramCost, compile_program
from muajax.models.flops import executed_step_flops, train_step_flops
from muajax.planning.phases import Phase, rollout_phase, sync_phase, update_phase
from muajax.planning.programs import (EngineSettings, engine_cast_bytes, engine_programs, grpo_program,
                                      old_logprobs_program, sft_program)
from muajax.planning.roofline import roofline
from muajax.planning.topology import GPUS
from muajax.rl.grpo import GRPOConfig
from muajax.runtime import run_tasks
from muajax.runtime.grpo_layout import GRPOLayout, make_layout, rows_attention

PHASES = ("rollout", "update", "sft")
STEP_PROGRAMS = {"grpo": "grpo step", "sft": "sft step"}  # step kind -> its program's name


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    batch: int = 256                 # rollouts per GRPO step (n_per_task * tasks_per_step)
    seq: int = 32768                 # the update's padded length (rollout.max_context at most)
    temperature: float = 1.0         # the rollout's
    grpo: GRPOConfig = GRPOConfig()
    sft: SFTConfig = SFTConfig()
    sft_seq: int | None = None       # the SFT step's padded length (None: sft.max_len)
    prompt_prefix: int = 0           # tokens every conversation starts with (the trainer's rule shares them or not)
    engine: EngineSettings | None = None  # None: batch slots of seq tokens
    keep_kv_during_update: bool = False   # rollout.keep_kv_pool: else the pool is freed for the update
    phases: tuple[str, ...] = ("rollout", "update")
    exact_oom: bool = False          # compile programs that cannot fit to the end (slow; compile.py)

    def __post_init__(self):
        bad = sorted(set(self.phases) - set(PHASES))
        if bad or not self.phases:
            raise ValueError(f"phases {list(self.phases)}: choose from {list(PHASES)}")
        for name in ("batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sft_seq is not None and self.sft_seq < 1:
            raise ValueError(f"sft_seq must be >= 1 or unset, got {self.sft_seq}")

    @property
    def update_rows(self) -> int:
        """Rows of one optimizer update: a mini-batch, or the whole rollout batch."""
        return self.grpo.minibatch_size or self.batch

    def layout(self, cfg: Qwen3Config, mesh) -> GRPOLayout:
        """The GRPO updates' layout on `mesh`, as the trainer makes it (`muajax.runtime.grpo_layout`)."""
        return make_layout(mesh, cfg, self.grpo, batch_size=self.batch, max_context=self.seq,
                           temperature=self.temperature, prompt_prefix=self.prompt_prefix)

    @property
    def engine_settings(self) -> EngineSettings:
        return self.engine or EngineSettings(num_slots=self.batch, max_len=self.seq)


def from_train_config(cfg: TrainConfig, *, phases: tuple[str, ...] | None = None, eval_slots: int = 0,
                      **overrides) -> PlanSettings:
    """What the trainer runs for `cfg`: its GRPO batch at rollout.max_context (the longest a
    collated batch gets), its SFT step at sft.max_len, its engine's slots and context."""
    r = cfg.rollout
    batch = r.n_per_task * r.tasks_per_step
    if phases is None:
        phases = tuple(p for p, stage in (("rollout", "grpo"), ("update", "grpo"), ("sft", "sft"))
                       if stage in cfg.run.stages)
    # as RunContext.engine sizes it: a step's conversations, or the evaluation's if more
    # (`eval_slots`: the domain's held-out tasks x trials, `run_config.domain_facts`; each host its share)
    # and lays its calls out as RunContext.engine does: fixed rows (every call a step's share of
    # conversations wide) or packed, with token tiles where deterministic
    fixed = r.deterministic and r.call_layout == "fixed_rows"
    engine = EngineSettings(num_slots=r.num_slots or batch, max_len=r.max_context, kv_cache_tokens=r.kv_cache_tokens,
                            page_size=r.page_size, attention=r.attention, mesh=r.mesh, eval_slots=eval_slots,
                            eval_trials=run_tasks.eval_trials(cfg),
                            deterministic=r.deterministic and not fixed,
                            call_rows=(r.num_slots or batch) if fixed else None, extend_tile=r.extend_tile,
                            decode_tile=r.decode_tile)
    values = dict(batch=batch, seq=r.max_context, temperature=r.temperature,
                  grpo=cfg.grpo, sft=cfg.sft, engine=engine, keep_kv_during_update=r.keep_kv_pool, phases=phases)
    return PlanSettings(**{**values, **overrides})


@dataclasses.dataclass
class Plan:
    label: str
    cfg: Qwen3Config
    topology: str
    mesh: dict[str, int]
    chip: Chip | None
    hbm_bytes: int | None
    settings: PlanSettings
    phases: list[Phase]
    programs: list[ProgramCost]
    rows: dict[str, dict]            # per step kind: batch, microbatches, padded rows
    model_flops: dict[str, float]    # per device per step, analytic (MFU's numerator)
    analytic_flops: dict[str, float] = dataclasses.field(default_factory=dict)  # per device, executed_step_flops

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def compiler(self) -> str:
        return self.programs[0].compiler

    @property
    def per_device_bytes(self) -> int:
        return max(p.total for p in self.phases)

    @property
    def fits(self) -> bool | None:
        if self.hbm_bytes is None:
            return None
        return self.per_device_bytes <= self.hbm_bytes and all(p.error is None for p in self.programs)

    def flops_check(self) -> dict[str, dict]:
        """Per step kind: its program's compiled FLOPs (kernels included) and the analytic
        count of what it executes, per device, and their ratio."""
        out = {}
        for kind, analytic in self.analytic_flops.items():
            cost = next((p for p in self.programs if p.name == STEP_PROGRAMS[kind] and p.error is None), None)
            if cost is not None:
                out[kind] = {"flops": cost.flops, "analytic_flops": analytic,
                             "ratio": cost.flops / analytic if analytic else None}
        return out

    def rooflines(self) -> dict[str, dict]:
        return {} if self.chip is None else {p.name: roofline(p, self.chip) for p in self.programs if p.error is None}

    def to_json(self) -> dict:
        lines, s = self.rooflines(), self.settings
        check = self.flops_check()
        checks = {STEP_PROGRAMS[kind]: {"analytic_flops": c["analytic_flops"], "flops_ratio": c["ratio"]}
                  for kind, c in check.items()}
        settings = {"batch": s.batch, "seq": s.seq, "temperature": s.temperature,
                    "kl_coef": s.grpo.kl_coef, "logits_chunk": s.grpo.logits_chunk,
                    "microbatch_size": s.grpo.microbatch_size, "minibatch_size": s.grpo.minibatch_size,
                    "prompt_prefix": s.prompt_prefix,
                    "shared_prefix": self.rows.get("grpo", {}).get("shared_prefix", 0),
                    "keep_kv_during_update": s.keep_kv_during_update,
                    "engine": dataclasses.asdict(s.engine_settings), "phases": list(s.phases)}
        if "sft" in s.phases:
            settings["sft"] = {"batch_size": s.sft.batch_size, "microbatch_size": s.sft.microbatch_size,
                               "seq": s.sft_seq or s.sft.max_len}
        return {"model": self.label, "params": self.cfg.num_params(), "active_params": self.cfg.num_params(active=True),
                "topology": self.topology,
                "chip": self.chip.name if self.chip else None, "compiler": self.compiler, "devices": self.devices,
                "mesh": self.mesh, "remat": self.cfg.remat, "param_dtype": self.cfg.param_dtype,
                "dtype": self.cfg.dtype, "attention": self.cfg.attention, "settings": settings, "rows": self.rows,
                "per_device_bytes": self.per_device_bytes, "hbm_bytes": self.hbm_bytes, "fits": self.fits,
                "phases": [p.to_json() for p in self.phases],
                "programs": {p.name: {**p.to_json(), "roofline": lines.get(p.name), **checks.get(p.name, {})}
                             for p in self.programs},
                "model_flops_per_device": self.model_flops,
                # per device per step: compiled (kernels included), executed_step_flops, their ratio
                "flops": {kind: c["flops"] for kind, c in check.items()},
                "analytic_flops": {kind: c["analytic_flops"] for kind, c in check.items()},
                "flops_ratio": {kind: c["ratio"] for kind, c in check.items()}}


def _plan_grpo(cfg: Qwen3Config, device_mesh, s: PlanSettings, build, phases: list[Phase]):
    """The GRPO phases (rollout, the engine's weight sync, the old-logprob recompute where
    configured, the update) into `phases`; returns the update's rows, and its model and
    analytic FLOPs per device."""
    platform, n = device_mesh.devices.flat[0].platform, device_mesh.size
    layout = s.layout(cfg, device_mesh)
    step, state = grpo_program(cfg, device_mesh, s.grpo, layout)
    train = dict(step.resident_args)
    rows = {"batch": layout.update_rows, "microbatches": layout.microbatches, "padded": layout.padded_rows,
            "length": layout.longest, "buckets": list(layout.buckets), "shared_prefix": layout.shared_prefix,
            "packed": layout.packed, "row_buckets": list(layout.row_buckets()),
            "attention": rows_attention(cfg, length=layout.longest, platform=platform,
                                        shared_prefix=layout.shared_prefix)}
    flops = train_step_flops(cfg, layout.update_rows, layout.longest, reference=s.grpo.uses_reference,
                             shared_prefix=layout.shared_prefix, microbatches=layout.microbatches) / n
    analytic = executed_step_flops(
        cfg, layout.padded_rows, layout.longest, reference=s.grpo.uses_reference, shared_prefix=layout.shared_prefix,
        microbatches=layout.microbatches, logits_chunk=s.grpo.logits_chunk, platform=platform) / n
    engine_state: dict[str, int] = {}
    if "rollout" in s.phases or s.keep_kv_during_update:
        programs, engine_state, copy_bytes = engine_programs(cfg, device_mesh, state.params, s.engine_settings)
        if "rollout" in s.phases:
            if copy_bytes:
                phases.append(sync_phase(train, copy_bytes, engine_cast_bytes(state.params, cfg)))
            phases.append(rollout_phase(train, engine_state, [build(p) for p in programs], engine_params=copy_bytes))
    if "update" in s.phases:
        keep = s.keep_kv_during_update
        recompute = old_logprobs_program(cfg, device_mesh, s.grpo, layout, state)
        if recompute is not None:
            phases.append(update_phase(train, engine_state, build(recompute), keep_engine_state=keep,
                                       name="old logprobs"))
        phases.append(update_phase(train, engine_state, build(step), keep_engine_state=keep))
    return rows, flops, analytic


def plan_run(cfg: Qwen3Config, *, devices: list, mesh: dict[str, int], settings: PlanSettings, label: str = "",
             topology: str = "", chip: Chip | None = None, hbm_bytes: int | None = None,
             log: Callable[[str], None] = lambda _: None) -> Plan:
    """Compile the run's programs on `devices` laid out as `mesh` and sum its phases."""
    device_mesh = parallel.make_mesh(**mesh, devices=devices)
    platform = devices[0].platform
    if chip is not None and chip.name in GPUS and settings.engine_settings.platform is None:
        # a GPU plan compiled by XLA:CPU: its engine resolves "auto" as a GPU's does
        settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine_settings, platform="gpu"))
    s, n = settings, device_mesh.size
    compiled: list[ProgramCost] = []
    phases: list[Phase] = []
    rows: dict[str, dict] = {}
    flops: dict[str, float] = {}
    analytic: dict[str, float] = {}

    def build(program) -> ProgramCost:
        log(f"compiling {program.name} ...")
        cost = compile_program(program, platform=platform, exact_oom=s.exact_oom)
        log(f"  {program.name}: lowered in {cost.lower_s:.1f} s, compiled in {cost.compile_s:.1f} s"
            + (f"; {cost.error}" if cost.error else ""))
        compiled.append(cost)
        return cost

    if "rollout" in s.phases or "update" in s.phases:
        rows["grpo"], flops["grpo"], analytic["grpo"] = _plan_grpo(cfg, device_mesh, s, build, phases)
    if "sft" in s.phases:
        seq = s.sft_seq or s.sft.max_len
        sft, _, rows["sft"] = sft_program(cfg, device_mesh, s.sft, seq=seq, prompt_prefix=s.prompt_prefix)
        flops["sft"] = train_step_flops(cfg, s.sft.batch_size, seq, shared_prefix=rows["sft"]["shared_prefix"],
                                        microbatches=rows["sft"]["microbatches"]) / n
        analytic["sft"] = executed_step_flops(
            cfg, rows["sft"]["padded"], seq, shared_prefix=rows["sft"]["shared_prefix"],
            microbatches=rows["sft"]["microbatches"], logits_chunk=s.sft.logits_chunk, platform=platform) / n
        phases.append(update_phase(dict(sft.resident_args), {}, build(sft), keep_engine_state=False, name="sft"))
    return Plan(label, cfg, topology, dict(mesh), chip, hbm_bytes, settings, phases, compiled, rows, flops, analytic)
