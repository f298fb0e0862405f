"""Timing and reporting helpers shared by every `python -m muajax.bench <name>` benchmark.

Rules these helpers enforce, so each benchmark does not have to:
- device work is waited for (`block`) before the clock stops: JAX dispatch is async;
- every candidate is warmed up (compilation, allocator, caches) before it is timed;
- candidates measured against each other run interleaved, alternating which goes first
  each round, so drift from other processes on a shared machine hits both alike;
- medians, not means: one descheduled run must not move the figure;
- the result is one JSON line, the last line of output (`emit_json`), finite numbers only.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any


class BenchError(Exception):
    """A benchmark cannot run as asked (bad option, missing dependency); the message says why."""


def block(x: Any) -> Any:
    """Wait until every JAX array in the pytree `x` is computed; other leaves pass through."""
    if "jax" in sys.modules:
        import jax

        for leaf in jax.tree.leaves(x):
            if hasattr(leaf, "block_until_ready"):
                leaf.block_until_ready()
    return x


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = block(fn())
    return time.perf_counter() - start, out


def measure(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 5) -> list[float]:
    for _ in range(warmup):
        block(fn())
    return [time_call(fn)[0] for _ in range(repeat)]


def interleave(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 1, repeat: int = 5,
               on_warmup: Callable[[str, Any], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call for each named candidate, `repeat` rounds of one call each.

    `on_warmup(name, output)` sees the last warm-up output (e.g. to check the candidates agree)."""
    if repeat < 1 or warmup < 0:
        raise BenchError(f"repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    names = list(fns)
    for name in names:
        out = None
        for _ in range(max(warmup, 1 if on_warmup else 0)):
            out = None  # let the previous output go before the next one is allocated
            out = block(fns[name]())
        if on_warmup is not None:
            on_warmup(name, out)
        del out
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(time_call(fns[name])[0])
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def summary(xs) -> dict:
    return {"median_s": median(xs), "min_s": float(min(xs)), "max_s": float(max(xs)), "n": len(xs)}


def ratio(a: float, b: float) -> float:
    return float(a / b) if b else float("nan")


_ISA_CAP: dict | None = None  # what `apply_isa_cap` capped in this process
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def add_isa_option(parser) -> None:
    parser.add_argument("--cap-isa", choices=("avx2",), default=None,
                        help="run XLA's generated loops and its kernel library (YNNPACK) as on a box without "
                             "AVX-512 (muajax.bench.isa_cap): a figure for an AVX2 box, measured on this one")


def apply_isa_cap(level: str | None) -> None:
    """Cap the ISA (`--cap-isa`) before JAX starts; `machine_info` then records it. The
    reference side is capped too where torch is not loaded yet (its own dispatch, MKL's and
    oneDNN's, each read from the environment when they load)."""
    global _ISA_CAP
    if level:
        from muajax.bench import isa_cap

        if "torch" not in sys.modules:
            os.environ.update(ATEN_CPU_CAPABILITY=level, MKL_ENABLE_INSTRUCTIONS=level.upper(),
                              DNNL_MAX_CPU_ISA=level.upper())

        try:
            _ISA_CAP = isa_cap.cap(level)
        except isa_cap.CapError as exc:
            raise BenchError(f"--cap-isa {level}: {exc}") from exc


def isa_cap_level() -> str | None:
    return _ISA_CAP["level"] if _ISA_CAP else None


def _cpu_facts() -> dict:
    """Model, vector ISA and caches of cpu0 (Linux), the box facts a CPU ratio can depend on."""
    facts: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return facts
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu_model" not in facts:
            facts["cpu_model"] = value.strip()
        elif key.strip() == "flags" and "isa" not in facts:
            flags = set(value.split())
            facts["isa"] = [f for f in _ISA_FLAGS if f in flags]
    caches = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            fields = {k: open(os.path.join(root, index, k)).read().strip() for k in ("level", "type", "size")}
            shared = open(os.path.join(root, index, "shared_cpu_list")).read().strip()
        except OSError:
            continue
        name = f"L{fields['level']}" + {"Data": "d", "Instruction": "i"}.get(fields["type"], "")
        caches[name] = f"{fields['size']} (cpus {shared})"
    if caches:
        facts["caches"] = caches
    return facts


def machine_info() -> dict:
    """What the figures depend on besides the code: the CPU (model, vector ISA, caches, cores
    this process may use), load from others, versions, flags, and an ISA cap if one was set."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "machine": platform.machine(),
        **_cpu_facts(),
        "isa_cap": isa_cap_level(),
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if "jax" in sys.modules:
        import jax

        info.update(jax_version=jax.__version__, jax_backend=jax.default_backend())
    if "torch" in sys.modules:
        import torch

        info.update(torch_version=torch.__version__, torch_threads=torch.get_num_threads())
    return info


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / jax scalars
        return _finite(x.item())
    return x


def emit_json(d: Mapping[str, Any]) -> str:
    """Print `d` as the single, final JSON line (NaN/inf become null: JSON has neither)."""
    line = json.dumps(_finite(d), allow_nan=False, sort_keys=False)
    sys.stdout.flush()
    print(line, flush=True)
    return line


def log(msg: str) -> None:
    """Human-readable progress, on stdout before the JSON line."""
    print(msg, flush=True)


def fill_size_args(args, full: dict, quick: dict):
    """Fill the model-size options left unset from the full or quick preset, then check them."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < 1:
            raise BenchError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.heads % args.kv_heads:
        raise BenchError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def build_hf_qwen3(args):
    """A random `Qwen3ForCausalLM` of the size in `args` (the reference side of a bench)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max(args.seq, 512), rope_theta=1_000_000.0,
        tie_word_embeddings=False, attn_implementation=args.attn)
    torch.manual_seed(args.seed)
    return transformers.Qwen3ForCausalLM(config)
