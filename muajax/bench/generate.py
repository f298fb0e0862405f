"""`python -m muajax.bench generate`: batched greedy generation, muajax's Engine against
transformers' `generate`, on the same random Qwen3 weights, in one process.

Both sides get the same prompts (batch x prompt tokens, no padding) and must produce
exactly `new` tokens (no stop token; transformers also gets min_new_tokens=max_new_tokens).

How the time is split into prefill and decode:
- transformers: a LogitsProcessor stamps the clock each time it is called. Call i comes
  right after the forward that produced token i (torch on CPU is synchronous), so
  call 0 closes the prefill (the prompt forward, which yields token 0) and the span from
  call 0 to the last call is `new - 1` single-token decode forwards.
- muajax: the engine keeps a prompt's last token for the decode loop, so the prefill is
  `open` + `flush(keep_last=True)` (the first `prompt - 1` tokens) and decode is
  `generate`: `new` single-token forwards, host round trips between chunks included.
Decode tokens/s is therefore (single-token forward steps x batch) / decode seconds on
each side; end-to-end tokens/s is batch x new / total seconds.

The reference is transformers with torch.set_num_threads(os.cpu_count()). On a machine
shared with other jobs torch's threads can stall each other (2 threads on 2 busy cores
measured 10-25x slower than 1 thread), which would flatter muajax, so transformers is
also timed with `--alt-threads` threads and the `*_vs_best_torch` ratios use the faster.

Cost against max_len (`--max-len L`): the engine's pages make a step's cost follow the
length in use, not the length a conversation may reach. The same prompts are then also
decoded by a second engine at `--base-max-len` (512), interleaved with the first, and
`maxlen_cost_ratio` is muajax's decode ms/step at L over that engine's.

tunix (`--tunix-python PY`, an interpreter whose environment has google-tunix): its
`Sampler` decodes the same prompts greedily from the same checkpoint in a subprocess
(`tunix_side.py`, which says how its ms/step is measured); `tunix_decode_ms_ratio` is
muajax's decode ms/step over tunix's (below 1: muajax is faster).

Runs alternate which side goes first each round (shared machine: drift hits all sides);
figures are medians. The decode floor (`xla_floor_ms`, `muajax.bench.model_floor`) is the
model's whole step in plain XLA over the mean context: the same kinds of work as the
engine's step, so the ratio follows the engine, not which kernels the box runs faster.
Beside it (`muajax.bench.decode_floor`): the step's products alone (matmuls and the
attention's two dots) in XLA, the matmuls alone in XLA and torch, and one read of every
weight, which bound the ratio an engine could reach on the machine.
Compilation is excluded from muajax's timed runs: the first (cold)
run is timed separately and `compile_s` is its excess over the warm median.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from muajax.bench import common, decode_floor

# The forward benchmark's architecture (vocab shrunk from Qwen3's 151936 to keep it CPU-sized).
ARCH = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
QUICK_ARCH = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
SHARED_ARCH = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
               "tie_word_embeddings": False}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench generate", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=128, help="tokens generated per row")
    p.add_argument("--decode-chunk", type=int, default=32, help="Engine(decode_chunk=...)")
    p.add_argument("--max-len", type=int, default=None,
                   help="the engine's max_len (default prompt + new); also times an engine at --base-max-len")
    p.add_argument("--base-max-len", type=int, default=512, help="the max_len --max-len is compared with")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads of the reference transformers run (default: all cores)")
    p.add_argument("--alt-threads", type=int, default=1,
                   help="also time transformers with this many torch threads (0: don't). On a loaded "
                        "machine torch's all-core run can be many times slower than a 1-thread one, "
                        "which would flatter the ratio; the *_vs_best_torch figures use the faster one")
    p.add_argument("--no-hf", action="store_true", help="no transformers run (the XLA floor is still timed)")
    p.add_argument("--no-floor", action="store_true", help="skip the decode floor's rounds")
    p.add_argument("--tunix-python", default=os.environ.get("MUAJAX_TUNIX_PYTHON"),
                   help="a python with google-tunix: also time tunix's Sampler (default $MUAJAX_TUNIX_PYTHON)")
    p.add_argument("--quick", action="store_true", help="tiny model and sizes: checks the bench runs")
    common.add_isa_option(p)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.prompt, args.new, args.repeat = 2, 12, 8, 1
        args.decode_chunk = min(args.decode_chunk, 4)
    if min(args.batch, args.prompt, args.new, args.repeat, args.decode_chunk) < 1:
        raise common.BenchError("--batch, --prompt, --new, --repeat and --decode-chunk must be >= 1")
    if args.prompt < 2 or args.new < 2:
        raise common.BenchError("--prompt and --new must be >= 2: the engine splits off the last prompt token, "
                                "transformers' decode span runs from the first new token to the last")
    if min(args.max_len or args.prompt + args.new, args.base_max_len) < args.prompt + args.new:
        raise common.BenchError(f"--max-len and --base-max-len must hold --prompt + --new = {args.prompt + args.new}")
    return args


def setup_threads(n: int | None = None) -> None:
    """torch intra-op threads; default every core, the brief's reference setup."""
    import torch

    torch.set_num_threads(n or os.cpu_count() or 1)


def build_models(quick: bool, seed: int, workdir: str):
    """A random HF Qwen3ForCausalLM saved to `workdir`, and the same weights loaded by muajax.

    Returns (hf_model, params, cfg)."""
    import torch
    import transformers

    from muajax.models.hf import load_params

    transformers.utils.logging.disable_progress_bar()
    arch = {**(QUICK_ARCH if quick else ARCH), **SHARED_ARCH}
    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen3Config(**arch, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF's norms start at exactly 1; random ones make the weights less special
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(workdir)
    params, cfg = load_params(workdir)
    common.block(params)
    return model, params, cfg


class _StepClock:
    """A transformers LogitsProcessor that only records when each generation step's logits arrive."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def hf_generate_once(model, prompts: np.ndarray, new: int) -> tuple[dict, np.ndarray]:
    import torch
    from transformers import LogitsProcessorList

    clock = _StepClock()
    ids = torch.from_numpy(prompts.astype(np.int64))
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, logits_processor=LogitsProcessorList([clock]),
                             eos_token_id=None, pad_token_id=0, use_cache=True)
        end = time.perf_counter()
    tokens = out[:, prompts.shape[1]:].numpy()
    if tokens.shape[1] != new or len(clock.stamps) != new:
        raise common.BenchError(f"transformers generated {tokens.shape[1]} tokens in {len(clock.stamps)} steps, "
                                f"expected {new}")
    b = prompts.shape[0]
    return {"prefill_s": clock.stamps[0] - start, "decode_s": clock.stamps[-1] - clock.stamps[0],
            "total_s": end - start, "decode_tokens": b * (new - 1), "tokens": b * new}, tokens


def make_engine(params, cfg, batch: int, max_len: int, decode_chunk: int, **options):
    from muajax.engine.engine import Engine

    # no stop ids: every row runs to max_new_tokens, like min_new_tokens on the HF side
    return Engine(params, cfg, num_slots=batch, max_len=max_len, stop_ids=(), decode_chunk=decode_chunk, **options)


def muajax_generate_once(engine, prompts: np.ndarray, new: int) -> tuple[dict, np.ndarray]:
    from muajax.engine.engine import SamplingParams

    start = time.perf_counter()
    slots = [engine.open(row.tolist()) for row in prompts]
    engine.flush(slots, keep_last=True)
    mid = time.perf_counter()
    gens = engine.generate(slots, SamplingParams(temperature=0.0, max_new_tokens=new))
    end = time.perf_counter()
    for slot in slots:
        engine.release(slot)
    tokens = np.asarray([gens[s].tokens for s in slots])
    if tokens.shape[1] != new:
        raise common.BenchError(f"muajax generated {tokens.shape[1]} tokens, expected {new}")
    b = prompts.shape[0]
    return {"prefill_s": mid - start, "decode_s": end - mid, "total_s": end - start,
            "decode_tokens": b * new, "tokens": b * new}, tokens


def tunix_generate(python: str, hf_model, prompts: np.ndarray, new: int, repeat: int) -> dict:
    """tunix_side.py's figures for the same checkpoint and prompts, run by `python`."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_side.py")
    with tempfile.TemporaryDirectory(prefix="muajax-bench-tunix-") as workdir:
        hf_model.save_pretrained(workdir)
        np.save(os.path.join(workdir, "prompts.npy"), prompts)
        cap = [os.path.join(os.path.dirname(script), "isa_cap.py"), level] if (level := common.isa_cap_level()) else []
        command = [python, *cap, script, "--hf-dir", workdir, "--prompts", os.path.join(workdir, "prompts.npy"),
                   "--new", str(new), "--short", str(max(1, new // 8)), "--repeat", str(max(repeat, 3))]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise common.BenchError(f"the tunix side did not run: {exc}") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise common.BenchError(f"the tunix side failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def common_prefix(a: np.ndarray, b: np.ndarray) -> float:
    """Mean length of the agreeing prefix per row: a check that both sides ran the same model."""
    lengths = []
    for x, y in zip(a, b):
        diff = np.nonzero(x != y)[0]
        lengths.append(int(diff[0]) if diff.size else len(x))
    return float(np.mean(lengths))


def summarize(runs: list[dict], batch: int) -> dict:
    med = {k: common.median([r[k] for r in runs]) for k in ("prefill_s", "decode_s", "total_s")}
    steps = runs[0]["decode_tokens"] // batch
    return {**{k: round(v, 4) for k, v in med.items()},
            "decode_tok_s": common.ratio(runs[0]["decode_tokens"], med["decode_s"]),
            "e2e_tok_s": common.ratio(runs[0]["tokens"], med["total_s"]),
            "decode_ms_per_step": 1e3 * common.ratio(med["decode_s"], steps)}


def _line(name: str, r: dict) -> str:
    return (f"{name:<30} prefill {r['prefill_s']:7.3f}s  decode {r['decode_s']:8.3f}s "
            f"({r['decode_ms_per_step']:8.2f} ms/step)  total {r['total_s']:8.3f}s  "
            f"decode {r['decode_tok_s']:8.1f} tok/s  e2e {r['e2e_tok_s']:8.1f} tok/s")


def run(argv: list[str]) -> dict:
    args = parse(argv)
    common.apply_isa_cap(args.cap_isa)
    setup_threads(args.threads)
    rng = np.random.RandomState(args.seed)
    with tempfile.TemporaryDirectory(prefix="muajax-bench-generate-") as workdir:
        hf_model, params, cfg = build_models(args.quick, args.seed, workdir)
    prompts = rng.randint(0, cfg.vocab_size, size=(args.batch, args.prompt)).astype(np.int32)
    max_len = args.max_len or args.prompt + args.new
    engine = make_engine(params, cfg, args.batch, max_len, args.decode_chunk)
    common.log(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
               f"{cfg.num_params() / 1e6:.1f}M params, {cfg.dtype}; batch {args.batch}, prompt {args.prompt}, "
               f"new {args.new}, decode_chunk {args.decode_chunk}, max_len {max_len}")

    cold, mj_tokens = muajax_generate_once(engine, prompts, args.new)
    sides, threads = _sides(args, params, cfg, engine, hf_model, prompts)
    outputs, runs = _timed_rounds(args, sides)
    setup_threads(args.threads)
    figures = {name: summarize(rs, args.batch) for name, rs in runs.items()}
    mj = figures["muajax"]
    compile_s = max(cold["total_s"] - mj["total_s"], 0.0)
    mj["compile_s"] = round(compile_s, 3)
    result = {"config": {k: getattr(args, k) for k in ("batch", "prompt", "new", "decode_chunk", "repeat", "threads",
                                                       "alt_threads", "quick", "cap_isa")} | {"max_len": max_len},
              "muajax": mj}
    common.log(_line(f"muajax (max_len {max_len})", mj) + f"  (compile {compile_s:.2f}s, excluded)")
    if "muajax_base" in figures:
        _report_base(args, result, figures, outputs["muajax_base"], mj_tokens, max_len)
    muajax_once = lambda: muajax_generate_once(engine, prompts, args.new)[0]  # noqa: E731
    if threads:
        _report_transformers(args, result, figures, threads, outputs["transformers"], mj_tokens)
    if not args.no_floor:
        result["floor"] = _floor(args, hf_model, figures["transformers"]["decode_ms_per_step"] if threads else None,
                                 muajax_once, threads.values())
        setup_threads(args.threads)
    if args.tunix_python:
        _report_tunix(args, result, hf_model, prompts, mj_tokens)
    result["machine"] = common.machine_info()
    return result


def _sides(args, params, cfg, engine, hf_model, prompts: np.ndarray) -> tuple[dict, dict]:
    """The candidates to time, {name: () -> (figures, tokens)}, and the transformers ones'
    torch thread counts {name: threads}."""
    sides = {"muajax": lambda: muajax_generate_once(engine, prompts, args.new)}
    if args.max_len is not None and args.max_len != args.base_max_len:
        base_engine = make_engine(params, cfg, args.batch, args.base_max_len, args.decode_chunk)
        sides["muajax_base"] = lambda: muajax_generate_once(base_engine, prompts, args.new)
    threads = {}
    if not args.no_hf:
        threads["transformers"] = args.threads
        if args.alt_threads and args.alt_threads != args.threads:
            threads[f"transformers_{args.alt_threads}thread"] = args.alt_threads
    for name, n in threads.items():
        def hf_side(n=n):
            setup_threads(n)
            return hf_generate_once(hf_model, prompts, args.new)
        sides[name] = hf_side
    return sides, threads


def _timed_rounds(args, sides: dict) -> tuple[dict, dict]:
    """Each side's warm-up tokens, and its figures of `args.repeat` alternating rounds."""
    outputs = {}
    for name, side in sides.items():  # warm-up: the first muajax call after compiling can still be slow
        outputs[name] = side()[1]
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(args.repeat):
        for name in (order if r % 2 == 0 else order[::-1]):
            runs[name].append(sides[name]()[0])
    return outputs, runs


def _report_base(args, result: dict, figures: dict, base_tokens: np.ndarray, mj_tokens: np.ndarray,
                 max_len: int) -> None:
    """What the larger max_len costs the decode against the engine at --base-max-len."""
    mj = figures["muajax"]
    base = result["muajax_base"] = figures["muajax_base"] | {"max_len": args.base_max_len}
    result["maxlen_cost_ratio"] = common.ratio(mj["decode_ms_per_step"], base["decode_ms_per_step"])
    # the same greedy tokens: max_len changes the page tables' width, not the numbers
    result["maxlen_same_tokens"] = bool(np.array_equal(base_tokens, mj_tokens))
    common.log(_line(f"muajax (max_len {args.base_max_len})", base))
    common.log(f"decode ms/step at max_len {max_len} / at {args.base_max_len}: x{result['maxlen_cost_ratio']:.3f}"
               f"  (same tokens: {result['maxlen_same_tokens']})")


def _report_transformers(args, result: dict, figures: dict, threads: dict, hf_tokens: np.ndarray,
                         mj_tokens: np.ndarray) -> None:
    """muajax against transformers (at each thread count)."""
    mj = figures["muajax"]
    for name, n in threads.items():
        figures[name]["torch_threads"] = n
        result[name] = figures[name]
        common.log(_line(f"{name} ({n} thr)", figures[name]))
    hf = figures["transformers"]
    best = max((figures[n] for n in threads), key=lambda f: f["decode_tok_s"])
    best_e2e = max(figures[n]["e2e_tok_s"] for n in threads)
    result["decode_ratio"] = common.ratio(mj["decode_tok_s"], hf["decode_tok_s"])
    result["e2e_ratio"] = common.ratio(mj["e2e_tok_s"], hf["e2e_tok_s"])
    result["decode_ratio_vs_best_torch"] = common.ratio(mj["decode_tok_s"], best["decode_tok_s"])
    result["e2e_ratio_vs_best_torch"] = common.ratio(mj["e2e_tok_s"], best_e2e)
    result["greedy_agree_prefix"] = common_prefix(mj_tokens, hf_tokens)
    common.log(f"muajax / transformers ({args.threads} thr, the reference): decode x{result['decode_ratio']:.2f}  "
               f"e2e x{result['e2e_ratio']:.2f}  (target decode >= x5)")
    if len(threads) > 1:
        common.log(f"muajax / fastest transformers ({best['torch_threads']} thr): "
                   f"decode x{result['decode_ratio_vs_best_torch']:.2f}  e2e x{result['e2e_ratio_vs_best_torch']:.2f}")
    common.log(f"greedy tokens agree with transformers for the first {result['greedy_agree_prefix']:.1f}/{args.new} "
               "on average (same weights)")
    setup_threads(args.threads)


def _floor(args, hf_model, hf_step_ms, muajax_once, torch_threads) -> dict:
    """The decode floor, muajax's decode timed in its rounds (`hf_step_ms` None: no torch floors)."""
    return decode_floor.measure(
        hf_model, args.batch, hf_step_ms, None, torch_threads=torch_threads or (1,), repeat=max(5, 5 * args.repeat),
        muajax_decode=lambda: summarize([muajax_once()], args.batch)["decode_ms_per_step"],
        steps=args.decode_chunk, calls=-(-args.new // args.decode_chunk), attention=floor_attention(args, hf_model),
        whole_step=True)


def floor_attention(args, hf_model) -> decode_floor.Attention:
    """The floor's attention: the model's heads over the mean context of the decode steps
    (step i of `new` attends over prompt + i positions)."""
    c = hf_model.config
    return decode_floor.Attention(heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                  context=args.prompt + (args.new - 1) // 2)


def _report_tunix(args, result: dict, hf_model, prompts: np.ndarray, mj_tokens: np.ndarray) -> None:
    """tunix's Sampler on the same checkpoint and prompts, run by --tunix-python."""
    mj = result["muajax"]
    tx = tunix_generate(args.tunix_python, hf_model, prompts, args.new, args.repeat)
    tx_tokens = np.asarray(tx.pop("tokens"))
    result["tunix"] = tx
    result["tunix_decode_ms_ratio"] = common.ratio(mj["decode_ms_per_step"], tx["decode_ms_per_step"])
    result["tunix_greedy_agree_prefix"] = common_prefix(mj_tokens, tx_tokens)
    common.log(f"tunix {tx['version']} Sampler: decode {tx['decode_ms_per_step']:.2f} ms/step; muajax / tunix "
               f"x{result['tunix_decode_ms_ratio']:.3f} (below 1: muajax faster); greedy tokens agree for the first "
               f"{result['tunix_greedy_agree_prefix']:.1f}/{args.new}")

if __name__ == "__main__":
    from muajax.bench.__main__ import main

    raise SystemExit(main(["generate", *sys.argv[1:]]))
