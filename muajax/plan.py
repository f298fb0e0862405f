"""Plan a run on hardware you don't have: compile the programs a GRPO run executes (the
engine's decode and extend, the GRPO update, the SFT update) ahead of time for a TPU slice
with the real TPU compiler (libtpu), from abstract sharded shapes, and sum what each phase
keeps resident.

    python -m muajax.plan --config configs/runs/qwen3-32b-tau2-v5p.yaml
    python -m muajax.plan --model qwen3-8b --topology v5p-64 --batch 256 --seq 32768 \\
        --mesh data=1,fsdp=16,tensor=2 --microbatch 16 --remat full
    python -m muajax.plan --model qwen3-8b --topology v5p-64 --sweep --out plans/8b-v5p64

`--config` plans exactly what the trainer runs for that config (model, mesh, dtypes, remat,
attention, GRPO and SFT microbatching and padding, the reference model, the engine) on the
topology the config names (`mesh.topology`); `--set key=value` overrides the config as the
trainer's own overrides do. Without a config, `--model` and the flags describe the run.

Topologies: v5p-N and v4-N (N TensorCores, two per chip), v6e-N and v5e-N (N chips), an
explicit chip grid such as v5p:4x4x4, cpu:N (N fake CPU devices, XLA:CPU; judged against
--chip or --hbm), or h100:N / a100:N (XLA:CPU judged against the share of that GPU the
trainer lets jax take, run.gpu_memory_fraction: an estimate). A TPU
topology needs libtpu: pip install -e ".[tpu]".

The last line printed is one JSON object: per_device_bytes (the peak over the phases),
phases with their parts, fits, devices, compiler, and each program's costs; with a rollout
profile the step's seconds too: step_s (synchronous), async_step_s (grpo.max_staleness >= 1:
the rollout overlapping the update, `planning.step_time`) and run_step_s (the config's). Exit status:
0 fits (or nothing to judge against), 1 does not fit, 2 libtpu missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from muajax import parallel
from muajax.config.schema import SFTConfig, TrainConfig, load_config
from muajax.models.presets import preset_config
from muajax.models.qwen3 import REMAT_POLICIES, Qwen3Config
from muajax.planning import report, sweep
from muajax.chips import get_chip
from muajax.planning.planner import PHASES, PlanSettings, from_train_config, plan_run
from muajax.planning.programs import EngineSettings
from muajax.planning.profile_mix import default_profile
from muajax.planning.rollout_profile import Distribution, RolloutProfile
from muajax.planning.run_config import domain_facts, model_from_config
from muajax.planning.topology import LibtpuMissingError, devices_for, judged_hbm, parse_topology
from muajax.rl.grpo import GRPOConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# Flags that describe the run itself: a config describes it instead (change it with --set).
DEFAULT_LOGITS_CHUNK = 2048  # LM-head positions at a time: never [rows, 32K, 152K] logits
RUN_FLAGS = ("model", "batch", "seq", "microbatch", "minibatch", "remat", "param_dtype", "dtype",
             "kl_coef", "logits_chunk", "slots", "max_len", "kv_cache_tokens", "page_size", "sft_batch",
             "sft_microbatch", "keep_kv_pool")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read a memory size from {text!r} (e.g. 95GiB, 16GB, 1e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_mesh(text: str) -> dict[str, int]:
    """"data=1,fsdp=16,tensor=4" -> sizes of parallel.MESH_AXES (unnamed axes 1; one may be -1)."""
    sizes = {axis: 1 for axis in parallel.MESH_AXES}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name not in sizes or not re.fullmatch(r"-1|[1-9]\d*", value):
            axes = ",".join(f"{a}=N" for a in parallel.MESH_AXES)
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected {axes} with N >= 1 (or one -1: the rest)")
        sizes[name] = int(value)
    return sizes


def _phases(text: str) -> tuple[str, ...]:
    phases = tuple(p.strip() for p in text.split(",") if p.strip())
    if not phases or set(phases) - set(PHASES):
        raise argparse.ArgumentTypeError(f"--phases {text!r}: a comma-separated subset of {','.join(PHASES)}")
    return phases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m muajax.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a run config (configs/runs/X.yaml): plan what the trainer runs")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="override the config")
    p.add_argument("--model", default=None, help="a preset (qwen3-0.6b ... qwen3-32b) or a JSON object of "
                   "Qwen3Config fields (without --config)")
    p.add_argument("--topology", default=None, help="v5p-64, v6e-16, v5p:4x4x4, cpu:8, h100:8 (default: the "
                   "config's mesh.topology, else cpu:<mesh size>)")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help=f"{','.join(a + '=N' for a in parallel.MESH_AXES)}; one axis may be -1 (default: the config's, "
                   "else fsdp=-1)")
    # the run, without a config
    p.add_argument("--batch", type=int, default=None, help="rollouts per GRPO step (default 256)")
    p.add_argument("--seq", type=int, default=None, help="padded sequence length (default 32768)")
    p.add_argument("--microbatch", type=int, default=None,
                   help="rows per microbatch (default: one row per batch device, data x fsdp: the least memory)")
    p.add_argument("--minibatch", type=int, default=None, help="rows per optimizer update (default: the batch)")
    p.add_argument("--remat", choices=REMAT_POLICIES, default=None, help="default full")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None, help="default float32")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="compute dtype (default bfloat16)")
    p.add_argument("--kl-coef", type=float, default=None, help="0: no reference model (default 0.001)")
    p.add_argument("--logits-chunk", type=int, default=None,
                   help=f"grpo.logits_chunk (default {DEFAULT_LOGITS_CHUNK}, as the shipped configs; 0: none)")
    p.add_argument("--slots", type=int, default=None, help="engine KV slots (default: --batch)")
    p.add_argument("--max-len", type=int, default=None, help="engine context length (default: --seq)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="engine pool (default slots x max-len)")
    p.add_argument("--page-size", type=int, default=None, help="engine page size (default: the engine's)")
    p.add_argument("--sft-batch", type=int, default=None, help="default 128")
    p.add_argument("--sft-microbatch", type=int, default=None)
    # either way
    p.add_argument("--sft-seq", type=int, default=None, help="SFT padded length (default: sft.max_len / --seq)")
    p.add_argument("--prompt-prefix", type=int, default=None,
                   help="tokens every conversation starts with (default: with --config, the system prompt measured "
                        "from its domain; else 0); the step computes them once where the trainer would")
    p.add_argument("--keep-kv-pool", action="store_true", default=None,
                   help="the engine keeps its KV pool through the update (rollout.keep_kv_pool; with --config "
                        "set that key instead)")
    p.add_argument("--phases", type=_phases, default=None,
                   help=f"subset of {','.join(PHASES)} (default: the config's stages, else rollout,update)")
    p.add_argument("--chip", default=None, help="judge a cpu:N plan against this chip (h100, a100, v5p, ...)")
    p.add_argument("--hbm", type=parse_bytes, default=None, help="override the usable memory per device, e.g. 80GB")
    p.add_argument("--exact-oom", action="store_true", help="compile programs that cannot fit to the end, for "
                   "their exact memory (slow; by default the compiler gives up early and its message gives a "
                   "lower bound)")
    p.add_argument("--sweep", action="store_true", help="rank meshes x remat policies by the predicted GRPO step "
                   "(with --rollout-profile; else by the update's estimated time)")
    p.add_argument("--remats", default="full,dots,dots_no_batch",
                   help="remat policies the sweep tries, the first on every mesh (default leaves out 'none': at 32K "
                        "its update took 20-58 min to compile per mesh on a 2-core machine, against 35-95 s for full)")
    p.add_argument("--refine", default="4", help="try the other --remats on this many of the fastest meshes that fit "
                   "with the first, or 'all' for every mesh")
    p.add_argument("--meshes", default=None,
                   help="meshes the sweep tries, ';'-separated like --mesh (default: every factorization)")
    p.add_argument("--out", default="plans/sweep", help="where --sweep writes sweep.csv, sweep.json and sweep.png")
    p.add_argument("--rollout-profile", default=None, metavar="PATH_OR_RUN_DIR", help="predict the GRPO step's "
                   "time for this rollout profile (configs/profiles/*.json, or a run directory's metrics)")
    p.add_argument("--user-latency", type=float, default=None, metavar="SECONDS", help="each user reply arrives "
                   "this long after the agent's turn (default: the profile's; τ2's shipped profiles record none: 0). "
                   "It lengthens the rollout, and the asynchronous step hides the update in those waits")
    p.add_argument("--compare", default=None, metavar="PLAN_JSON", help="print this plan beside another's: a file "
                   "holding that plan's last line (its JSON), e.g. the dense model's, for the step, memory and throughput")
    p.add_argument("--calibrate", default=None, metavar="RUN_DIR", help="the predicted step time beside this run's "
                   "measured medians (its own profile unless --rollout-profile)")
    return p


def parse_refine(text: str) -> int | None:
    if text.strip() == "all":
        return None
    if not text.strip().isdigit():
        raise SystemExit(f"plan: --refine {text!r}: a number of meshes, or 'all'")
    return int(text)


def _or(value, default):
    return default if value is None else value


def model_from_flags(args) -> Qwen3Config:
    run = {"param_dtype": _or(args.param_dtype, "float32"), "dtype": _or(args.dtype, "bfloat16"),
           "remat": _or(args.remat, "full")}
    text = args.model.strip()
    if text.startswith("{"):
        return Qwen3Config(**{**json.loads(text), **run})
    return preset_config(text, **run)


def settings_from_flags(args) -> PlanSettings:
    batch, seq = _or(args.batch, 256), _or(args.seq, 32768)
    chunk = _or(args.logits_chunk, DEFAULT_LOGITS_CHUNK) or None
    grpo = GRPOConfig(kl_coef=_or(args.kl_coef, 0.001), microbatch_size=args.microbatch,
                      minibatch_size=args.minibatch, logits_chunk=chunk)
    sft = SFTConfig(batch_size=_or(args.sft_batch, 128), microbatch_size=args.sft_microbatch, max_len=seq)
    engine = EngineSettings(num_slots=_or(args.slots, batch), max_len=_or(args.max_len, seq),
                            kv_cache_tokens=args.kv_cache_tokens, page_size=args.page_size)
    return PlanSettings(batch=batch, seq=seq, grpo=grpo, sft=sft,
                        sft_seq=args.sft_seq, prompt_prefix=args.prompt_prefix or 0, engine=engine,
                        keep_kv_during_update=bool(args.keep_kv_pool),
                        phases=args.phases or ("rollout", "update"), exact_oom=args.exact_oom)


def smallest_microbatches(settings: PlanSettings, args, sizes: dict[str, int]) -> PlanSettings:
    """Without --microbatch / --sft-microbatch: one row per batch device per microbatch, the
    least memory a step can take (the trainer splits a step's rows no finer)."""
    rows = math.prod(sizes.get(axis, 1) for axis in parallel.BATCH_AXES)
    grpo, sft = settings.grpo, settings.sft
    if args.microbatch is None and settings.update_rows > rows:
        grpo = dataclasses.replace(grpo, microbatch_size=rows)
    if args.sft_microbatch is None and sft.batch_size > rows:
        sft = dataclasses.replace(sft, microbatch_size=rows)
    return dataclasses.replace(settings, grpo=grpo, sft=sft)


def rollout_profile(args, facts=None) -> RolloutProfile | None:
    """--rollout-profile's, else with --config the shipped profiles of its τ2 domains mixed by
    their training tasks (`profile_mix.default_profile`), else None (no step time); with
    --user-latency, its users answer after that many seconds."""
    if args.rollout_profile:
        profile = RolloutProfile.load(args.rollout_profile)
    elif facts is None:
        return None
    else:
        profile = default_profile(facts.train_tasks)
        if profile is not None:
            print(f"plan: rollout profile {profile.name} (the shipped τ2 profiles; --rollout-profile to choose)",
                  flush=True)
    if profile is not None and args.user_latency is not None:
        if args.user_latency < 0:
            raise SystemExit(f"plan: --user-latency {args.user_latency}: seconds, at least 0")
        profile = dataclasses.replace(profile, name=f"{profile.name}, users answering in {args.user_latency:g} s",
                                      user_latency_s=Distribution(args.user_latency))
    return profile


def describe_run(args) -> tuple[Qwen3Config, str, PlanSettings, dict, str | None, RolloutProfile | None]:
    """(model, label, settings, mesh, topology, rollout profile) from --config or from the flags."""
    if args.config is None:
        if args.model is None:
            raise SystemExit("plan: give --config configs/runs/X.yaml or --model")
        mesh = args.mesh or {axis: (-1 if axis == "fsdp" else 1) for axis in parallel.MESH_AXES}
        return model_from_flags(args), args.model, settings_from_flags(args), mesh, args.topology, rollout_profile(args)
    given = [f"--{name.replace('_', '-')}" for name in RUN_FLAGS if getattr(args, name) is not None]
    if given:
        raise SystemExit(f"plan: {', '.join(given)} with --config: the config describes the run; change it with "
                         f"--set key=value (e.g. --set grpo.microbatch_size=16)")
    cfg = load_config(args.config, args.set)
    model, label, source = model_from_config(cfg)
    print(f"plan: {args.config}: model from {source}", flush=True)
    overrides = {"phases": args.phases} if args.phases else {}
    facts = domain_facts(cfg)
    prefix = facts.prompt_prefix if args.prompt_prefix is None else args.prompt_prefix
    print(f"plan: the training conversations share a {facts.prompt_prefix}-token system prompt"
          + (f" (planned as {prefix})" if prefix != facts.prompt_prefix else "")
          + f"; the evaluation holds {facts.eval_conversations} conversations", flush=True)
    settings = from_train_config(cfg, prompt_prefix=prefix, eval_slots=facts.eval_conversations,
                                 sft_seq=args.sft_seq,
                                 exact_oom=args.exact_oom, **overrides)
    mesh = args.mesh or cfg.mesh.sizes()
    topology = args.topology or cfg.mesh.topology
    if topology is None:
        raise SystemExit(f"plan: {args.config} names no mesh.topology (the slice it is sized for): pass --topology")
    return model, label, settings, mesh, topology, rollout_profile(args, facts)


def read_plan_json(path: str) -> dict:
    """The last line of `path` that is a JSON object: a plan's summary as this command prints it."""
    with open(path) as f:
        for line in reversed(f.read().splitlines()):
            if line.strip().startswith("{"):
                return json.loads(line)
    raise SystemExit(f"plan: --compare {path}: no plan's JSON line in it")


def gpu_memory_fraction(args) -> float:
    """The share of a GPU the trainer lets jax take: the config's run.gpu_memory_fraction, else its default."""
    return (load_config(args.config, args.set) if args.config else TrainConfig()).run.gpu_memory_fraction


def main(argv: list[str] | None = None, *, allow_reexec: bool = False) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    cfg, label, settings, mesh, topology, profile = describe_run(args)
    known = [v for v in mesh.values() if v != -1]
    spec = parse_topology(topology or f"cpu:{max(1, math.prod(known))}")
    try:
        devices = devices_for(spec, argv if allow_reexec else None)
    except LibtpuMissingError as error:
        print(f"plan: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    chip = spec.chip or (get_chip(args.chip) if args.chip else None)
    fraction = gpu_memory_fraction(args)
    hbm, share = (args.hbm, None) if args.hbm else judged_hbm(chip, fraction)
    if share:
        print(f"plan: {share}", flush=True)
    if spec.gpu:
        print(f"plan: {spec.describe()}: an estimate, not the GPU compiler's figures", flush=True)
    if args.sweep:
        remats = tuple(r.strip() for r in args.remats.split(",") if r.strip())
        if not remats or set(remats) - set(REMAT_POLICIES):
            raise SystemExit(f"plan: --remats {args.remats!r}: a comma-separated subset of {','.join(REMAT_POLICIES)}")
        meshes = None
        if args.meshes:
            meshes = [dict(zip(parallel.MESH_AXES, parallel.resolve_mesh_shape(*parse_mesh(m).values(), len(devices))))
                      for m in args.meshes.split(";") if m.strip()]
        rollout = load_config(args.config, args.set).rollout if args.config else None
        result = sweep.run_sweep(cfg, label, devices=devices, settings=settings, remats=remats, topology=spec.text,
                                 chip=chip, hbm_bytes=hbm, out_dir=args.out, meshes=meshes,
                                 refine=parse_refine(args.refine), profile=profile, rollout=rollout, log=print)
        print(json.dumps(result["summary"]))
        return result["summary"]
    sizes = dict(zip(parallel.MESH_AXES, parallel.resolve_mesh_shape(*mesh.values(), len(devices))))
    if args.config is None:
        settings = smallest_microbatches(settings, args, sizes)
    plan = plan_run(cfg, devices=devices, mesh=sizes, settings=settings, label=label, topology=spec.text, chip=chip,
                    hbm_bytes=hbm, log=lambda line: print(line, flush=True))
    print(report.render(plan))
    summary = plan.to_json()
    if spec.gpu:
        summary["estimate"] = spec.describe()
    if share:
        summary["gpu_memory_fraction"] = fraction
    if profile is not None or args.calibrate:
        from muajax.planning.calibration import step_report
        rollout = load_config(args.config, args.set).rollout if args.config else None
        chosen = None if args.calibrate and not args.rollout_profile else profile  # a calibration: the run's own
        summary["step_time"], lines = step_report(plan, profile=chosen, run_dir=args.calibrate,
                                                  rollout=rollout, hosts=len({d.process_index for d in devices}))
        prediction = summary["step_time"].get("prediction", summary["step_time"])  # a calibration nests it
        summary.update({key: prediction[key] for key in ("rollout_s", "sync_s", "update_s", "step_s", "async_step_s",
                                                           "async_bound_s", "max_staleness", "run_step_s",
                                                           "tokens_per_s_per_chip", "update_mfu")})
        print("\n".join(lines))
    if args.compare:
        summary["compared_with"] = report.comparison(summary, read_plan_json(args.compare))
        print(summary["compared_with"]["line"])
    print(json.dumps(summary))
    if plan.fits is False:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main(allow_reexec=True)
