"""`python -m muajax.bench serve`: the OpenAI-compatible server under concurrent load,
against the same requests sent one at a time, in one run.

The server (`python -m muajax.serve`, a subprocess on 127.0.0.1 by default so client and
server do not share a GIL) is driven by the real `openai` client:
- concurrent: `--concurrency` requests in flight (AsyncOpenAI), which the engine batches
  continuously (`--slots` of them decode together, the rest wait for a slot);
- sequential (the reference): the same requests one after another (sync OpenAI client),
  so the engine always runs a batch of one.
Every request is greedy with a fixed `max_tokens`, so both modes produce the same tokens
and tokens/s compare like for like (completion tokens from the responses' usage).

Compilation is excluded: the server starts with `--warmup` (every batch x width program
compiled), then the concurrent workload runs once and a few sequential requests. Timed rounds alternate which mode
goes first; figures are medians over `--repeat` rounds. Default model: a random small
Qwen3 (hidden 512, 2 layers) with the full 151,936-id vocabulary (`--model tiny` for a
64-wide one, `--checkpoint` to serve any other).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from muajax.bench import common

_SHARED = {"vocab_size": 151936, "num_layers": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True}
# Random Qwen3 models with the full vocabulary (the real tokenizer must fit). "tiny" is too
# small for batching to pay on a CPU: its decode step is per-row vocabulary work (a
# 64-wide head GEMM, softmax and argmax over 151,936 ids), which grows with the batch.
# "small" has a 512-wide head, whose weights dominate a step as they do for real models.
MODELS = {
    "tiny": {**_SHARED, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16},
    "small": {**_SHARED, "hidden_size": 512, "intermediate_size": 1024, "num_heads": 8, "num_kv_heads": 4,
              "head_dim": 64},
}
MODEL_NAME = "bench"
WORDS = ("order", "refund", "shipping", "address", "account", "exchange", "payment", "status", "item", "cancel")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="model to serve (default: a random Qwen3 of --model size)")
    p.add_argument("--model", choices=sorted(MODELS), default="small", help="size of the default random model")
    p.add_argument("--requests", type=int, default=16, help="requests per timed round and mode")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight in the concurrent mode")
    p.add_argument("--slots", type=int, help="engine slots (default: --concurrency)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request (greedy)")
    p.add_argument("--max-len", type=int, default=512, help="the server's context per request")
    p.add_argument("--prompt-words", type=int, default=40, help="user message length (words; varied +-50%%)")
    p.add_argument("--decode-chunk", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2, help="timed rounds per mode")
    p.add_argument("--in-process", action="store_true", help="run the server in this process (a thread)")
    p.add_argument("--quick", action="store_true", help="few small requests: checks the bench runs")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.max_tokens, args.prompt_words, args.repeat = 6, 3, 6, 8, 1
        args.model, args.max_len = "tiny", 256
    args.slots = args.slots or args.concurrency
    if min(args.requests, args.concurrency, args.slots, args.max_tokens, args.prompt_words, args.repeat,
           args.decode_chunk) < 1:
        raise common.BenchError("--requests, --concurrency, --slots, --max-tokens, --prompt-words, --repeat and "
                                "--decode-chunk must be >= 1")
    if args.max_len <= args.max_tokens:
        raise common.BenchError(f"--max-len ({args.max_len}) must exceed --max-tokens ({args.max_tokens})")
    return args


def make_random_checkpoint(path: str, size: str) -> str:
    import jax

    from muajax.models.hf import save_hf
    from muajax.models.qwen3 import Qwen3Config, init_params

    cfg = Qwen3Config(**MODELS[size])
    save_hf(init_params(cfg, jax.random.key(0)), cfg, path)
    return path


def prompts(n: int, words: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        length = max(1, int(words * (0.5 + (i * 7919 % 101) / 100)))
        text = " ".join(WORDS[(i * 31 + j * 7) % len(WORDS)] for j in range(length))
        out.append([{"role": "system", "content": "You are a helpful customer service agent."},
                    {"role": "user", "content": f"Request {i}: {text}"}])
    return out


class _Subprocess:
    """`python -m muajax.serve` on a free port; the URL is read from its banner line."""

    def __init__(self, argv: list[str], timeout_s: float = 300.0):
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        self.proc = subprocess.Popen([sys.executable, "-m", "muajax.serve", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline, seen = time.monotonic() + timeout_s, []
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise common.BenchError("the server did not start in time:\n" + "".join(seen[-20:])) from None
            seen.append(line)
            if line.startswith("warm-up:"):
                common.log(f"server {line.strip()}")
            if line.startswith("serving ") and " at " in line:
                self.url = line.split(" at ", 1)[1].split()[0]
                return
            if self.proc.poll() is not None and lines.empty():
                raise common.BenchError("the server exited:\n" + "".join(seen[-20:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _InProcess:
    def __init__(self, opts):
        from muajax.serving.app import BackgroundServer, create_app
        from muajax.serving.loading import build_service

        _, service = build_service(opts)
        self.server = BackgroundServer(create_app(service)).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()


def _request(messages, max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0}


def run_sequential(url: str, workload, max_tokens: int) -> tuple[float, int, list[float]]:
    import openai

    client = openai.OpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600)
    latencies, tokens = [], 0
    start = time.perf_counter()
    for messages in workload:
        t0 = time.perf_counter()
        response = client.chat.completions.create(**_request(messages, max_tokens))
        latencies.append(time.perf_counter() - t0)
        tokens += response.usage.completion_tokens
    wall = time.perf_counter() - start
    client.close()
    return wall, tokens, latencies


def run_concurrent(url: str, workload, max_tokens: int, concurrency: int) -> tuple[float, int, list[float]]:
    import openai

    async def go():
        client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600)
        gate = asyncio.Semaphore(concurrency)
        latencies: list[float] = []

        async def one(messages):
            async with gate:
                t0 = time.perf_counter()
                response = await client.chat.completions.create(**_request(messages, max_tokens))
                latencies.append(time.perf_counter() - t0)
                return response.usage.completion_tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(m) for m in workload))
        wall = time.perf_counter() - start
        await client.close()
        return wall, sum(counts), latencies

    return asyncio.run(go())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(argv: list[str]) -> dict:
    args = parse(argv)
    tmp = tempfile.TemporaryDirectory(prefix="muajax-bench-serve-")
    server = None
    try:
        checkpoint = args.checkpoint or make_random_checkpoint(os.path.join(tmp.name, args.model), args.model)
        common.log(f"starting the server ({'in-process' if args.in_process else 'subprocess'}), {args.slots} slots")
        if args.in_process:
            from muajax.serving.loading import ServeOptions

            server = _InProcess(ServeOptions(checkpoint=checkpoint, model_name=MODEL_NAME, slots=args.slots,
                                             max_len=args.max_len, decode_chunk=args.decode_chunk,
                                             max_queue=max(256, args.requests), warmup=True))
        else:
            server = _Subprocess(["--checkpoint", checkpoint, "--port", "0", "--model-name", MODEL_NAME, "--slots",
                                  str(args.slots), "--max-len", str(args.max_len), "--decode-chunk",
                                  str(args.decode_chunk), "--max-queue", str(max(256, args.requests)), "--warmup"])
        workload = prompts(args.requests, args.prompt_words)
        t0 = time.perf_counter()
        run_concurrent(server.url, workload, args.max_tokens, args.concurrency)  # compiles every bucket
        run_sequential(server.url, workload[:2], args.max_tokens)
        common.log(f"warm-up (compilation) {time.perf_counter() - t0:.1f}s")
        results: dict[str, list] = {"concurrent": [], "sequential": []}
        for r in range(args.repeat):
            modes = ("concurrent", "sequential") if r % 2 == 0 else ("sequential", "concurrent")
            for mode in modes:
                if mode == "concurrent":
                    out = run_concurrent(server.url, workload, args.max_tokens, args.concurrency)
                else:
                    out = run_sequential(server.url, workload, args.max_tokens)
                results[mode].append(out)
                common.log(f"round {r + 1} {mode}: {len(workload) / out[0]:.2f} requests/s, "
                           f"{out[1] / out[0]:.1f} tokens/s")
    finally:
        if server is not None:
            server.close()
        tmp.cleanup()

    def figures(mode):
        walls = [w for w, _, _ in results[mode]]
        tokens = results[mode][0][1]
        latencies = [x for _, _, lat in results[mode] for x in lat]
        wall = statistics.median(walls)
        return {"requests_per_s": len(workload) / wall, "tokens_per_s": tokens / wall, "wall_s": wall,
                "completion_tokens": tokens, "latency_p50_s": _pct(latencies, 0.5),
                "latency_p90_s": _pct(latencies, 0.9)}

    conc, seq = figures("concurrent"), figures("sequential")
    same_tokens = all(out[1] == seq["completion_tokens"] for mode in results for out in results[mode])
    ratio = common.ratio(conc["requests_per_s"], seq["requests_per_s"])
    common.log(f"concurrent ({args.concurrency} in flight): {conc['requests_per_s']:.2f} requests/s, "
               f"{conc['tokens_per_s']:.1f} tokens/s, p50 latency {conc['latency_p50_s']:.3f}s")
    common.log(f"sequential (reference):   {seq['requests_per_s']:.2f} requests/s, {seq['tokens_per_s']:.1f} "
               f"tokens/s, p50 latency {seq['latency_p50_s']:.3f}s")
    common.log(f"ratio concurrent/sequential: {ratio:.2f}x requests/s")
    return {
        "requests_per_s": conc["requests_per_s"], "tokens_per_s": conc["tokens_per_s"],
        "sequential_requests_per_s": seq["requests_per_s"], "sequential_tokens_per_s": seq["tokens_per_s"],
        "ratio": ratio, "tokens_ratio": common.ratio(conc["tokens_per_s"], seq["tokens_per_s"]),
        "latency_p50_s": conc["latency_p50_s"], "latency_p90_s": conc["latency_p90_s"],
        "sequential_latency_p50_s": seq["latency_p50_s"], "same_completion_tokens": same_tokens,
        "concurrent_walls_s": [w for w, _, _ in results["concurrent"]],
        "sequential_walls_s": [w for w, _, _ in results["sequential"]],
        "config": {"requests": args.requests, "concurrency": args.concurrency, "slots": args.slots,
                   "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
                   "decode_chunk": args.decode_chunk, "repeat": args.repeat, "quick": args.quick,
                   "server": "in-process" if args.in_process else "subprocess",
                   "max_len": args.max_len,
                   "model": args.checkpoint or f"random {args.model} Qwen3 {MODELS[args.model]}"},
        "machine": common.machine_info(),
    }
