"""The whole GRPO step of each mesh a sweep tries: rollout, weight sync and update.

The engine's decode and extend programs run on the engine's own mesh (`rollout.mesh`, by
default one laid out from the slice's devices for the platform,
`muajax.runtime.rollout_engine.engine_mesh`), not on the train mesh the sweep varies: they
are compiled once (`engine_costs`), and each mesh adds what does depend on it — the train
state the rollout phase holds beside the engine, whether the engine reads the params in
place (a train mesh of the engine's own shape) or syncs a copy, and the update
(`with_step`). The step's seconds are `muajax.planning.step_time.predict_step`'s for the
rollout profile given.
"""
from __future__ import annotations

import dataclasses

from muajax import parallel
from muajax.planning.calibration import plan_rates, step_settings
from muajax.planning.phases import Phase, rollout_phase, sync_phase
from muajax.planning.planner import Plan, plan_run
from muajax.planning.programs import engine_cast_bytes, engine_programs, grpo_program
from muajax.planning.step_time import predict_step


@dataclasses.dataclass
class EngineCosts:
    plan: Plan                  # the engine's programs compiled, with a first mesh's phases
    engine_state: dict[str, int]  # the KV pool per device


def engine_costs(cfg, *, devices: list, mesh: dict[str, int], settings, label: str, topology: str, chip,
                 hbm_bytes: int | None, log=lambda _: None) -> EngineCosts:
    """Compile the engine's programs once, through the planner (on `mesh`, any layable one)."""
    plan = plan_run(cfg, devices=devices, mesh=mesh, settings=dataclasses.replace(settings, phases=("rollout",)),
                    label=label, topology=topology, chip=chip, hbm_bytes=hbm_bytes, log=log)
    rollout = next(p for p in plan.phases if p.name == "rollout")
    state = {p.name.removeprefix("engine: "): p.bytes for p in rollout.parts
             if p.name.startswith("engine: ") and p.name != "engine: params"}
    return EngineCosts(plan, state)


def rollout_phases(cfg, devices: list, mesh: dict[str, int], settings, costs: EngineCosts,
                   train: dict[str, int]) -> list[Phase]:
    """This mesh's sync (where the engine copies) and rollout phases: the engine's compiled
    programs and pool beside this mesh's train state (`train`: the update's resident parts)."""
    device_mesh = parallel.make_mesh(**mesh, devices=devices)
    _, state = grpo_program(cfg, device_mesh, settings.grpo, settings.layout(cfg, device_mesh))
    _, _, copy_bytes = engine_programs(cfg, device_mesh, state.params, settings.engine_settings)
    engine = [p for p in costs.plan.programs if p.name.startswith("engine ")]
    phases = [sync_phase(train, copy_bytes, engine_cast_bytes(state.params, cfg))] if copy_bytes else []
    return phases + [rollout_phase(train, costs.engine_state, engine, engine_params=copy_bytes)]


def with_step(update: Plan, costs: EngineCosts, devices: list, profile, rollout) -> tuple[Plan, dict]:
    """The update's plan with this mesh's rollout and sync phases and the engine's programs
    added, and its predicted step (`predict_step`)."""
    step = next(p for p in update.programs if p.name == "grpo step")
    phases = rollout_phases(update.cfg, devices, update.mesh, update.settings, costs, dict(step.resident_args))
    whole = dataclasses.replace(update, phases=phases + update.phases,
                                programs=[p for p in costs.plan.programs if p.name.startswith("engine ")]
                                + update.programs)
    return whole, predict_step(whole, profile, plan_rates(whole), step_settings(whole, rollout))
