"""A plan's GRPO step time beside a run's measured one.

    plan = plan_run(...)                                   # e.g. configs/embedded-cpu.yaml at cpu:1
    result, lines = calibrate(plan, "runs/embedded-cpu")  # the run's medians beside the prediction
    print("\\n".join(lines))

The prediction (`step_time.predict_step`) takes the run's rollout profile from its own
metrics.jsonl (`RolloutProfile.from_run`: what its conversations looked like, not how long
they took), its rollout settings from its config.yaml, and the rates of the plan's chip, or
on a CPU plan this host's measured rates (`host_rates`). The measured side is the medians of
the run's `time/rollout_s` and `time/update_s` (the update's wall time, compiles included:
the median step compiles nothing) and of `perf/update_s` (compiles excluded).
"""
from __future__ import annotations

import math
import os
import statistics

from muajax import parallel
from muajax.agent.rollout_config import RolloutConfig
from muajax.planning.rollout_profile import ProfileError, RolloutProfile
from muajax.planning.rollout_schedule import Schedule
from muajax.planning.run_profile import read_records
from muajax.planning.report import summary_lines
from muajax.planning.step_time import Rates, StepSettings, predict_step
from muajax.runtime.rollout_engine import default_shape

TOLERANCE = 0.35  # the calibration's bar: each phase's prediction within 35% of the measured median


def engine_shards(plan, rollout: RolloutConfig, hosts: int) -> int:
    """The batch shards of one host's engine mesh (`muajax.runtime.rollout_engine.engine_mesh`):
    the training mesh's on a CPU, else `rollout.mesh` or the default tensor-parallel layout."""
    per_host = max(plan.devices // hosts, 1)
    if rollout.mesh is None and plan.chip is None:
        return max(math.prod(plan.mesh.get(a, 1) for a in parallel.BATCH_AXES) // hosts, 1)
    if rollout.mesh is None:
        data, fsdp, *_ = default_shape(plan.compiler, per_host, plan.cfg)
        return data * fsdp
    m = rollout.mesh
    data, fsdp, *_ = parallel.resolve_mesh_shape(m.data, m.fsdp, m.tensor, 1, per_host)
    return data * fsdp


def engine_attention(plan) -> str:
    """The engine's attention as it resolves "auto" where the plan's run goes
    (`paged_attention.resolve_attention`): Pallas on a TPU, in place on a GPU (also a GPU
    plan compiled by XLA:CPU), else the dense "reference" decode."""
    e = plan.settings.engine_settings
    requested = e.resolved_attention() if hasattr(e, "resolved_attention") else e.attention
    if requested != "auto":
        return requested
    return "pallas" if plan.compiler == "tpu" else "reference"


def step_settings(plan, rollout: RolloutConfig | None = None, *, hosts: int = 1,
                  shards: int | None = None) -> StepSettings:
    """What `predict_step` needs beyond the plan: the engine's schedule (from the plan's
    engine settings and `rollout`, the run's rollout config; default: its defaults at the
    plan's context; `hosts`: the processes of the slice, each with its own engine) and the
    update's shape (the plan's GRPO rows)."""
    s, e = plan.settings, plan.settings.engine_settings
    r = rollout or RolloutConfig.for_engine(e.max_len)
    shards = shards or engine_shards(plan, r, hosts)
    attention = engine_attention(plan)
    conversations = -(-s.batch // hosts)
    slots = e.host_slots(hosts)  # RunContext.engine_slots
    # the call layout as RunContext.engine chooses it: fixed rows (a step's share of
    # conversations in every call) or packed, with token tiles where deterministic
    fixed = r.deterministic and r.call_layout == "fixed_rows"
    tiled = r.deterministic and not fixed
    rollout_slots = -(-(getattr(e, "call_rows", None) or r.num_slots or s.batch) // hosts)  # run_tasks.rollout_slots
    schedule = Schedule(conversations=conversations, num_slots=max(slots, conversations), max_context=r.max_context,
                        max_new_tokens=r.max_new_tokens_per_turn, max_turns=r.max_turns, decode_chunk=e.decode_chunk,
                        widths=tuple(e.widths), max_extend_tokens=e.max_extend_tokens,
                        page_size=e.page_size or (128 if attention == "pallas" else 16),
                        call_rows=-(-rollout_slots // shards) if fixed else None,
                        min_batch_bucket=min(8, slots), shards=shards,
                        dense_buckets=attention == "reference" and not tiled, overlap_io=r.overlap_io, tiled=tiled,
                        **dict(zip(("extend_tile", "decode_tile"), e.tiles(plan.compiler, slots, shards))))
    rows, g = plan.rows["grpo"], s.grpo
    return StepSettings(schedule=schedule, update_rows=rows["batch"], microbatches=rows["microbatches"],
                        updates_per_epoch=-(-s.batch // rows["batch"]), ppo_epochs=g.ppo_epochs,
                        recompute=bool(g.recompute_old_logprobs and g.minibatch_size is not None),
                        reference=g.uses_reference, buckets=tuple(rows.get("buckets") or (rows["length"],)),
                        shared_prefix=rows.get("shared_prefix", 0), compiled_length=rows.get("length", s.seq),
                        executed_flops=(getattr(plan, "analytic_flops", None) or {}).get("grpo", 0.0), hosts=hosts,
                        row_buckets=tuple(rows.get("row_buckets") or ()) if rows.get("packed") else ())


def plan_rates(plan, measure=None) -> Rates:
    """The plan's chip's rates, or this host's measured ones for a CPU plan without a chip."""
    if plan.chip is not None:
        return Rates.from_chip(plan.chip)
    if measure is None:
        from muajax.planning.host_rates import measure_host_rates as measure
    return measure(devices=plan.devices)


def run_rollout_config(run_dir: str) -> RolloutConfig:
    from muajax.config.schema import load_config

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ProfileError(f"{run_dir}: no config.yaml")
    return load_config(path, []).rollout


def measured(run_dir: str) -> dict:
    """Medians of the run's GRPO steps' times."""
    records = [r for r in read_records(run_dir) if "time/rollout_s" in r and "time/update_s" in r]
    if not records:
        raise ProfileError(f"{run_dir}: no GRPO step records with time/rollout_s in its metrics.jsonl")
    out = {"steps": len(records)}
    for key in ("time/rollout_s", "time/update_s", "perf/update_s", "engine/decode_calls", "engine/extend_calls"):
        values = [float(r[key]) for r in records if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


def calibrate(plan, run_dir: str, *, rates: Rates | None = None, profile: RolloutProfile | None = None,
              rollout: RolloutConfig | None = None, samples: int = 8, hosts: int = 1) -> tuple[dict, list[str]]:
    """(figures, printable lines): the plan's predicted rollout and update seconds per step
    beside the run's medians, each with its ratio and whether it is within TOLERANCE."""
    rates = rates or plan_rates(plan)
    profile = profile or RolloutProfile.from_run(run_dir)
    rollout = rollout or run_rollout_config(run_dir)
    prediction = predict_step(plan, profile, rates, step_settings(plan, rollout, hosts=hosts), samples=samples)
    seen = measured(run_dir)
    rows = {"rollout": (prediction["rollout_s"], seen["time/rollout_s"]),
            "update": (prediction["update_s"], seen["time/update_s"])}
    result = {"run_dir": os.path.abspath(run_dir), "measured": seen, "prediction": prediction, "phases": {}}
    lines = [f"calibration against {os.path.abspath(run_dir)} ({seen['steps']} GRPO steps, medians)",
             f"rates: {rates.source or rates.name}"]
    for phase, (predicted, actual) in rows.items():
        ratio = predicted / actual if actual > 0 else float("inf")
        ok = abs(ratio - 1.0) <= TOLERANCE
        result["phases"][phase] = {"predicted_s": predicted, "measured_s": actual, "ratio": ratio, "within": ok}
        lines.append(f"  {phase:<8} predicted {predicted:8.2f} s   measured {actual:8.2f} s   ratio {ratio:5.2f}  "
                     f"{'within' if ok else 'OUTSIDE'} {TOLERANCE:.0%}")
    if "perf/update_s" in seen:
        lines.append(f"  (update without compiles, perf/update_s: measured {seen['perf/update_s']:.2f} s)")
    for kind in ("decode", "extend"):  # the schedule's shape, where the run logged its engine's calls
        if f"engine/{kind}_calls" in seen:
            lines.append(f"  {kind} calls per step: predicted {prediction['rollout'][f'{kind}_calls']:.0f}, "
                         f"measured {seen[f'engine/{kind}_calls']:.0f}")
    lines += summary_lines(prediction)
    return result, lines


def step_report(plan, *, profile: str | RolloutProfile | None = None, run_dir: str | None = None,
                rollout: RolloutConfig | None = None, hosts: int = 1) -> tuple[dict, list[str]]:
    """What `python -m muajax.plan --rollout-profile P [--calibrate RUN_DIR]` prints: the
    plan's step time for profile P (a profile .json or a run directory), and with a run
    directory the calibration against it (profile default: the run's own)."""
    loaded = RolloutProfile.load(profile) if isinstance(profile, str) else profile  # a path, or a profile
    if run_dir:
        return calibrate(plan, run_dir, profile=loaded, rollout=rollout, hosts=hosts)
    rates = plan_rates(plan)
    prediction = predict_step(plan, loaded, rates, step_settings(plan, rollout, hosts=hosts))
    where = f" ({profile})" if isinstance(profile, str) else ""
    return prediction, [f"step time for rollout profile {loaded.name}{where}; rates: {rates.source or rates.name}",
                        *summary_lines(prediction)]
