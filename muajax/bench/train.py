"""One training step (forward + backward + AdamW) on CPU: muajax beside PyTorch/transformers.

muajax runs its real train step (`muajax.rl.sft.make_sft_step`: next-token loss over all
tokens, global-norm clip, AdamW, the non-finite guard; jitted with donated state on a
1-device mesh). PyTorch runs `Qwen3ForCausalLM(labels=...)`, `clip_grad_norm_` and
`torch.optim.AdamW` with the same settings, from the same weights. Both losses at the
first step are compared, so a fast but different computation shows up. Calls alternate
and medians are reported. Model FLOPs utilisation (`muajax.models.flops`: no remat
recompute, causal attention) is measured against the matmul peak of this machine, timed in
the same run (a large float32 jnp matmul, `muajax.train.step_metrics.measure_matmul_peak`:
what the trainer's `perf/mfu` on a CPU is measured against too).

Default size: hidden 512, 8 layers, 8 heads / 4 kv heads of 64, MLP 1536, vocab 32000,
batch 8 x 512 tokens, float32. `--quick`: a tiny model and 2 rounds (a smoke run).
"""
from __future__ import annotations

import argparse
import os
import tempfile

from muajax.bench.common import BenchError, build_hf_qwen3, fill_size_args, log, machine_info, median, ratio

FULL = dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=32000,
            batch=8, seq=512, repeat=5)
QUICK = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             batch=2, seq=32, repeat=2)
LR, WEIGHT_DECAY, CLIP = 1e-5, 0.01, 1.0


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (smoke test)")
    for key in FULL:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"default {FULL[key]} ({QUICK[key]} quick)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all cores)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="transformers attention implementation")
    # "dots" (keep matmul outputs, recompute elementwise ops) measured ~9% faster than "none"
    # on CPU: it skips storing per-layer stacks such as the broadcast attention mask.
    p.add_argument("--remat", default="dots", choices=("none", "full", "dots"), help="muajax layer remat policy")
    # muajax's training attention (model.attention); "auto" is what a run would use (on CPU:
    # the einsum below AUTO_CHUNKED_MIN_LEN positions, chunked from there).
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "chunked", "splash"),
                   help="muajax attention implementation")
    p.add_argument("--also-attention", default="", metavar="IMPL[,IMPL]",
                   help="also time muajax with these attention implementations, on the same batch and "
                        "weights (e.g. xla beside chunked); all of them go in the JSON's attention_s")
    p.add_argument("--peak-size", type=int, default=2048, help="matrix size of the peak-FLOPs matmul")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return fill_size_args(args, FULL, QUICK)


def build_hf(args):
    return build_hf_qwen3(args).train()


def run(argv) -> dict:
    args = parse(argv)
    import jax
    import numpy as np
    import torch

    from muajax import parallel

    torch.set_num_threads(args.threads)
    cpu = jax.devices("cpu")[0]
    model = build_hf(args)
    cfg, attention_used, mesh, steps = _muajax_steps(args, model, cpu)
    rng = np.random.RandomState(args.seed)
    tokens_np = rng.randint(0, args.vocab, (args.batch, args.seq)).astype(np.int64)
    batch = jax.device_put({"tokens": tokens_np.astype(np.int32),
                            "loss_mask": np.ones(tokens_np.shape, np.int32)}, parallel.batch_sharding(mesh, 2))
    torch_step = _torch_step(model, torch.from_numpy(tokens_np))

    log(f"train: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"mlp {args.intermediate}, vocab {args.vocab}; batch {args.batch} x {args.seq} tokens, float32, "
        f"remat {args.remat}, torch threads {torch.get_num_threads()}, attention {args.attn} (torch), "
        f"{attention_used} (muajax)")
    fns = {"muajax": _muajax_step(steps[attention_used], batch), "torch": torch_step,
           **{f"muajax {n}": _muajax_step(steps[n], batch) for n in steps if n != attention_used}}
    first, walls, cpus, peaks = _timed_rounds(args, fns, cpu)
    also = [name for name in steps if name != attention_used]
    result = _result(args, cfg, attention_used, also, first, walls, cpus, peaks)
    _report(result, first)
    return result


def _muajax_steps(args, model, cpu):
    """muajax's train step from `model`'s weights: (cfg, the attention it resolves to, mesh,
    {attention: [step, state]}), the first entry that attention and the rest one per other
    implementation of --also-attention, each from the same weights."""
    import jax

    from muajax import parallel
    from muajax.models.attention import resolve
    from muajax.models.hf import load_params
    from muajax.rl.optim import make_optimizer
    from muajax.rl.sft import make_sft_step

    with tempfile.TemporaryDirectory(prefix="muajax-bench-") as tmp:
        model.save_pretrained(tmp)
        with jax.default_device(cpu):
            params, cfg = load_params(tmp)
    cfg = cfg.replace(remat=args.remat, attention=args.attention)

    attention_used = resolve(args.attention, num_keys=args.seq, dtype=cfg.compute_dtype, platform="cpu",
                             cache_form=False)
    mesh = parallel.make_mesh(1, 1, 1, devices=[cpu])
    # The entropy metric is off: torch's step computes none, so both do the same work.
    step = make_sft_step(cfg, make_optimizer(LR, weight_decay=WEIGHT_DECAY, grad_clip=CLIP), mesh,
                         with_entropy=False)
    steps = {attention_used: [step, step.init_state(params)]}
    for impl in filter(None, (a.strip() for a in args.also_attention.split(","))):
        name = resolve(impl, num_keys=args.seq, dtype=cfg.compute_dtype, platform="cpu", cache_form=False)
        if name not in steps:  # the same weights through another attention
            other = make_sft_step(cfg.replace(attention=name), make_optimizer(LR, weight_decay=WEIGHT_DECAY,
                                                                              grad_clip=CLIP), mesh,
                                  with_entropy=False)
            steps[name] = [other, other.init_state(params)]
    return cfg, attention_used, mesh, steps


def _muajax_step(entry: list, batch):
    """One call of `entry`'s step on `batch`, its state updated in place; returns the loss."""
    def step():
        step_fn, state = entry
        entry[1], metrics = step_fn(state, batch)
        return metrics["loss"]
    return step


def _torch_step(model, tokens_pt):
    """One transformers train step (loss, backward, clip, AdamW) on `tokens_pt`; returns the loss."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens_pt, labels=tokens_pt).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss.detach()
    return step


def _timed_rounds(args, fns: dict, cpu):
    """First-step losses, then per candidate wall and CPU seconds of `args.repeat` alternating
    rounds, and the matmul peaks measured before and after them."""
    from muajax.train.step_metrics import measure_matmul_peak, timed

    # The first call of each is its first step from the shared initial weights (and the
    # warm-up: compilation, allocator).
    first = {name: float(fn()) for name, fn in fns.items()}
    for _ in range(args.warmup - 1):
        for fn in fns.values():
            fn()
    peaks = [measure_matmul_peak(args.peak_size, device=cpu)]
    walls, cpus = {n: [] for n in fns}, {n: [] for n in fns}
    for r in range(args.repeat):  # alternate who goes first, so drifting load hits both alike
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            w, c = timed(fns[name])
            walls[name].append(w)
            cpus[name].append(c)
    peaks.append(measure_matmul_peak(args.peak_size, device=cpu))  # before and after: the best of both
    return first, walls, cpus, peaks


def _result(args, cfg, attention_used: str, also: list, first: dict, walls: dict, cpus: dict, peaks: list) -> dict:
    """The benchmark's JSON."""
    from muajax.models.flops import train_step_flops

    peak, peak_per_cpu_s = max(p.per_second for p in peaks), max(p.per_cpu_second for p in peaks)
    t_mj, t_pt = median(walls["muajax"]), median(walls["torch"])
    c_mj, c_pt = median(cpus["muajax"]), median(cpus["torch"])
    flops = train_step_flops(cfg, args.batch, args.seq)  # the trainer's count: no remat, causal attention
    return {
        "ratio": ratio(t_pt, t_mj),  # muajax steps/s over torch steps/s (wall clock)
        "mfu": flops / t_mj / peak,
        "torch_mfu": flops / t_pt / peak,
        # The same figures per CPU-second: what each did with the CPU it actually got, which a
        # shared machine's load distorts much less than wall time.
        "cpu_ratio": ratio(c_pt, c_mj),
        "mfu_cpu": flops / c_mj / peak_per_cpu_s,
        "torch_mfu_cpu": flops / c_pt / peak_per_cpu_s,
        "muajax_steps_per_s": 1.0 / t_mj,
        "torch_steps_per_s": 1.0 / t_pt,
        "muajax_median_s": t_mj,
        "torch_median_s": t_pt,
        "muajax_times_s": walls["muajax"],
        "torch_times_s": walls["torch"],
        "muajax_cpu_s": cpus["muajax"],
        "torch_cpu_s": cpus["torch"],
        "model_flops_per_step": flops,
        "matmul_peak_flops": peak,
        "matmul_peak_flops_per_cpu_s": peak_per_cpu_s,
        "first_loss_muajax": first["muajax"],
        "first_loss_torch": first["torch"],
        "config": {k: getattr(args, k) for k in FULL if k != "repeat"},
        "remat": args.remat,
        "attention": attention_used,
        # median seconds per step of each muajax attention timed (--also-attention)
        "attention_s": {attention_used: t_mj, **{n: median(walls[f"muajax {n}"]) for n in also}},
        "quick": args.quick,
        **machine_info(),
    }


def _report(result: dict, first: dict) -> None:
    """Log the figures; fail when the first-step losses show that the candidates differ."""
    t_mj, t_pt = result["muajax_median_s"], result["torch_median_s"]
    c_mj, c_pt = median(result["muajax_cpu_s"]), median(result["torch_cpu_s"])
    peak, peak_per_cpu_s = result["matmul_peak_flops"], result["matmul_peak_flops_per_cpu_s"]
    flops, attention_used = result["model_flops_per_step"], result["attention"]
    log(f"torch   {1 / t_pt:8.4f} steps/s  (median {t_pt:.3f} s wall, {c_pt:.3f} s CPU)  "
        f"mfu {result['torch_mfu']:.3f} (per CPU-s {result['torch_mfu_cpu']:.3f})")
    log(f"muajax  {1 / t_mj:8.4f} steps/s  (median {t_mj:.3f} s wall, {c_mj:.3f} s CPU)  "
        f"mfu {result['mfu']:.3f} (per CPU-s {result['mfu_cpu']:.3f})")
    log(f"ratio muajax/torch {result['ratio']:.3f} (per CPU-s {result['cpu_ratio']:.3f}); matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s, {peak_per_cpu_s / 1e9:.1f} GFLOP per CPU-s; {flops / 1e9:.1f} GFLOP per step; "
        f"first loss {first['muajax']:.5f} vs {first['torch']:.5f}; "
        f"load avg {result['load_avg_1m']} on {result['cpu_count']} cores")
    for name in (n for n in result["attention_s"] if n != attention_used):
        log(f"muajax with {name} attention: median {result['attention_s'][name]:.3f} s; {attention_used} "
            f"{t_mj:.3f} s ({attention_used} / {name} {ratio(result['attention_s'][name], t_mj):.3f}x the speed)")
        if not abs(first[f"muajax {name}"] - first["muajax"]) < 1e-4 * max(1.0, abs(first["muajax"])):
            raise BenchError(f"first-step losses differ between attentions: {attention_used} {first['muajax']:.6g}, "
                             f"{name} {first[f'muajax {name}']:.6g}")
    if not abs(first["muajax"] - first["torch"]) < 1e-3 * max(1.0, abs(first["torch"])):
        raise BenchError(f"first-step losses differ: muajax {first['muajax']:.6g} vs torch {first['torch']:.6g}; "
                         "the two are not training the same model, so the timings would be meaningless")
