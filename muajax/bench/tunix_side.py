"""The tunix side of `python -m muajax.bench generate --against tunix`: greedy generation with
tunix's `Sampler` on the same HF checkpoint and prompts, in tunix's own environment.

Run by the bench as a subprocess with the interpreter of an environment that has
google-tunix (it imports nothing of muajax):
    PYTHON tunix_side.py --hf-dir DIR --prompts PROMPTS.npy --new N [--repeat R]
Prints one JSON line. tunix's sampler decodes inside one jitted loop and reports no step
times, so decode ms/step is the difference of two runs' times over the difference of their
steps (`--new` and `--short` new tokens, the same prompts): prefill and host work cancel out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


class IdTokenizer:
    """Prompts given as space-separated token ids (no BOS is added: bos_id is None)."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return -1  # never sampled: every row runs to the step cap, like the muajax side

    def pad_id(self) -> int:
        return 0


def build_sampler(hf_dir: str, cache_size: int):
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen3 import model as model_lib
    from tunix.models.qwen3 import params as params_lib

    with open(f"{hf_dir}/config.json") as f:
        hf = json.load(f)
    # transformers 5 writes rope_theta inside rope_parameters, older versions at the top level
    rope_theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(rope_theta), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf.get("tie_word_embeddings", False))
    model = params_lib.create_model_from_safe_tensors(hf_dir, cfg)
    cache = sampler_lib.CacheConfig(cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim)
    return sampler_lib.Sampler(model, IdTokenizer(), cache)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--prompts", required=True, help=".npy file of [batch, prompt] token ids")
    p.add_argument("--new", type=int, required=True)
    p.add_argument("--short", type=int, default=8, help="new tokens of the shorter run (see the docstring)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    import jax
    import tunix

    prompts = np.load(args.prompts)
    strings = [" ".join(map(str, row)) for row in prompts]
    sampler = build_sampler(args.hf_dir, prompts.shape[1] + args.new)

    def run(steps: int):
        start = time.perf_counter()
        out = sampler(strings, max_generation_steps=steps, max_prompt_length=prompts.shape[1], temperature=0.0)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - start, out

    _, out = run(args.new)  # compiles both lengths' programs
    run(args.short)
    times: dict[int, list[float]] = {args.new: [], args.short: []}
    for r in range(args.repeat):
        for steps in ((args.new, args.short) if r % 2 == 0 else (args.short, args.new)):
            times[steps].append(run(steps)[0])
    long_s, short_s = statistics.median(times[args.new]), statistics.median(times[args.short])
    tokens = [[int(t) for t in row[: args.new]] for row in out.tokens]
    return {"available": True, "version": getattr(tunix, "__version__", "unknown"), "jax_version": jax.__version__,
            "total_s": long_s, "decode_ms_per_step": 1e3 * (long_s - short_s) / (args.new - args.short),
            "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
