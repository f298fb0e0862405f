"""Sweep meshes x remat policies for one model, batch, sequence length and topology, and
rank them by the whole GRPO step's predicted time (rollout + weight sync + update, with a
rollout profile: `sweep_step`), or without one by the update's roofline estimate.

Every factorization of the device count over `parallel.MESH_AXES` (so an axis added there
is swept too; the expert axis only for a mixture of experts, at sizes that divide its
experts) is tried with the first remat policy; the others are tried on the fastest few
meshes that fit (`refine`), or on every mesh. Before compiling, an analytic lower bound
prunes what cannot fit: the resident state (train state, reference, KV cache), exact from
the shardings, plus what the update's backward pass cannot avoid holding at once — every
layer's input, which the layer scan saves for the backward (compute dtype [rows, T, D]
per layer and device), and the larger of one layer's attention scores (float32 [rows,
heads, T, T]; every layer's when the remat policy saves them: "none" and "dots", whose
saved dots include the scores) and one microbatch's LM-head logits (compute dtype
[rows x T, vocab]) or, of a mixture of experts, one layer's token copies, one per active
expert ([rows x T x k, D]). Rows are one microbatch's rows per device. The scores term holds for
the einsum attention (`cfg.attention == "xla"`); the others (splash on TPU, chunked,
cuDNN) never hold the [T, T] scores, so it is dropped for them. The rest are compiled with the TPU compiler's early
out-of-memory exit. Only the update program is compiled (with the KV cache resident if it
is kept), and with a rollout profile the engine's programs once (they run on the engine's
mesh, whatever the train mesh).

With `settings.grpo.microbatch_size` unset, each mesh gets one row per batch-sharded device per
microbatch (the smallest microbatch it can run without padding).
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from matplotlib.figure import Figure

from muajax import parallel
from muajax.models.qwen3 import Qwen3Config
from muajax.chips import Chip
from muajax.planning.compile import COLLECTIVE_SHORT
from muajax.planning.planner import PlanSettings, plan_run
from muajax.planning.programs import engine_programs, grpo_program
from muajax.planning.report import fmt_bytes, fmt_seconds
from muajax.planning.sweep_step import engine_costs, with_step

STEP_KEYS = ("rollout_s", "sync_s", "update_s", "step_s", "async_step_s")


def mesh_candidates(num_devices: int, axes: tuple[str, ...] = parallel.MESH_AXES,
                    cfg: Qwen3Config | None = None) -> list[dict[str, int]]:
    """Every assignment of sizes to `axes` whose product is num_devices. With `cfg`: the
    expert axis above 1 only for a mixture of experts, and only at sizes that divide its
    experts (on a dense model it is fsdp again under another name)."""
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
    meshes = [dict(zip(axes, sizes)) for sizes in itertools.product(divisors, repeat=len(axes))
              if math.prod(sizes) == num_devices]
    if cfg is None:
        return meshes
    experts = cfg.num_experts if cfg.is_moe else 1
    return [m for m in meshes if experts % m.get(parallel.EXPERT_AXIS, 1) == 0]


def _per_device(size: int, mesh: dict[str, int], axes: tuple[str, ...]) -> float:
    ways = math.prod(mesh[a] for a in axes)
    return size / ways if size % ways == 0 else size


def lower_bound(cfg: Qwen3Config, mesh: dict[str, int], devices: list, settings: PlanSettings) -> dict[str, int]:
    """Bytes per device the update phase needs at least, by part (see the module docstring)."""
    device_mesh = parallel.make_mesh(**mesh, devices=devices)
    layout = settings.layout(cfg, device_mesh)
    k = layout.microbatches
    step, state = grpo_program(cfg, device_mesh, settings.grpo, layout)
    parts = dict(step.resident_args)
    if settings.keep_kv_during_update:
        _, engine_state, _ = engine_programs(cfg, device_mesh, state.params, settings.engine_settings)
        parts.update({f"engine {n}": b for n, b in engine_state.items()})
    rows = layout.padded_rows // k / parallel.batch_divisor(device_mesh)
    t = layout.longest
    logits = rows * t * _per_device(cfg.vocab_size, mesh, ("tensor",)) * np.dtype(cfg.compute_dtype).itemsize
    parts["saved layer inputs"] = int(cfg.num_layers * rows * t * cfg.hidden_size * np.dtype(cfg.compute_dtype).itemsize)
    transient = {"LM-head logits": int(logits)}
    if cfg.is_moe:  # a layer's tokens copied once per active expert, sorted by expert
        transient["expert token copies"] = int(rows * t * cfg.num_experts_per_tok * cfg.hidden_size
                                               * np.dtype(cfg.compute_dtype).itemsize)
    if cfg.attention == "xla":
        layers = cfg.num_layers if cfg.remat in ("none", "dots") else 1
        heads = _per_device(cfg.num_heads, mesh, ("tensor",))
        transient["attention scores"] = int(layers * rows * heads * t * t * 4)
    worst = max(transient, key=transient.get)
    parts[worst] = transient[worst]
    return parts


@dataclasses.dataclass
class SweepRow:
    mesh: dict[str, int]
    remat: str
    microbatches: int
    status: str                   # "fits", "too big", "pruned" (by the lower bound), "no mesh" (cannot be laid out)
    per_device_bytes: int
    lower_bound: bool = False     # per_device_bytes is a floor: pruned, or the compiler gave up
    roofline: dict | None = None
    costs: dict | None = None
    compile_s: float = 0.0
    note: str = ""
    step: dict | None = None      # with a rollout profile: rollout_s, sync_s, update_s, step_s, ... (predict_step)

    def flat(self) -> dict:
        line = self.roofline or {}
        costs = self.costs or {}
        coll = costs.get("collective_bytes", {})
        return {**self.mesh, "remat": self.remat, "microbatches": self.microbatches, "status": self.status,
                "per_device_bytes": self.per_device_bytes, "lower_bound": self.lower_bound,
                "estimate_s": line.get("estimate_s"),
                "serial_s": line.get("serial_s"), "compute_s": line.get("compute_s"),
                "memory_s": line.get("memory_s"), "collective_s": line.get("collective_s"),
                "bound": line.get("bound"), "flops": costs.get("flops"), "bytes_accessed": costs.get("bytes_accessed"),
                **{short: coll.get(kind) for kind, short in COLLECTIVE_SHORT.items()},
                "compile_s": round(self.compile_s, 2), "note": self.note,
                **{k: (self.step or {}).get(k) for k in STEP_KEYS}}


def _label(row: SweepRow) -> str:
    return " ".join(f"{a[0]}{n}" for a, n in row.mesh.items()) + f" {row.remat}"


def seconds(row: SweepRow) -> float:
    """What a sweep ranks by: the whole step's predicted seconds where it has a rollout
    profile (the step the config runs: asynchronous with grpo.max_staleness), else the
    update's roofline estimate."""
    if row.step:
        return row.step.get("run_step_s", row.step["step_s"])
    return (row.roofline or {}).get("estimate_s", math.inf)


def _rank(rows: list[SweepRow]) -> list[SweepRow]:
    """Fitting first, by seconds to 3 significant figures (an estimate is no finer: compute-bound
    meshes that differ in the 6th figure tie); ties by the update's serial time (the sum of its
    compute, HBM and collective terms: the least to lose where they overlap badly), then by
    memory per device."""
    order = {"fits": 0, "too big": 1, "pruned": 2, "no mesh": 3}
    serial = lambda r: float(f"{(r.roofline or {}).get('serial_s', math.inf):.3g}")
    return sorted(rows, key=lambda r: (order[r.status], float(f"{seconds(r):.3g}"), serial(r), r.per_device_bytes))


def _evaluate(cfg, label, mesh, devices, settings, topology, chip, hbm, whole=None) -> SweepRow:
    """One configuration's row; `whole` = (EngineCosts, profile, rollout config) adds the
    rollout and sync phases and ranks it by the predicted step (`sweep_step`)."""
    settings = dataclasses.replace(settings, phases=("update",), exact_oom=False)
    try:  # as the trainer builds it: jax.make_mesh maps each axis onto whole physical torus axes
        k = settings.layout(cfg, parallel.make_mesh(**mesh, devices=devices)).microbatches
    except (NotImplementedError, ValueError) as error:  # ConfigError too: microbatches that do not fit the mesh
        return SweepRow(mesh, cfg.remat, 0, "no mesh", 0, note=str(error).split(". ")[0][:200])
    bound = lower_bound(cfg, mesh, devices, settings)
    if hbm and sum(bound.values()) > hbm:
        why = ", ".join(f"{n} {fmt_bytes(b)}" for n, b in bound.items())
        return SweepRow(mesh, cfg.remat, k, "pruned", sum(bound.values()), True, note=f"lower bound: {why}")
    start = time.perf_counter()
    plan = plan_run(cfg, devices=devices, mesh=mesh, settings=settings, label=label, topology=topology, chip=chip,
                    hbm_bytes=hbm)
    step = plan.programs[0]
    predicted = None
    if whole is not None and step.error is None:
        plan, prediction = with_step(plan, whole[0], devices, *whole[1:])
        predicted = {k: prediction[k] for k in STEP_KEYS + ("tokens_per_s_per_chip", "update_mfu")}
    status = "too big" if step.error or plan.fits is False else "fits"
    row = SweepRow(mesh, cfg.remat, k, status, plan.per_device_bytes, step.error is not None,
                   plan.rooflines().get(step.name), step.to_json(), time.perf_counter() - start, step.error or "",
                   predicted)
    jax.clear_caches()  # each configuration compiles once: jax's caches would only grow (5.6 GB over 10 compiles)
    return row


def mesh_settings(settings: PlanSettings, mesh: dict[str, int]) -> PlanSettings:
    """Without a microbatch size: one row per batch-sharded device per microbatch."""
    if settings.grpo.microbatch_size is not None:
        return settings
    per = math.prod(mesh.get(a, 1) for a in parallel.BATCH_AXES)
    return dataclasses.replace(settings, grpo=dataclasses.replace(settings.grpo, microbatch_size=per))


def first_engine_costs(cfg, label, candidates, devices, settings, topology, chip, hbm_bytes, log):
    """The engine's programs compiled on the first mesh that can be laid out."""
    for mesh in candidates:
        run_settings = mesh_settings(settings, mesh)
        try:
            run_settings.layout(cfg, parallel.make_mesh(**mesh, devices=devices))
        except (NotImplementedError, ValueError):
            continue
        log("sweep: compiling the engine's programs once (they run on the engine's mesh, whatever the train mesh)")
        return engine_costs(cfg, devices=devices, mesh=mesh, settings=run_settings, label=label, topology=topology,
                            chip=chip, hbm_bytes=hbm_bytes, log=log)
    raise ValueError("sweep: no mesh can be laid out on these devices")


def run_sweep(cfg: Qwen3Config, label: str, *, devices: list, settings: PlanSettings, remats: tuple[str, ...],
              topology: str, chip: Chip | None, hbm_bytes: int | None, out_dir: str,
              meshes: list[dict[str, int]] | None = None, refine: int | None = None, profile=None,
              rollout=None, log: Callable[[str], None] = lambda _: None) -> dict:
    """Plan every mesh (default: `mesh_candidates`) with remats[0], then the other remat
    policies on the `refine` meshes that rank fastest among those that fit (every mesh when
    refine is None); write sweep.csv, sweep.json and sweep.png into out_dir. With a rollout
    `profile` (and the run's `rollout` config), each mesh is ranked by its whole predicted
    GRPO step, the engine's programs compiled once (`sweep_step`); else by its update.

    Two stages because a compile at the paper's scale takes 40-90 s on a small machine and
    the mesh decides the collectives, which dominate the estimate; the remat policy mostly
    trades memory for recompute on a mesh already chosen."""
    start = time.perf_counter()
    candidates = meshes or mesh_candidates(len(devices), cfg=cfg)
    stage2 = len(remats) - 1 if refine is None else min(refine, len(candidates)) * (len(remats) - 1)
    log(f"sweep: {len(candidates)} meshes with remat {remats[0]}"
        + (f", then {', '.join(remats[1:])} on " + ("every mesh" if refine is None else f"the {refine} fastest")
           if len(remats) > 1 else "") + f", for {label} on {topology} (at most {len(candidates) + stage2} plans)")
    os.makedirs(out_dir, exist_ok=True)
    journal = Journal(os.path.join(out_dir, "sweep.partial.jsonl"),
                      {"model": label, "cfg": repr(cfg), "topology": topology, "devices": len(devices),
                       "hbm_bytes": hbm_bytes, "settings": repr(settings),
                       "profile": getattr(profile, "name", None)}, log)
    whole = None
    if profile is not None:
        costs = first_engine_costs(cfg, label, candidates, devices, settings, topology, chip, hbm_bytes, log)
        whole = (costs, profile, rollout)

    def plan(mesh: dict[str, int], remat: str) -> SweepRow:
        run_settings = mesh_settings(settings, mesh)
        row = journal.done.get(_key(mesh, remat))
        if row is None:
            row = _evaluate(cfg.replace(remat=remat), label, mesh, devices, run_settings, topology, chip, hbm_bytes,
                            whole)
            journal.add(row)
        log(f"  {_label(row):<24} {row.status:<8} {fmt_bytes(row.per_device_bytes):>12}"
            + (f"  {fmt_seconds(seconds(row))}" if math.isfinite(seconds(row)) else "")
            + (f"  compiled in {row.compile_s:.0f} s" if row.compile_s else ""))
        return row

    rows = [plan(mesh, remats[0]) for mesh in candidates]
    fitting = [r.mesh for r in _rank(rows) if r.status == "fits"]
    chosen = fitting if refine is None else fitting[:refine]
    if len(remats) > 1 and chosen:
        log(f"sweep: remat {', '.join(remats[1:])} on {len(chosen)} meshes")
    rows += [plan(mesh, remat) for mesh in chosen for remat in remats[1:]]
    ranked = _rank(rows)
    log("\n" + table(ranked, hbm_bytes))
    paths = write_outputs(ranked, out_dir, label, topology, hbm_bytes)
    journal.close()
    count = {status: sum(r.status == status for r in rows) for status in ("fits", "too big", "pruned", "no mesh")}
    pruned = count["pruned"]
    summary = {"model": label, "topology": topology, "devices": len(devices), "hbm_bytes": hbm_bytes,
               "compiler": devices[0].platform, "configs": len(rows), "pruned": pruned, "no_mesh": count["no mesh"],
               "compiled": count["fits"] + count["too big"], "fitting": count["fits"],
               "refined_meshes": len(chosen) if len(remats) > 1 else 0,
               "best": ranked[0].flat() if ranked and ranked[0].status == "fits" else None,
               "wall_s": round(time.perf_counter() - start, 1), **paths}
    log(f"{pruned} of {len(rows)} configurations pruned by the analytic lower bound before compiling, "
        f"{count['no mesh']} meshes jax.make_mesh cannot lay on the slice; {summary['compiled']} compiled in "
        f"{summary['wall_s']:.0f} s." + ("" if whole else " Without --rollout-profile the update alone is ranked."))
    return {"summary": summary, "rows": [r.flat() for r in ranked]}


def _key(mesh: dict[str, int], remat: str) -> str:
    return json.dumps([sorted(mesh.items()), remat])


class Journal:
    """Each finished configuration, one JSON line as it completes, so that a sweep stopped
    part-way (hours of compiles on a small machine) resumes where it was: a rerun with the
    same model, topology and settings takes the rows already there. Removed once the sweep
    has written its outputs; a journal of another sweep is set aside, not reused."""

    def __init__(self, path: str, fingerprint: dict, log: Callable[[str], None]):
        self.path, self.done = path, {}
        header = json.dumps(fingerprint, sort_keys=True)
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().splitlines()
            if lines and lines[0] == header:
                for line in lines[1:]:
                    try:
                        row = SweepRow(**json.loads(line))
                    except (json.JSONDecodeError, TypeError):  # a line cut short by a kill
                        continue
                    self.done[_key(row.mesh, row.remat)] = row
                log(f"sweep: resuming, {len(self.done)} configurations already planned in {path}")
            else:
                os.replace(path, path + ".other")
                log(f"sweep: {path} was another sweep's; moved to {path}.other")
        # rewritten whole: a line cut short by a kill would otherwise swallow the next row appended
        with open(path, "w") as f:
            f.write(header + "\n")
            f.writelines(json.dumps(dataclasses.asdict(row)) + "\n" for row in self.done.values())

    def add(self, row: SweepRow) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[_key(row.mesh, row.remat)] = row

    def close(self) -> None:
        os.remove(self.path)


def table(rows: list[SweepRow], hbm_bytes: int | None) -> str:
    stepped = any(r.step for r in rows)
    head = f"{'mesh / remat':<26}{'status':<9}{'per device':>13}{'estimate':>12}{'serial':>12}  {'bound':<11}"
    lines = [head + (f"{'rollout':>10}{'sync':>10}{'update':>10}{'step':>10}{'async':>10}" if stepped else "")]
    for r in rows:
        line = r.roofline or {}
        est = fmt_seconds(line["estimate_s"]) if line else "-"
        serial = fmt_seconds(line["serial_s"]) if line else "-"
        prefix = ">= " if r.lower_bound else ""
        text = (f"{_label(r):<26}{r.status:<9}{prefix + fmt_bytes(r.per_device_bytes):>13}{est:>12}{serial:>12}"
                f"  {line.get('bound', ''):<11}")
        if r.step:
            text += "".join(f"{fmt_seconds(r.step[k]):>10}" for k in STEP_KEYS)
        lines.append(text)
    if stepped:
        asynchronous = any(r.step.get("max_staleness") for r in rows if r.step)
        lines.append("estimate / serial: the update's roofline; rollout, sync, update, step: the whole GRPO step "
                     "predicted for the rollout profile; async: the step with grpo.max_staleness >= 1, the rollout "
                     f"overlapping the update (ranked by {'async' if asynchronous else 'step'})")
    if hbm_bytes:
        lines.append(f"usable HBM per device {fmt_bytes(hbm_bytes)}")
    return "\n".join(lines)


def write_outputs(rows: list[SweepRow], out_dir: str, label: str, topology: str, hbm_bytes: int | None) -> dict:
    flat = [r.flat() for r in rows]
    csv_path, json_path, png_path = (os.path.join(out_dir, f"sweep.{ext}") for ext in ("csv", "json", "png"))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    with open(json_path, "w") as f:
        json.dump({"model": label, "topology": topology, "hbm_bytes": hbm_bytes, "rows": flat}, f, indent=1)
    what = "GRPO step" if any(r.step for r in rows) else "GRPO update"
    chart(rows, png_path, f"{label} on {topology}: {what}", hbm_bytes)
    return {"csv": csv_path, "json": json_path, "png": png_path}


def chart(rows: list[SweepRow], path: str, title: str, hbm_bytes: int | None) -> None:
    """Two panels per configuration: estimated step time and memory per device. A bare Figure
    saves through the Agg canvas: no pyplot, no display needed."""
    shown = [r for r in rows if r.status in ("fits", "too big")] or rows
    labels = [_label(r) for r in shown]
    colors = ["tab:green" if r.status == "fits" else "tab:red" for r in shown]
    fig = Figure(figsize=(13, 0.35 * len(shown) + 1.8))
    left, right = fig.subplots(1, 2, sharey=True)
    y = range(len(shown))
    if any(r.step for r in shown):  # the whole step, stacked by phase
        base = [0.0] * len(shown)
        for key, color in zip(STEP_KEYS[:3], ("tab:blue", "tab:orange", "tab:green")):
            widths = [(r.step or {}).get(key, 0.0) for r in shown]
            left.barh(y, widths, left=base, color=color, label=key.removesuffix("_s"),
                      edgecolor=["none" if r.status == "fits" else "tab:red" for r in shown])
            base = [b + w for b, w in zip(base, widths)]
        left.scatter([(r.step or {}).get("async_step_s", 0.0) for r in shown], list(y), marker="|", s=300,
                     color="black", zorder=3, label="async step")
        left.legend(loc="lower right")
        left.set_xlabel("predicted GRPO step, s (rollout + sync + update; |: overlapped, grpo.max_staleness >= 1)"
                        "\n(red edge: does not fit)")
    else:
        left.barh(y, [(r.roofline or {}).get("estimate_s", 0.0) for r in shown], color=colors)
        left.set_xlabel("estimated update time, s\n(roofline: slowest of compute, HBM, collectives)")
    right.barh(y, [r.per_device_bytes / 2**30 for r in shown], color=colors)
    if hbm_bytes:
        right.axvline(hbm_bytes / 2**30, color="black", linestyle="--", label="usable HBM")
        right.legend(loc="lower right")
    right.set_xlabel("memory per device, GiB\n(red: does not fit; where the compiler gave up: at least this)")
    left.set_yticks(list(y), labels)
    left.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
