"""Full-sequence forward throughput: muajax (jitted) beside transformers (PyTorch), CPU.

Both run the same random Qwen3 weights (built in transformers, saved, loaded through
muajax's HF loader) on the same tokens, computing logits at every position (HF's default,
and what the RL loss needs). Calls alternate between the two and medians are reported.
The warm-up outputs are compared, so a fast but wrong forward shows up as a logit gap.

Default size: hidden 512, 8 layers, 8 heads / 4 kv heads of 64, MLP 1536, vocab 32000,
batch 8 x 512 tokens, float32. `--quick`: a tiny model and 2 rounds (a smoke run).

`--moe`: a mixture of experts instead, transformers' `Qwen3MoeForCausalLM` (every layer's MLP
`--experts` experts of width `--moe-intermediate`, each token routed to `--active` of them,
norm_topk_prob) beside muajax's MoE forward (`muajax.models.moe`) on the same weights;
default 16 experts, 4 active, width 384 (quick: 8, 2, 32).
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
MOE_FULL = dict(experts=16, active=4, moe_intermediate=384)
MOE_QUICK = dict(experts=8, active=2, moe_intermediate=32)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench forward", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (smoke test)")
    for key in FULL:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {FULL[key]} ({QUICK[key]} quick)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all cores)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="transformers attention implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe", action="store_true", help="a mixture of experts (Qwen3MoeForCausalLM) instead")
    for key in MOE_FULL:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"with --moe: default {MOE_FULL[key]} ({MOE_QUICK[key]} quick)")
    args = p.parse_args(argv)
    args = fill_size_args(args, FULL, QUICK)
    if args.moe:
        for key, value in (MOE_QUICK if args.quick else MOE_FULL).items():
            setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
        if not 1 <= args.active <= args.experts or args.moe_intermediate < 1:
            raise BenchError(f"--active {args.active} must be in 1..--experts {args.experts}, --moe-intermediate >= 1")
    return args


def build_hf_moe(args):
    """A random `Qwen3MoeForCausalLM` of the size in `args`, every layer sparse."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts, num_experts_per_tok=args.active,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=max(args.seq, 512), rope_theta=1_000_000.0, tie_word_embeddings=False,
        attn_implementation=args.attn)
    torch.manual_seed(args.seed)
    return transformers.Qwen3MoeForCausalLM(config)


def build_hf(args):
    return (build_hf_moe(args) if args.moe else build_hf_qwen3(args)).eval()


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

    mlp = (f"{args.experts} experts of {args.moe_intermediate}, {args.active} a token" if args.moe
           else f"mlp {args.intermediate}")
    log(f"forward: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"{mlp}, vocab {args.vocab}; batch {args.batch} x {args.seq} tokens, float32, "
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
        "config": {k: getattr(args, k) for k in (*FULL, *(MOE_FULL if args.moe else ())) if k != "repeat"},
        "moe": args.moe,
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
