"""Full-sequence forward throughput: muajax (jitted) beside transformers (PyTorch), CPU.

Both run the same random Qwen3 weights (built in transformers, saved, loaded through
muajax's HF loader) on the same tokens, computing logits at every position (HF's default,
and what the RL loss needs). Calls alternate between the two and medians are reported.
The warm-up outputs are compared, so a fast but wrong forward shows up as a logit gap.

Default size: hidden 512, 8 layers, 8 heads / 4 kv heads of 64, MLP 1536, vocab 32000,
batch 8 x 512 tokens, float32. `--quick`: a tiny model and 2 rounds (a smoke run).
"""
from __future__ import annotations

import argparse
import os
import tempfile

from muajax.bench.common import (BenchError, build_hf_qwen3, fill_size_args, interleave, log, machine_info,
                                 median, ratio)

FULL = dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=32000,
            batch=8, seq=512, repeat=5)
QUICK = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             batch=2, seq=32, repeat=2)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench forward", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (smoke test)")
    for key in FULL:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {FULL[key]} ({QUICK[key]} quick)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all cores)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="transformers attention implementation")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return fill_size_args(args, FULL, QUICK)


def build_hf(args):
    return build_hf_qwen3(args).eval()


def run(argv) -> dict:
    args = parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from muajax.models.hf import load_params
    from muajax.models.qwen3 import forward_jit

    torch.set_num_threads(args.threads)
    cpu = jax.devices("cpu")[0]  # the comparison is CPU against CPU whatever the default backend is
    model = build_hf(args)
    with tempfile.TemporaryDirectory(prefix="muajax-bench-") as tmp:
        model.save_pretrained(tmp)
        with jax.default_device(cpu):
            params, cfg = load_params(tmp)
    params = jax.device_put(params, cpu)

    rng = np.random.RandomState(args.seed)
    tokens_np = rng.randint(0, args.vocab, (args.batch, args.seq)).astype(np.int64)
    tokens_pt = torch.from_numpy(tokens_np)
    tokens_jx = jax.device_put(jnp.asarray(tokens_np, jnp.int32), cpu)

    def transformers_forward():
        with torch.inference_mode():
            return model(tokens_pt).logits

    def muajax_forward():
        return forward_jit(params, cfg, tokens_jx)[0]

    outputs = {}

    def keep(name, out):
        # Only a sample of rows is kept: the full [B, T, V] logits are large and the check
        # needs no more than a few rows to catch a wrong forward.
        rows = slice(0, min(2, args.batch))
        outputs[name] = out[rows].numpy() if name == "transformers" else np.asarray(out[rows])

    log(f"forward: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"mlp {args.intermediate}, vocab {args.vocab}; batch {args.batch} x {args.seq} tokens, float32, "
        f"torch threads {torch.get_num_threads()}, attention {args.attn}")
    times = interleave({"transformers": transformers_forward, "muajax": muajax_forward},
                       warmup=args.warmup, repeat=args.repeat, on_warmup=keep)
    diff = float(np.abs(outputs["transformers"] - outputs["muajax"]).max())

    tokens = args.batch * args.seq
    t_hf, t_mj = median(times["transformers"]), median(times["muajax"])
    result = {
        "muajax_tokens_per_s": tokens / t_mj,
        "transformers_tokens_per_s": tokens / t_hf,
        "ratio": ratio(t_hf, t_mj),
        "muajax_median_s": t_mj,
        "transformers_median_s": t_hf,
        "muajax_times_s": times["muajax"],
        "transformers_times_s": times["transformers"],
        "max_abs_logit_diff": diff,
        "config": {k: getattr(args, k) for k in FULL if k != "repeat"},
        "quick": args.quick,
        "repeat": args.repeat,
        "attn_implementation": args.attn,
        **machine_info(),
    }
    log(f"transformers {result['transformers_tokens_per_s']:10.1f} tokens/s  (median {t_hf:.4f} s)")
    log(f"muajax       {result['muajax_tokens_per_s']:10.1f} tokens/s  (median {t_mj:.4f} s)")
    log(f"ratio muajax/transformers {result['ratio']:.3f}   max |Δlogit| {diff:.2e}   "
        f"load avg {result['load_avg_1m']} on {result['cpu_count']} cores")
    if not diff < 1e-2:  # a forward that disagrees this much is not measuring the same model
        raise BenchError(f"muajax and transformers logits differ by {diff:.3g}; the timings would be meaningless")
    return result
