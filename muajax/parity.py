"""muajax against `transformers` on one checkpoint: logits, and optionally greedy tokens.

    python -m muajax.parity HF_DIR [--dtype float32|bfloat16] [--generate N] [--batch B] [--seed S]
                                   [--attention auto|xla|chunked|splash|cudnn]

Both implementations load HF_DIR (transformers: PyTorch on CPU; muajax: the default JAX
backend) and run the same batch of prompts of ragged lengths. Prompts come from the
checkpoint's own tokenizer when the folder has one whose ids fit the model's vocabulary,
else from the bundled Qwen3 tokenizer if its ids fit, else seeded random token ids; the
output says which. Reported: max |Δlogit| over valid (non-padding) positions and the mean
KL(transformers || muajax) between the next-token distributions. With `--generate N`,
N greedy tokens per prompt from HF `generate` (one prompt at a time, EOS stopping off)
are compared with muajax's cached decode (ragged prefill in one call, then 1-token steps).
`--attention` picks the full forward's attention (`muajax.models.attention`; splash runs in
Pallas interpret mode off TPU, cudnn needs a GPU); the engine's decode keeps its own.

Pass/fail (exit 0/1):
  float32   max |Δlogit| <= 1e-4 (--atol) and every greedy token equal.
  bfloat16  mean KL <= 1e-2 (--max-kl). Two bf16 implementations round differently after
            every matmul, so logits drift by ~1e-1 on real models and greedy paths may
            part at near-ties; both are reported, neither decides. KL weighs errors by
            probability mass, which is what sampling and the RL loss see.
Exit 2: a bad directory or arguments. The last stdout line is always one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import numpy as np

# the checkpoint's two loads, right padding and transformers' logits, as the device check does them
from muajax.bench.device_checks import hf_logits, pad_right
from muajax.bench.device_checks import hf_model as hf_load
from muajax.bench.device_checks import muajax_model as muajax_load

F32_ATOL = 1e-4
BF16_MAX_KL = 1e-2
EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2

# Mixed lengths, scripts and content (chat, tool JSON, code, CJK) so tokenised rows are ragged.
PROMPTS = (
    "Hello!",
    "What is the capital of France?",
    "You are a customer-service agent for an online shop. The user wants to return order "
    "#W2378156 because the headphones arrived damaged. Check the policy first.",
    '{"name": "get_order_details", "arguments": {"order_id": "#W2378156"}}',
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "请帮我查询一下我的订单状态，订单号是 12345。",
    "The quick brown fox jumps over the lazy dog, then",
    "<|im_start|>user\nCan I change the shipping address of my pending order?<|im_end|>\n"
    "<|im_start|>assistant\n",
)


class ParityError(Exception):
    """Something the user must fix (bad directory, bad arguments)."""


def _log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- prompts


def _fits(prompts: list[list[int]], vocab_size: int) -> bool:
    return all(0 <= t < vocab_size for p in prompts for t in p)


def _encode(tok, order: list[int]) -> list[list[int]]:
    return [list(tok(PROMPTS[i], add_special_tokens=False)["input_ids"]) for i in order]


def make_prompts(hf_dir: str, vocab_size: int, batch: int, seed: int, max_len: int) -> tuple[list[list[int]], str]:
    """(prompts, a sentence saying where they came from)."""
    rng = np.random.RandomState(seed)
    order = [int(i) for i in np.resize(rng.permutation(len(PROMPTS)), batch)]
    notes = []
    has_own = any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    if has_own:
        try:
            from transformers import AutoTokenizer

            prompts = _encode(AutoTokenizer.from_pretrained(hf_dir), order)
            if _fits(prompts, vocab_size):
                return prompts, "checkpoint tokenizer"
            notes.append(f"checkpoint tokenizer ids exceed vocab {vocab_size}")
        except Exception as exc:  # a broken tokenizer folder should not stop a weights check
            notes.append(f"checkpoint tokenizer failed to load ({type(exc).__name__}: {exc})")
    else:
        notes.append("checkpoint has no tokenizer")
    try:
        from muajax.models.tokenizer import load_tokenizer

        prompts = _encode(load_tokenizer(), order)
        if _fits(prompts, vocab_size):
            return prompts, "bundled Qwen3 tokenizer (" + "; ".join(notes) + ")"
        notes.append(f"bundled Qwen3 tokenizer ids exceed vocab {vocab_size}")
    except (FileNotFoundError, ValueError, ImportError) as exc:
        notes.append(f"bundled tokenizer unavailable ({exc})")
    lengths = rng.randint(max(2, max_len // 4), max_len + 1, batch)
    if batch > 1 and len(set(lengths)) == 1:  # keep the batch ragged: that is what is being tested
        lengths[0] = max(2, lengths[0] - 1)
    prompts = [rng.randint(0, vocab_size, n).tolist() for n in lengths]
    return prompts, f"random token ids, seed {seed} (" + "; ".join(notes) + ")"


# ----------------------------------------------------------------------------- transformers


def hf_greedy(model, prompts: list[list[int]], num_tokens: int) -> np.ndarray:
    import torch

    rows = []
    for p in prompts:
        ids = torch.as_tensor([p], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                 max_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0,
                                 temperature=None, top_p=None, top_k=None)
        new = out[0, len(p):].tolist()
        if len(new) != num_tokens:
            raise RuntimeError(f"transformers generate returned {len(new)} tokens, asked for {num_tokens}")
        rows.append(new)
    return np.asarray(rows, np.int64)


# ----------------------------------------------------------------------------- muajax


def muajax_logits(params, cfg, tokens: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    from muajax.models.qwen3 import forward_jit

    logits, _ = forward_jit(params, cfg, jnp.asarray(tokens))  # right padding needs no mask: causal
    return np.asarray(logits.astype(jnp.float32))


def muajax_greedy(params, cfg, prompts: list[list[int]], num_tokens: int) -> np.ndarray:
    """[B, num_tokens] greedy ids from muajax's generation engine (one KV slot per prompt,
    ragged prompts extended together, then the on-device decode loop), so parity vouches
    for the engine users actually run. No stop token: exactly `num_tokens` each."""
    from muajax.engine.engine import Engine, SamplingParams

    engine = Engine(params, cfg, num_slots=len(prompts), max_len=max(map(len, prompts)) + num_tokens + 1,
                    stop_ids=())
    slots = [engine.open(p) for p in prompts]
    gens = engine.generate(slots, SamplingParams(temperature=0.0, max_new_tokens=num_tokens))
    return np.asarray([gens[s].tokens for s in slots], np.int64)


# ----------------------------------------------------------------------------- comparison


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, ours: np.ndarray, mask: np.ndarray) -> dict:
    """ref, ours: [B, T, V]; statistics over positions where mask is 1, in float64."""
    valid = mask.astype(bool)
    a, b = ref[valid].astype(np.float64), ours[valid].astype(np.float64)
    log_p, log_q = _log_softmax(a), _log_softmax(b)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    return {
        "max_abs_logit_diff": float(np.abs(a - b).max()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "argmax_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
        "positions": int(valid.sum()),
    }


def compare_tokens(ref: np.ndarray, ours: np.ndarray) -> dict:
    equal = ref == ours
    first = None
    if not equal.all():
        row = int(np.argmax(~equal.all(axis=1)))
        step = int(np.argmax(~equal[row]))
        first = {"prompt": row, "step": step, "transformers": int(ref[row, step]), "muajax": int(ours[row, step])}
    return {"tokens_match": bool(equal.all()), "token_agreement": float(equal.mean()), "first_mismatch": first}


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="a Hugging Face Qwen3 checkpoint directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="params and compute dtype on both sides (default float32)")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="also compare N greedy tokens per prompt")
    p.add_argument("--batch", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--seed", type=int, default=0, help="prompt order / random ids (default 0)")
    p.add_argument("--max-prompt-len", type=int, default=24, help="longest random prompt (default 24)")
    p.add_argument("--attention", default=None, metavar="IMPL",
                   help="attention of the full forward: auto, xla, chunked, splash or cudnn (default: the model's)")
    p.add_argument("--atol", type=float, default=F32_ATOL, help=f"float32 max |Δlogit| bound (default {F32_ATOL})")
    p.add_argument("--max-kl", type=float, default=BF16_MAX_KL, help=f"bfloat16 mean-KL bound (default {BF16_MAX_KL})")
    args = p.parse_args(argv)
    for name in ("batch", "max_prompt_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.generate < 0:
        p.error("--generate must be >= 0")
    return args


def run(args: argparse.Namespace) -> dict:
    if not os.path.isdir(args.hf_dir):  # checked before the heavy imports: a typo should fail fast
        raise ParityError(f"{args.hf_dir}: not a directory")
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise ParityError(f"{os.path.join(args.hf_dir, 'config.json')}: not found "
                          "(is it a Hugging Face model directory?)")
    import jax

    from muajax.models.attention import IMPLEMENTATIONS
    from muajax.models.hf import load_config
    from muajax.models.safetensors_io import CheckpointError

    try:
        cfg = load_config(args.hf_dir)
    except CheckpointError as exc:
        raise ParityError(str(exc)) from None
    if args.attention not in (None, *IMPLEMENTATIONS):
        raise ParityError(f"--attention {args.attention}: expected one of {', '.join(IMPLEMENTATIONS)}")
    if args.attention == "cudnn" and (jax.default_backend() != "gpu" or args.dtype != "bfloat16"):
        raise ParityError(f"--attention cudnn needs a GPU and --dtype bfloat16 (backend {jax.default_backend()}, "
                          f"dtype {args.dtype})")
    prompts, source = make_prompts(args.hf_dir, cfg.vocab_size, args.batch, args.seed, args.max_prompt_len)
    lengths = [len(p) for p in prompts]
    if max(lengths) + args.generate > cfg.max_position_embeddings:
        raise ParityError(f"prompts of {max(lengths)} tokens + {args.generate} generated exceed "
                          f"max_position_embeddings={cfg.max_position_embeddings}")
    _log(f"checkpoint {args.hf_dir}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    _log(f"prompts: {len(prompts)} from {source}; lengths {lengths}")
    tokens, mask = pad_right(prompts)

    # One model in memory at a time: transformers first, freed before muajax loads.
    t0 = time.perf_counter()
    try:
        model = hf_load(args.hf_dir, args.dtype)
    except (OSError, ValueError) as exc:
        raise ParityError(f"transformers could not load {args.hf_dir}: {exc}") from None
    ref_logits = hf_logits(model, tokens, mask)
    ref_tokens = hf_greedy(model, prompts, args.generate) if args.generate else None
    del model
    gc.collect()
    t1 = time.perf_counter()
    try:
        params, mcfg = muajax_load(args.hf_dir, args.dtype)
    except CheckpointError as exc:
        raise ParityError(str(exc)) from None
    mcfg = mcfg.replace(attention=args.attention or mcfg.attention)
    precision = "highest" if args.dtype == "float32" else "default"  # TPUs default to bf16 passes
    with jax.default_matmul_precision(precision):
        our_logits = muajax_logits(params, mcfg, tokens)
        our_tokens = muajax_greedy(params, mcfg, prompts, args.generate) if args.generate else None
    t2 = time.perf_counter()

    result = {"dtype": args.dtype, "batch": len(prompts), "seed": args.seed, "prompt_source": source,
              "prompt_lengths": lengths, "generate": args.generate, "attention": mcfg.attention}
    result.update(compare_logits(ref_logits, our_logits, mask))
    if args.generate:
        result.update(compare_tokens(ref_tokens, our_tokens))
    else:
        result.update({"tokens_match": None, "token_agreement": None, "first_mismatch": None})

    if args.dtype == "float32":
        failures = [f"max |Δlogit| {result['max_abs_logit_diff']:.3g} > {args.atol:g}"] \
            if not result["max_abs_logit_diff"] <= args.atol else []
        if result["tokens_match"] is False:
            failures.append(f"greedy tokens differ (first: {result['first_mismatch']})")
        result["criterion"] = f"max_abs_logit_diff <= {args.atol:g} and tokens_match"
    else:
        failures = [f"mean KL {result['mean_kl']:.3g} > {args.max_kl:g}"] if not result["mean_kl"] <= args.max_kl else []
        result["criterion"] = f"mean_kl <= {args.max_kl:g} (bfloat16: logit diff and tokens reported only)"
    result.update(passed=not failures, failures=failures, backend=jax.default_backend(),
                  transformers_s=round(t1 - t0, 3), muajax_s=round(t2 - t1, 3))

    _log(f"max |Δlogit| {result['max_abs_logit_diff']:.3e}   mean KL {result['mean_kl']:.3e}   "
         f"max KL {result['max_kl']:.3e}   argmax agreement {result['argmax_agreement']:.4f}")
    if args.generate:
        _log(f"greedy {args.generate} tokens x {len(prompts)}: "
             + ("identical" if result["tokens_match"] else f"differ, first at {result['first_mismatch']}"))
    _log(("PASS" if result["passed"] else "FAIL: " + "; ".join(failures)) + f"  [{args.dtype}: {result['criterion']}]")
    return result


def _json_line(d: dict) -> str:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
    return json.dumps(clean, allow_nan=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except ParityError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        print(_json_line({"passed": False, "error": str(exc), "dtype": args.dtype}), flush=True)
        return EXIT_ERROR
    print(_json_line(result), flush=True)
    return EXIT_OK if result["passed"] else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
