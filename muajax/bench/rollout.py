"""`python -m muajax.bench rollout --shop`: is the device kept busy while users think?

(Without `--shop`, `bench rollout` runs the engine on a τ2-like rollout profile:
`muajax.bench.profile_rollout`.)

Many concurrent conversations of a tiny Qwen3 (the real tokenizer, the built-in shop
domain) talk to simulated users behind a local OpenAI-compatible HTTP server that
answers each request after a fixed delay. The figure is the engine's busy share: engine
device time / wall time of the whole rollout call. The reference, run in the same
process on the same engine, tasks and seeds, is `overlap_io=False`: the loop that waits
for every pending user reply before decoding anything else.

The system prompt is the domain's policy padded to `--system-tokens` (4800 by default, the
size of τ2's rendered prompts). The rollout registers it as the engine's shared prefix, so
its full pages are computed once per policy version and shared by every conversation:
`prefix_prefill_tokens` (over all runs, which share one policy version) is that prefix once,
not once per conversation, and `prefix_hits` counts the conversations that started on it.

Runs alternate which mode goes first each round. All decode and extend programs are
compiled before anything is timed (one pass over every batch bucket).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from muajax.bench import common

BENCH_KEY_ENV = "MUAJAX_BENCH_USER_KEY"  # never set: a local server needs no key


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_config(hidden: int = 32, layers: int = 1):
    """A tiny Qwen3 with the real vocabulary (so the real tokenizer's ids fit)."""
    from muajax.models.qwen3 import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=8)


def random_params(cfg, seed: int = 0):
    """Random weights drawn with numpy (Flax's init is slow for a 152k vocabulary on CPU)."""
    import jax
    import jax.numpy as jnp

    from muajax.models.qwen3 import init_params

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = []
    for path, leaf in flat:
        name = str(path[-1])
        if "norm" in name:
            value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        else:
            value = 0.02 * rng.standard_normal(leaf.shape)
        leaves.append(jnp.asarray(value.astype(np.float32)))
    return jax.tree_util.tree_unflatten(tree, leaves)


CHATTY_TEXT = ('Hello, I can help with your order. Please confirm: yes? name zip think find_user get_order '
               '<tool_call>\n{"name": "think", "arguments": {"thought": "ok"}}\n</tool_call>')


def chatty_params(params, tokenizer, *, text: str = CHATTY_TEXT, mean_turn_tokens: float = 8.0):
    """Bend a random model towards a small vocabulary (the tokens of `text`) and a turn that
    ends with `<|im_end|>` after about `mean_turn_tokens` tokens.

    A random model over 152k ids almost never samples `<|im_end|>`, so every turn would run
    to its token budget and nothing would look like a tool call. One constant feature in
    the embeddings (dimension 0) survives the final RMSNorm as ~sqrt(hidden); the LM head
    reads it to lift the chosen ids. The rest of the network stays random, so outputs still
    vary with the context: garbage text, broken tool calls, some well-formed ones by chance.
    """
    import jax.numpy as jnp

    from muajax.models.tokenizer import IM_END_ID

    cfg_hidden = params["embed"].shape[1]
    favored = sorted(set(tokenizer.encode(text, add_special_tokens=False)))
    feature = float(np.sqrt(cfg_hidden))  # what dimension 0 becomes after the final norm
    lift = 12.0 / feature  # e^12 * |favored| >> 152k: the favored ids take nearly all the mass
    end_odds = len(favored) / max(mean_turn_tokens - 1.0, 1e-3)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    head = head.at[0, :].set(0.0).at[0, jnp.asarray(favored)].set(lift)
    head = head.at[0, IM_END_ID].set(lift + float(np.log(end_odds)) / feature)
    embed = params["embed"].at[:, 0].set(float(np.sqrt(cfg_hidden / 2.0)))
    out = dict(params, embed=embed)
    if "lm_head" not in params:
        raise ValueError("chatty_params needs untied embeddings (an lm_head)")
    out["lm_head"] = head
    return out


# ---------------------------------------------------------------------------------------------- user endpoint


class DelayedUserServer:
    """A minimal OpenAI-compatible chat endpoint on 127.0.0.1: every reply comes after
    `delay_s`; the user says ###STOP### once the agent has spoken `user_turns` times."""

    def __init__(self, delay_s: float, user_turns: int):
        self.delay_s, self.user_turns = delay_s, user_turns
        self.requests = 0
        self._server = self._thread = self._sock = None

    def start(self) -> DelayedUserServer:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise common.BenchError("the local user endpoint did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._sock.close()

    async def _chat(self, request):
        from starlette.responses import JSONResponse

        body = json.loads(await request.body())
        self.requests += 1
        await asyncio.sleep(self.delay_s)
        heard = sum(1 for m in body["messages"] if m.get("role") == "user")  # role-flipped: the agent
        text = "Thanks, that is all. ###STOP###" if heard >= self.user_turns else "Yes, please go on."
        return JSONResponse({
            "id": f"bench-{self.requests}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})


# ---------------------------------------------------------------------------------------------- the benchmark


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench rollout --shop", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="rollouts per task (conversations = tasks x n)")
    p.add_argument("--delay", type=float, default=2.0, help="seconds the user endpoint takes per reply")
    p.add_argument("--user-turns", type=int, default=3, help="the user stops after this many agent messages")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-new", type=int, default=16, help="max new tokens per assistant turn")
    p.add_argument("--turn-tokens", type=float, default=6.0, help="mean assistant turn length of the tiny model")
    p.add_argument("--decode-chunk", type=int, default=2,
                   help="decode steps per engine.step(); smaller than a turn, so conversations drift apart")
    p.add_argument("--system-tokens", type=int, default=4800,
                   help="pad the domain's policy to a system prompt of about this many tokens (0: as it is)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per conversation (default: prompt + 512)")
    p.add_argument("--repeat", type=int, default=1, help="timed rounds per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 tasks x 2, short delay: checks the bench runs")
    args = p.parse_args(argv)
    if args.quick:
        args.tasks, args.n, args.delay, args.repeat, args.system_tokens = 2, 2, 0.3, 1, min(args.system_tokens, 600)
    if min(args.tasks, args.n, args.user_turns, args.max_turns, args.max_new, args.decode_chunk, args.repeat) < 1:
        raise common.BenchError("--tasks, --n, --user-turns, --max-turns, --max-new, --decode-chunk and --repeat "
                                "must be >= 1")
    if args.delay < 0 or args.system_tokens < 0:
        raise common.BenchError("--delay and --system-tokens must be >= 0")
    return args


def padded_policy(tok, policy: str, tools, tokens: int) -> str:
    """`policy` with numbered filler rules appended until its system prompt has about `tokens`
    tokens (a policy as long as τ2's, on the built-in domain)."""
    from muajax.agent.chat import system_prompt_ids

    text, rule = policy, 0
    while len(system_prompt_ids(tok, text, tools)) < tokens:
        missing = tokens - len(system_prompt_ids(tok, text, tools))
        lines = [f"\n- Rule {rule + i}: confirm the order id and the user's zip code before any change."
                 for i in range(max(1, missing // 20))]  # ~18 tokens a line: never far past `tokens`
        text, rule = text + "".join(lines), rule + len(lines)
    return text


def precompile(engine, prompt: list[int]) -> float:
    """Compile every decode program and the extend programs a rollout uses (prompt width and
    turn width, per batch bucket), so no timed run pays for compilation."""
    from muajax.engine.engine import SamplingParams

    start = time.perf_counter()
    for bucket in engine.batch_buckets:
        slots = [engine.open(prompt, seed=i) for i in range(bucket)]
        engine.flush(slots, keep_last=True)
        for width in engine.extend_widths[:-1]:
            for s in slots:
                engine.append(s, prompt[1: width + 1])
            engine.flush(slots, keep_last=True)
        engine.generate(slots, SamplingParams(max_new_tokens=1))
        for s in slots:
            engine.release(s)
    return time.perf_counter() - start


def run(argv: list[str]) -> dict:
    """`--shop`: this bench; otherwise the profile-driven one (`muajax.bench.profile_rollout`)."""
    if "--shop" not in argv:
        from muajax.bench import profile_rollout

        return profile_rollout.run(argv)
    return run_shop([a for a in argv if a != "--shop"])


def run_shop(argv: list[str]) -> dict:
    args = parse(argv)
    os.environ.pop(BENCH_KEY_ENV, None)
    from muajax.agent.rollout_config import RolloutConfig

    engine, tok, env, tasks, policy, prompt = _build(args)
    conversations = args.tasks * args.n
    engine.register_prefix(prompt)  # precompiling on the shared prefix: one prefill, not one per slot
    compile_s = precompile(engine, prompt)
    engine.clear_prefixes()  # the timed runs start without it, as a new policy version does
    common.log(f"compiled {len(engine.batch_buckets)} batch buckets in {compile_s:.1f}s")
    options = RolloutConfig(n_per_task=args.n, max_turns=args.max_turns, max_new_tokens_per_turn=args.max_new,
                            max_context=args.max_len, system_text=policy)
    server = DelayedUserServer(args.delay, args.user_turns).start()
    try:
        results = asyncio.run(_rounds(args, engine, tok, env, tasks, options, server.url, conversations))
    finally:
        server.stop()
    same = results.pop("same_conversations")
    return _report(args, results, same, engine, prompt, conversations, compile_s)


def _build(args):
    """The tiny chatty model on an engine, the built-in domain and its tasks, and the padded
    system prompt: (engine, tokenizer, env, tasks, policy text, prompt ids). Sets
    `args.max_len` when it was not given."""
    from muajax.agent.chat import system_prompt_ids
    from muajax.domains.builtin import BuiltinEnvironment
    from muajax.engine.engine import Engine
    from muajax.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    cfg = tiny_config()
    params = chatty_params(random_params(cfg, args.seed), tok, mean_turn_tokens=args.turn_tokens)
    env = BuiltinEnvironment(seed=args.seed)
    tasks = env.tasks("train")[: args.tasks]
    conversations = args.tasks * args.n
    tools = env.reset(tasks[0]).tools()
    policy = padded_policy(tok, env.policy(), tools, args.system_tokens)
    prompt = system_prompt_ids(tok, policy, tools)
    args.max_len = args.max_len or len(prompt) + 512
    if len(prompt) + 200 > args.max_len:
        raise common.BenchError(f"--max-len {args.max_len} leaves no room after the {len(prompt)}-token prompt")
    engine = Engine(params, cfg, num_slots=conversations, max_len=args.max_len, decode_chunk=args.decode_chunk,
                    extend_widths=(128,))
    common.log(f"{conversations} conversations ({args.tasks} tasks x {args.n}), tiny Qwen3 "
               f"(hidden {cfg.hidden_size}, vocab {cfg.vocab_size}), user reply delay {args.delay:g}s, "
               f"prompt {len(prompt)} tokens")
    return engine, tok, env, tasks, policy, prompt


async def _rounds(args, engine, tok, env, tasks, options, user_url: str,
                  conversations: int) -> dict[str, list[dict[str, Any]]]:
    """`args.repeat` rounds of both modes, alternating which goes first: each run's stats per
    mode, and whether both modes produced the same conversations."""
    from muajax.agent.rollout import run_rollouts
    from muajax.domains.openai_user import OpenAIUserSimulator

    user = OpenAIUserSimulator(model="bench-user", base_url=user_url, api_key_env=BENCH_KEY_ENV,
                               max_concurrency=conversations, timeout_s=60.0 + args.delay, max_retries=0)
    out: dict[str, list[dict[str, Any]]] = {"overlap": [], "baseline": []}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for r in range(args.repeat):
            for mode in (("overlap", "baseline") if r % 2 == 0 else ("baseline", "overlap")):
                batch = await run_rollouts(engine, tok, env, user, tasks, options=options, seed=args.seed,
                                           overlap_io=(mode == "overlap"))
                failed = sum(t.failed for t in batch)
                if failed:
                    raise common.BenchError(f"{failed} conversations failed in the {mode} run: "
                                            f"{next(t.error for t in batch if t.failed)}")
                tokens.setdefault(mode, [t.tokens for t in batch])
                stats = dict(batch.stats, sampled=sum(t.num_sampled for t in batch),
                             user_turns=sum(len(t.user_latency_s) for t in batch))
                out[mode].append(stats)
                common.log(f"  {mode:8s} wall {stats['wall_s']:7.2f}s  device {stats['device_s']:7.2f}s  "
                           f"busy {stats['busy_share']:.3f}  sampled {stats['sampled']}  "
                           f"user turns {stats['user_turns']}  peak live {stats['peak_live']}  "
                           f"prefix: prefilled {stats['prefix_prefill_tokens']} tokens, {stats['prefix_hits']} hits")
    finally:
        await user.aclose()
    # per-rollout seeds: both schedules must produce the very same conversations
    out["same_conversations"] = tokens["overlap"] == tokens["baseline"]
    return out


def _report(args, results: dict, same: bool, engine, prompt: list[int], conversations: int,
            compile_s: float) -> dict:
    """Log the medians of both modes and the shared prefix's savings; the benchmark's JSON."""
    med = {mode: {k: common.median([r[k] for r in runs]) for k in ("busy_share", "wall_s", "device_s", "sampled")}
           for mode, runs in results.items()}
    o, b = med["overlap"], med["baseline"]
    common.log(f"busy share: overlapped {o['busy_share']:.3f} vs waiting-for-each-reply {b['busy_share']:.3f} "
               f"(ratio {common.ratio(o['busy_share'], b['busy_share']):.2f}x)")
    common.log(f"same conversations in both modes: {same}")
    # every run has the same params (one policy version): the prefix is computed in the first
    prefix = {k: sum(r[k] for runs in results.values() for r in runs) for k in ("prefix_prefill_tokens", "prefix_hits")}
    shared = len(prompt) // engine.page_size * engine.page_size  # full pages only are shared
    runs_done = sum(map(len, results.values()))
    common.log(f"system prompt {len(prompt)} tokens ({shared} in shared pages): prefilled {prefix['prefix_prefill_tokens']} "
               f"prefix tokens over {runs_done} runs of {conversations} conversations, {prefix['prefix_hits']} prefix hits "
               f"(without sharing: {shared * conversations * runs_done} tokens)")
    common.log(f"wall time:  overlapped {o['wall_s']:.2f}s vs waiting-for-each-reply {b['wall_s']:.2f}s "
               f"(speed-up {common.ratio(b['wall_s'], o['wall_s']):.2f}x)")
    return {
        "busy_share": o["busy_share"], "baseline_busy_share": b["busy_share"],
        "busy_share_ratio": common.ratio(o["busy_share"], b["busy_share"]),
        "wall_s": o["wall_s"], "baseline_wall_s": b["wall_s"], "speedup": common.ratio(b["wall_s"], o["wall_s"]),
        "sampled_tokens": o["sampled"], "baseline_sampled_tokens": b["sampled"], "same_conversations": same,
        "conversations": conversations, "user_delay_s": args.delay, "compile_s": compile_s,
        "system_prompt_tokens": len(prompt), "prefix_tokens": shared, **prefix,
        "runs": results, "machine": common.machine_info(),
    }
