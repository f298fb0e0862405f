"""`python -m muajax.bench device`: on whatever backend jax has, the checks only hardware can
settle, and the absolute figures of the chip.

Checks (each prints PASS/FAIL with its measured error and tolerance, `device_checks`):
  logits_float32, logits_bfloat16  muajax's logits against transformers' (PyTorch, host CPU)
      on a random Qwen3-0.6B-shaped checkpoint built with transformers (norm weights
      randomised too), ragged right-padded prompts: float32 max |Δlogit|, bfloat16 mean KL;
  greedy_tokens  the engine's greedy tokens (float32) against HF `generate`;
  attention_<impl>  every training attention this backend has (chunked everywhere, splash
      on TPU, cuDNN on GPU) against the einsum reference, forward and backward, on packed
      rows with padding;
  grpo_step  one GRPO update (`muajax.rl.grpo.make_grpo_step`) on the device against the
      same update on the host CPU: loss and gradient norm (on a CPU backend both are the
      CPU: the check then only shows the step runs, moves the params and stays finite).
Figures: decode tokens/s (the engine, greedy, bfloat16, warm) and the GRPO update's model
FLOP/s and MFU against the chip's peak from `muajax.chips` (bfloat16 compute; the reduced
form times the grpo_step check's float32 update); a device the table does not know (a CPU)
has no peak: `peak_flops` and `mfu` are null.

`--reduced` (the default on a CPU backend; `--full` forces the 0.6B shape) runs a tiny model
of the same form: the test suite runs it so the check cannot rot. The output ends with one
JSON line; the exit status is 1 when a check fails.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from muajax.bench.common import BenchError, log, machine_info

# Qwen3-0.6B (configs/models/qwen3-0.6b.yaml) and a tiny model of the same form (tied
# embeddings, grouped-query attention, head_dim 128 -> 32).
FULL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128)
REDUCED = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SHARED = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True)
# per form: prompt lengths, greedy tokens, attention [B, T, N, K, H], GRPO check rows x tokens,
# decode slots / prompt / new tokens, timed update rows x tokens
SIZES = {
    "full": dict(prompts=[61, 40, 23], greedy=16, attention=(2, 1024, 16, 8, 128), grpo=(2, 128),
                 decode=(8, 64, 128), update=(8, 1024)),
    "reduced": dict(prompts=[19, 11], greedy=8, attention=(2, 150, 4, 2, 64), grpo=(2, 32),
                    decode=(2, 8, 16), update=(2, 64)),
}
CHECKS = ("logits", "greedy", "attention", "grpo", "figures")


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench device", description=__doc__.split("\n\n")[0])
    form = p.add_mutually_exclusive_group()
    form.add_argument("--reduced", action="store_true", help="a tiny model of the 0.6B's form (default on CPU)")
    form.add_argument("--full", action="store_true", help="the Qwen3-0.6B shape (default on an accelerator)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each figure (median)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown or not args.checks:
        raise BenchError(f"--checks {','.join(unknown) or '(none)'}: choose from {','.join(CHECKS)}")
    if args.repeat < 1:
        raise BenchError(f"--repeat must be >= 1, got {args.repeat}")
    return args


def build_checkpoint(path: str, arch: dict, seed: int) -> str:
    """A random `Qwen3ForCausalLM` of `arch` saved in float32 (norms randomised around 1)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**arch, **SHARED)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


def decode_figure(hf_dir: str, slots: int, prompt: int, new: int, repeat: int, seed: int) -> dict:
    """Greedy decode tokens/s of the engine (bfloat16), warm: `slots` prompts of `prompt`
    tokens, `new` tokens each, timed from after the prefill (median of `repeat`)."""
    from muajax.bench.device_checks import muajax_model, prompts
    from muajax.engine.engine import Engine, SamplingParams

    params, cfg = muajax_model(hf_dir, "bfloat16")
    engine = Engine(params, cfg, num_slots=slots, max_len=prompt + new + 1, stop_ids=())
    rows = prompts(cfg.vocab_size, [prompt] * slots, seed)
    times = []
    for i in range(repeat + 1):  # the first run compiles
        opened = [engine.open(r) for r in rows]
        engine.flush(opened, keep_last=True)
        start = time.perf_counter()
        gens = engine.generate(opened, SamplingParams(temperature=0.0, max_new_tokens=new))
        elapsed = time.perf_counter() - start
        if any(len(gens[s].tokens) != new for s in opened):
            raise BenchError(f"the engine generated {[len(gens[s].tokens) for s in opened]} tokens, asked for {new}")
        for s in opened:
            engine.release(s)
        if i:
            times.append(elapsed)
    seconds = statistics.median(times)
    return {"decode_tokens_per_s": slots * new / seconds, "decode_s": seconds, "decode_slots": slots,
            "decode_prompt_tokens": prompt, "decode_new_tokens": new, "decode_dtype": "bfloat16",
            "decode_times_s": times, "decode_step_ms": 1e3 * seconds / new}


def update_figure(hf_dir: str, rows: int, length: int, repeat: int, seed: int, compiled=None) -> dict:
    """The GRPO update's wall time (warm, median), model FLOPs (`muajax.models.flops`) and
    MFU against the chip's peak (`muajax.chips`; None for a device the table lacks). On an
    accelerator: float32 master weights, bfloat16 compute (a run's setting), `rows` x `length`;
    `compiled` (the reduced form): time the grpo_step check's own update instead."""
    import jax

    from muajax.bench.device_checks import grpo_batch, grpo_step_on, muajax_model, precision
    from muajax.chips import chip_for_device_kind
    from muajax.models.flops import train_step_flops

    device = jax.devices()[0]
    if compiled is None:
        params, cfg = muajax_model(hf_dir, "float32")
        batch = grpo_batch(cfg.vocab_size, rows, length, seed)
        _, _, step, state = grpo_step_on(device, params, cfg.replace(dtype="bfloat16"), batch)  # compiles
    else:
        step, state, batch = compiled
    rows, length = batch["tokens"].shape
    times = []
    with precision(step.model_cfg):  # as it was compiled
        for _ in range(repeat):
            start = time.perf_counter()
            jax.block_until_ready(step(state, batch))
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = train_step_flops(step.model_cfg, rows, length)
    chip = chip_for_device_kind(getattr(device, "device_kind", ""))
    peak = chip.peak_flops if chip else None
    return {"update_s": seconds, "update_times_s": times, "update_rows": int(rows), "update_tokens": int(length),
            "update_dtype": step.model_cfg.dtype, "update_model_flops": flops,
            "update_tflops_per_s": flops / seconds / 1e12, "chip": chip.name if chip else None, "peak_flops": peak,
            "mfu": flops / seconds / peak if peak else None,
            "peak_note": None if peak else f"peak unknown for device kind {getattr(device, 'device_kind', '?')!r} "
                                           "(not in muajax.chips): no MFU"}


def run_checks(args, hf_dir: str, arch: dict, sizes: dict, backend: str) -> tuple[list, dict]:
    """The checks asked for, in order, and what the figures may reuse (the GRPO update)."""
    from muajax.bench import device_checks as dc

    checks, reuse = [], {}

    def add(check):
        log(check.line())
        checks.append(check)

    rows = dc.prompts(arch["vocab_size"], sizes["prompts"], args.seed)
    if "logits" in args.checks:
        add(dc.logits_check(hf_dir, "float32", rows))
        add(dc.logits_check(hf_dir, "bfloat16", rows))
    if "greedy" in args.checks:
        add(dc.greedy_check(hf_dir, rows, sizes["greedy"]))
    if "attention" in args.checks:
        for impl, dtype in dc.attention_impls(backend):
            add(dc.attention_check(impl, dtype, sizes["attention"], args.seed))
    if "grpo" in args.checks:
        params, cfg = dc.muajax_model(hf_dir, "float32")
        check, reuse["grpo"] = dc.grpo_check(params, cfg, dc.grpo_batch(cfg.vocab_size, *sizes["grpo"], args.seed))
        add(check)
    return checks, reuse


def run(argv=None) -> dict:
    args = parse(argv)
    import jax

    backend = jax.default_backend()
    reduced = args.reduced or (not args.full and backend == "cpu")
    form = "reduced" if reduced else "full"
    arch, sizes = (REDUCED if reduced else FULL), SIZES[form]
    device = jax.devices()[0]
    log(f"device check on {backend} ({getattr(device, 'device_kind', '?')}), {form} form: "
        f"{arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, vocab {arch['vocab_size']}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="muajax-device-") as tmp:
        hf_dir = build_checkpoint(os.path.join(tmp, "hf"), arch, args.seed)
        checks, reuse = run_checks(args, hf_dir, arch, sizes, backend)
        figures = {}
        if "figures" in args.checks:
            figures.update(decode_figure(hf_dir, *sizes["decode"], args.repeat, args.seed))
            figures.update(update_figure(hf_dir, *sizes["update"], args.repeat, args.seed,
                                         compiled=reuse.get("grpo") if reduced else None))
            log(f"decode {figures['decode_tokens_per_s']:.1f} tokens/s ({sizes['decode'][0]} slots, bfloat16); "
                f"GRPO update {figures['update_s'] * 1e3:.1f} ms, {figures['update_tflops_per_s']:.3g} TFLOP/s, MFU "
                + (f"{figures['mfu']:.1%}" if figures["mfu"] is not None else "n/a (peak unknown)"))
    failed = [c.name for c in checks if not c.passed]
    log(("PASS" if not failed else "FAIL: " + ", ".join(failed)) + f" ({len(checks)} checks, "
        f"{time.perf_counter() - start:.1f} s)")
    return {"passed": not failed, "failed": failed, "backend": backend,
            "device_kind": getattr(device, "device_kind", None), "form": form,
            "arch": {**arch, **SHARED}, "checks": {c.name: c.record() for c in checks}, "figures": figures,
            "wall_s": time.perf_counter() - start, **machine_info()}
