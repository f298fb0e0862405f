"""Text tables of a Plan: one per phase, part by part, and one of the programs' costs; and the
lines of a predicted GRPO step (`step_time.predict_step`)."""
from __future__ import annotations

from muajax.planning.compile import COLLECTIVE_SHORT
from muajax.planning.planner import Plan


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def header(plan: Plan) -> str:
    cfg, s = plan.cfg, plan.settings
    chip = plan.chip.name if plan.chip else "no chip"
    hbm = f"{fmt_bytes(plan.hbm_bytes)} usable per device" if plan.hbm_bytes else "no HBM limit given"
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.items())
    moe = (f" ({cfg.num_params(active=True) / 1e9:.2f}B active: {cfg.num_experts_per_tok} of {cfg.num_experts} "
           f"experts a token)") if cfg.is_moe else ""
    lines = [f"model {plan.label}: {cfg.num_params() / 1e9:.2f}B params{moe}, {cfg.num_layers} layers, params "
             f"{cfg.param_dtype}, compute {cfg.dtype}, remat {cfg.remat}, attention {cfg.attention}",
             f"topology {plan.topology}: {plan.devices} devices ({chip}, {hbm}), mesh {mesh}, compiler {plan.compiler}"]
    for kind, seq in (("grpo", s.seq), ("sft", s.sft_seq or s.sft.max_len)):
        if kind in plan.rows:
            r = plan.rows[kind]
            pad = f", padded to {r['padded']}" if r["padded"] != r["batch"] else ""
            lines.append(f"{kind.upper()} update: {r['batch']} rows x {seq} tokens in {r['microbatches']} "
                         f"microbatch(es){pad}" + (f"; kl_coef {s.grpo.kl_coef}" if kind == "grpo" else ""))
    if "rollout" in s.phases or "update" in s.phases:
        e = s.engine_settings
        calls = (f"fixed rows ({e.call_rows} a call), extend widths {list(e.widths)}" if e.call_rows else
                 f"packed extends (tiles of {e.extend_tile or 'the platform default'} tokens)"
                 + (f", token tiles (decode {e.decode_tile or 'the platform default'} rows a tile)"
                    if e.deterministic else ""))
        lines.append(f"engine: {e.num_slots} slots x {e.max_len} tokens, decode chunk {e.decode_chunk}, "
                     f"{calls}, attention {e.resolved_attention()}")
    return "\n".join(lines)


def phase_table(plan: Plan) -> str:
    lines = []
    for phase in plan.phases:
        lines.append(f"phase {phase.name} (program: {phase.program})")
        for part in phase.parts:
            note = f"  ({part.note})" if part.note else ""
            lines.append(f"  {part.name:<44}{fmt_bytes(part.bytes):>14}{note}")
        bound = ">= " if phase.lower_bound else ""
        verdict = ""
        if plan.hbm_bytes:
            ok = phase.total <= plan.hbm_bytes and not phase.lower_bound
            verdict = f"  of {fmt_bytes(plan.hbm_bytes)} -> {'fits' if ok else 'DOES NOT FIT'}"
        lines.append(f"  {'TOTAL per device':<44}{bound + fmt_bytes(phase.total):>14}{verdict}")
    return "\n".join(lines)


def programs_table(plan: Plan) -> str:
    lines = [f"{'program':<24}{'compile':>9}{'temps':>12}{'TFLOP':>10}{'kernel':>10}{'HBM GB':>10}"
             + "".join(f"{short:>9}" for short in COLLECTIVE_SHORT.values()) + f"{'estimate':>12}  bound"]
    rooflines = plan.rooflines()
    for p in plan.programs:
        if p.error:
            lines.append(f"{p.name:<24}{p.compile_s:>8.1f}s  out of memory: {p.error}")
            continue
        line = rooflines.get(p.name)
        coll = "".join(f"{p.collectives.get(kind, 0) / 1e9:>8.2f}G" for kind in COLLECTIVE_SHORT)
        est = f"{fmt_seconds(line['estimate_s']):>12}  {line['bound']}" if line else f"{'-':>12}"
        lines.append(f"{p.name:<24}{p.compile_s:>8.1f}s{fmt_bytes(p.memory['temporaries']):>12}{p.flops / 1e12:>10.2f}"
                     f"{p.kernel_flops / 1e12:>10.2f}{p.bytes_accessed / 1e9:>10.2f}{coll}{est}")
        if p.uncounted:
            lines.append(f"  {p.name}: custom calls not counted: "
                         + ", ".join(f"{name} x{calls:g}" for name, calls in sorted(p.uncounted.items())))
    lines.append("per device and call; FLOPs and bytes count every loop iteration, the Pallas kernels' included "
                 "(kernel: their TFLOP); collective bytes are the arrays moved (AG all-gather, RS reduce-scatter, "
                 "AR all-reduce, A2A all-to-all, CP permute)")
    for kind, check in plan.flops_check().items():
        lines.append(f"{kind} step: {check['flops'] / 1e12:.2f} TFLOP compiled, {check['analytic_flops'] / 1e12:.2f} "
                     f"counted from the model (executed_step_flops): ratio {check['ratio']:.3f}")
    return "\n".join(lines)


def verdict_line(plan: Plan) -> str:
    if plan.fits is None:
        return f"peak per device {fmt_bytes(plan.per_device_bytes)} (no HBM limit: pass --chip or --hbm to judge)"
    word = "fits: true" if plan.fits else "fits: false"
    return f"{word}: peak per device {fmt_bytes(plan.per_device_bytes)} of {fmt_bytes(plan.hbm_bytes)}"


def render(plan: Plan) -> str:
    return "\n".join([header(plan), "", phase_table(plan), "", programs_table(plan), "", verdict_line(plan)])


def summary_lines(prediction: dict) -> list[str]:
    """A predicted step's lines: the synchronous step and the asynchronous one beside it; the
    config runs the one its `grpo.max_staleness` says."""
    p, r, u = prediction, prediction["rollout"], prediction["update"]
    staleness = p.get("max_staleness", 0)
    mine = lambda runs: f" <- grpo.max_staleness {staleness}" if runs else ""
    return [f"step {p['step_s']:.2f} s = rollout {p['rollout_s']:.2f} s + sync {p['sync_s']:.3f} s + update "
            f"{p['update_s']:.2f} s (synchronous){mine(not staleness)}",
            f"async step {p['async_step_s']:.2f} s = max(rollout, rollout - waits {r['wait_s']:.2f} s + sync + update) "
            f"on shared devices (bound {p['async_bound_s']:.2f} s = max(rollout, sync + update)){mine(staleness)}",
            f"  rollout: {r['engine_steps']:.0f} engine steps, {r['decode_calls']:.0f} decode calls "
            f"({r['decode_s']:.2f} s), {r['extend_calls']:.0f} extend calls ({r['extend_s']:.2f} s), waiting "
            f"{r['wait_s']:.2f} s; {r['sampled_tokens']:.0f} sampled tokens, longest row {r['longest_row']:.0f}",
            f"  {r['layout']} calls: computed over real tokens, extends {r['extend_computed_over_real']:.2f}, "
            f"decode {r['decode_computed_over_real']:.2f}",
            "  update: not planned (--phases)" if not u["calls"] else
            f"  update: {u['calls']} call(s) of {u['per_call_s']:.3f} s at length {u['length']:.0f}"
            + (f", {u['rows']:.0f} rows" if "rows" in u else "")
            + (f", recompute {u['recompute_s']:.2f} s" if u["recompute_s"] else ""),
            f"  {p['tokens_per_s_per_chip']:.1f} sampled tokens/s/chip; update MFU {p['update_mfu']:.1%} "
            f"(step {p['step_mfu']:.1%}) on the real tokens, over the {'async' if staleness else 'synchronous'} step"]


def comparison(this: dict, other: dict) -> dict:
    """This plan's summary beside another's (`python -m muajax.plan --compare`): devices, peak
    memory per device, the step and its parts, sampled tokens per second per chip."""
    keys = ("devices", "per_device_bytes", "fits", "step_s", "rollout_s", "update_s", "tokens_per_s_per_chip")
    pick = lambda d: {k: d.get(k) for k in keys} | {"model": d.get("model"), "topology": d.get("topology")}
    mine, theirs = pick(this), pick(other)
    timed = lambda d: bool(d.get("step_s")) and d.get("fits") is not False  # a step that cannot run has no time
    describe = lambda d: (f"{d['model']} on {d['topology']} ({d['devices']} chips): peak {fmt_bytes(d['per_device_bytes'])}"
                          f" a device, fits {str(d['fits']).lower()}" + (
                              f", step {d['step_s']:.2f} s (rollout {d['rollout_s']:.2f}, update {d['update_s']:.2f}), "
                              f"{d['tokens_per_s_per_chip']:.1f} sampled tokens/s/chip" if timed(d) else ""))
    ratio = this["step_s"] / other["step_s"] if timed(this) and timed(other) else None
    line = f"this plan: {describe(mine)}\nbeside:    {describe(theirs)}" + (
        f"\nstep ratio {ratio:.2f} (this / beside)" if ratio else "")
    return {"this": mine, "other": theirs, "step_ratio": ratio, "line": line}
