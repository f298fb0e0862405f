"""Plan a run on hardware you don't have: compile the GRPO train step and the engine's decode
step ahead of time, from abstract shapes, for a model and mesh, and report per-device
memory and FLOPs from XLA's own analyses.

    python -m muajax.plan --model qwen3-32b --mesh data=1,fsdp=16,tensor=4 \
        --batch 256 --seq 32768 --remat full --microbatch 16 --hbm 95GiB

Nothing is allocated: params, optimizer state, reference params, batch and KV cache are
ShapeDtypeStructs carrying their NamedShardings on a fake CPU mesh of as many devices as
the mesh names (the process re-executes itself with XLA_FLAGS set if it must). The
numbers are XLA:CPU's for the partitioned per-device program; a TPU compile fuses and
schedules differently (and keeps bf16 natively where CPU may widen it), so treat them as
a close estimate, not a guarantee. XLA's FLOP count visits a while-loop body once: with
layers under scan it undercounts, so the analytic model FLOPs are printed beside it.

The last line printed is one JSON object: per_device_bytes, fits, and the breakdown.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

_REEXEC_MARK = "MUAJAX_PLAN_REEXEC"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read a memory size from {text!r} (e.g. 95GiB, 16GB, 1e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_mesh(text: str) -> dict:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected data=N,fsdp=N,tensor=N with N >= 1")
        sizes[name.strip()] = int(value)
    return sizes


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m muajax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a preset (qwen3-0.6b ... qwen3-32b) or a JSON object of Qwen3Config fields")
    p.add_argument("--mesh", type=parse_mesh, default=parse_mesh("fsdp=1"), help="data=N,fsdp=N,tensor=N")
    p.add_argument("--batch", type=int, default=256, help="GRPO batch (rollouts per step)")
    p.add_argument("--seq", type=int, default=32768, help="padded sequence length")
    p.add_argument("--microbatch", type=int, default=None, help="rows per microbatch (default: the batch)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default="full")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="compute dtype")
    p.add_argument("--kl-coef", type=float, default=0.001, help="0: no reference model")
    p.add_argument("--logits-chunk", type=int, default=None,
                   help="positions per LM-head chunk (bounds the [B, T, V] logits)")
    p.add_argument("--hbm", type=parse_bytes, default=None, help="per-device memory, e.g. 95GiB (v5p)")
    p.add_argument("--decode-slots", type=int, default=None, help="KV slots (default: --batch)")
    p.add_argument("--decode-len", type=int, default=None, help="KV cache length (default: --seq)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    return p


def _ensure_devices(n: int, argv: list[str], allow_reexec: bool) -> None:
    """Make the CPU backend expose n devices: set XLA_FLAGS before jax starts, or re-exec
    (only as a command: re-executing would replace a library caller's process)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    want = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"], os.environ["JAX_PLATFORMS"] = want, "cpu"
        return
    import jax

    if jax.default_backend() == "cpu" and len(jax.devices()) == n:
        return
    if os.environ.get(_REEXEC_MARK) or not allow_reexec:
        raise SystemExit(f"plan: needs {n} CPU devices but jax already started with {len(jax.devices())} "
                         f"{jax.default_backend()} device(s); run `python -m muajax.plan ...` in a fresh process")
    env = dict(os.environ, XLA_FLAGS=want, JAX_PLATFORMS="cpu", **{_REEXEC_MARK: "1"})
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "muajax.plan", *argv], env)


def model_config(args):
    from muajax.models.presets import preset_config
    from muajax.models.qwen3 import Qwen3Config

    common = dict(param_dtype=args.param_dtype, dtype=args.dtype, remat=args.remat)
    text = args.model.strip()
    if text.startswith("{"):
        return Qwen3Config(**{**json.loads(text), **common})
    return preset_config(text, **common)


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
           "code": m.generated_code_size_in_bytes}
    # Donated inputs are reused for outputs: count them once.
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["code"]
    return out


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def plan_train(args, cfg, mesh) -> dict:
    import jax
    import jax.numpy as jnp

    from muajax import parallel
    from muajax.rl.optim import make_optimizer
    from muajax.models.flops import forward_flops
    from muajax.rl.grpo import GRPOConfig, make_grpo_step
    from muajax.rl.step import model_abstract_params

    k = 1 if args.microbatch is None else args.batch // args.microbatch
    if args.microbatch is not None and args.batch % args.microbatch:
        raise SystemExit(f"plan: --microbatch {args.microbatch} must divide --batch {args.batch}")
    opts = GRPOConfig(kl_coef=args.kl_coef, logits_chunk=args.logits_chunk)
    step = make_grpo_step(cfg, make_optimizer(1e-6), mesh, grpo=opts, num_groups=args.batch, microbatches=k)
    params = model_abstract_params(cfg)
    state = step.abstract_state(params)
    b, t = args.batch, args.seq
    batch = {"tokens": ((b, t), jnp.int32), "loss_mask": ((b, t), jnp.int32),
             "old_logprobs": ((b, t), jnp.float32), "rewards": ((b,), jnp.float32),
             "group_ids": ((b,), jnp.int32)}
    batch = {n: jax.ShapeDtypeStruct(s, d, sharding=parallel.batch_sharding(mesh, len(s))) for n, (s, d) in batch.items()}
    extra = ()
    if opts.uses_reference:
        # The reference policy is only read, in the compute dtype: half the bytes of fp32.
        extra = (jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, cfg.compute_dtype, sharding=s),
                              params, step.frozen_shardings),)
    t0 = time.perf_counter()
    lowered = step.lower(state, batch, *extra)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = _memory(compiled)
    mem.update(params=shard_bytes(state.params), optimizer_state=shard_bytes(state.opt_state),
               reference_params=shard_bytes(extra[0]) if extra else 0, batch=shard_bytes(batch))
    # Model FLOPs (no remat recompute): forward + backward (2x forward) + the reference forward.
    model_flops = forward_flops(cfg, b, t) * (4 if opts.uses_reference else 3)
    return {"memory": mem, "microbatches": k, "xla_flops": _flops(compiled),
            "model_flops": model_flops / mesh.size, "lower_s": t1 - t0, "compile_s": t2 - t1}


def plan_decode(args, cfg, mesh) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from muajax import parallel
    from muajax.models.qwen3 import CACHE_AXES, KVCache, cache_shape, forward
    from muajax.models.sharding import param_shardings
    from muajax.models.flops import forward_flops
    from muajax.rl.step import model_abstract_params

    slots = args.decode_slots or args.batch
    max_len = args.decode_len or args.seq
    shape = cache_shape(cfg, slots, max_len)
    kv_sh = NamedSharding(mesh, parallel.logical_to_spec(shape, CACHE_AXES, mesh))
    len_sh = NamedSharding(mesh, parallel.logical_to_spec((slots,), ("cache_batch",), mesh))
    cache = KVCache(jax.ShapeDtypeStruct(shape, cfg.compute_dtype, sharding=kv_sh),
                    jax.ShapeDtypeStruct(shape, cfg.compute_dtype, sharding=kv_sh),
                    jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=len_sh))
    p_sh = param_shardings(cfg, mesh)
    params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                          model_abstract_params(cfg), p_sh)
    tok_sh = parallel.batch_sharding(mesh, 2)
    tokens = jax.ShapeDtypeStruct((slots, 1), jnp.int32, sharding=tok_sh)
    cache_sh = KVCache(kv_sh, kv_sh, len_sh)
    logits_sh = NamedSharding(mesh, parallel.logical_to_spec(
        (slots, 1, cfg.vocab_size), ("activation_batch", "activation_length", "activation_vocab"), mesh))
    fn = jax.jit(lambda p, c, x: forward(p, cfg, x, cache=c), in_shardings=(p_sh, cache_sh, tok_sh),
                 out_shardings=(logits_sh, cache_sh), donate_argnums=(1,))
    with parallel.activation_rules(mesh):
        t0 = time.perf_counter()
        lowered = fn.lower(params, cache, tokens)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    mem = _memory(compiled)
    mem.update(params=shard_bytes(params), kv_cache=shard_bytes(cache))
    model_flops = forward_flops(cfg, slots, 1, keys=max_len)
    return {"memory": mem, "slots": slots, "max_len": max_len, "xla_flops": _flops(compiled),
            "model_flops": model_flops / mesh.size, "lower_s": t1 - t0, "compile_s": t2 - t1}


def _print_report(args, cfg, mesh_sizes, results) -> None:
    print(f"model {args.model}: {cfg.num_params() / 1e9:.2f}B params, {cfg.num_layers} layers, "
          f"param {cfg.param_dtype}, compute {cfg.dtype}, remat {cfg.remat}")
    print(f"mesh {mesh_sizes} = {math.prod(mesh_sizes.values())} devices; batch {args.batch} x seq {args.seq}")
    rows = [("parameters", "params"), ("optimizer state", "optimizer_state"), ("reference params", "reference_params"),
            ("KV cache", "kv_cache"), ("batch", "batch"), ("all arguments", "arguments"), ("outputs", "outputs"),
            ("  (donated, reused)", "aliased"), ("temporaries", "temporaries"), ("TOTAL per device", "total")]
    names = list(results)
    print(f"{'per device':<22}" + "".join(f"{n:>16}" for n in names))
    for label, key in rows:
        cells = [results[n]["memory"].get(key) for n in names]
        if all(c is None for c in cells):
            continue
        print(f"{label:<22}" + "".join(f"{fmt_bytes(c) if c is not None else '-':>16}" for c in cells))
    for label, key in (("XLA FLOPs (loop body 1x)", "xla_flops"), ("model FLOPs / device", "model_flops")):
        print(f"{label:<22}" + "".join(f"{results[n][key]:>16.3e}" for n in names))
    print(f"{'lower / compile s':<22}" + "".join(
        f"{results[n]['lower_s']:>7.1f} /{results[n]['compile_s']:>6.1f}" for n in names))
    if args.hbm:
        for n in names:
            need = results[n]["memory"]["total"]
            verdict = "fits" if need <= args.hbm else "DOES NOT FIT"
            print(f"{n}: {fmt_bytes(need)} of {fmt_bytes(args.hbm)} -> {verdict}")


def main(argv: list[str] | None = None, *, allow_reexec: bool = False) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.skip_train and args.skip_decode:
        raise SystemExit("plan: nothing to do (--skip-train and --skip-decode)")
    _ensure_devices(math.prod(args.mesh.values()), argv, allow_reexec)

    from muajax import parallel

    cfg = model_config(args)
    mesh = parallel.make_mesh(args.mesh["data"], args.mesh["fsdp"], args.mesh["tensor"])
    results = {}
    if not args.skip_train:
        results["train"] = plan_train(args, cfg, mesh)
    if not args.skip_decode:
        results["decode"] = plan_decode(args, cfg, mesh)
    _print_report(args, cfg, args.mesh, results)
    per_device = max(r["memory"]["total"] for r in results.values())
    summary = {"model": args.model, "mesh": args.mesh, "batch": args.batch, "seq": args.seq,
               "remat": args.remat, "microbatches": results.get("train", {}).get("microbatches"),
               "per_device_bytes": per_device, "hbm_bytes": args.hbm,
               "fits": None if args.hbm is None else bool(per_device <= args.hbm),
               "breakdown": {name: {**r["memory"], "xla_flops": r["xla_flops"], "model_flops": r["model_flops"],
                                    "compile_s": round(r["compile_s"], 2)} for name, r in results.items()}}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(allow_reexec=True)
