"""`python -m muajax.bench rollout` (the default): the engine on a τ2-like rollout profile.

How many positions does the engine compute per real token, and how busy is it, when
conversations of a measured shape (`configs/profiles/tau2-retail.json` by default; see
`muajax.planning.rollout_profile`) arrive one turn at a time? The conversations are drawn
from the profile with a fixed seed (`muajax.planning.rollout_schedule.draw_conversations`:
agent turns, tokens per agent turn, tool result or user reply after each turn, the user's
latency), all opening with one shared system prompt of the profile's size (the engine's
shared prefix, `register_prefix`). Token ids are random (no tokenizer); the model is a tiny
random Qwen3. Every agent turn samples exactly its drawn length (the engine has no stop
ids; `max_new_tokens` is the draw), then its reply is appended after its latency: tool
results at once, user replies after `--user-latency` seconds (the profile's own when it has
one) times `--latency-scale`, waited in real time. A waiting conversation costs nothing:
the loop steps the engine over whoever is generating and sleeps only when nobody is.

The same conversations, token ids and sampling seeds run through each engine mode of
`MODES`, in one process: `fixed` (every call has one row per conversation:
`rollout.call_layout: fixed_rows`) and `packed` (the deterministic packed mode, the default). Per mode:
positions the layers computed over real tokens, for extends (`extend_positions /
extend_tokens`) and decode (`decode_positions / decode_tokens`), the busy share (engine
device time / wall), wall seconds and calls; then the packed figures over the fixed ones.
Each engine compiles all its programs first (`Engine.warmup`), untimed.
"""
from __future__ import annotations

import argparse
import heapq
import os
import time

import numpy as np

from muajax.bench import common

DEFAULT_PROFILE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "profiles", "tau2-retail.json")
TARGETS = {"extend_computed_over_real": 1.5, "decode_computed_over_real": 1.3}  # issue 31, packed mode


def _fixed(rows_per_shard: int) -> dict:
    return {"batch_rows": rows_per_shard}


def _packed(rows_per_shard: int) -> dict:
    """Packed calls with token tiles: deterministic, today's `rollout.deterministic: true`."""
    return {"batch_rows": None, "deterministic": True}


# Engine kwargs per mode, from the conversations per shard; `fixed` first: it is the reference.
MODES = {"fixed": _fixed, "packed": _packed}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench rollout", description=__doc__.splitlines()[0],
                                epilog="--shop: the built-in shop domain behind a delayed HTTP user "
                                       "(python -m muajax.bench rollout --shop --help)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="a rollout profile .json or a run directory")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (default: the profile's)")
    p.add_argument("--max-turns", type=int, default=None, help="cap the drawn agent turns per conversation")
    p.add_argument("--user-latency", type=float, default=None,
                   help="seconds per user reply before scaling (default: the profile's mean, or 2.0 where it is 0)")
    p.add_argument("--latency-scale", type=float, default=0.5,
                   help="real seconds waited per second of user latency (0: none)")
    p.add_argument("--decode-chunk", type=int, default=16, help="decode steps per engine.step() (the trainer's)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads of head_dim 8, twice as many query heads: "
                                                             "the cache's bytes per token, which the calls stream")
    p.add_argument("--vocab", type=int, default=1024, help="random token ids below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 conversations of <= 3 turns, a 256-token system prompt")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.system_tokens = min(args.conversations, 4), min(args.system_tokens or 256, 256)
        args.max_turns, args.latency_scale = min(args.max_turns or 3, 3), min(args.latency_scale, 0.01)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        raise common.BenchError(f"--modes: choose among {', '.join(MODES)}, got {args.modes}")
    if min(args.conversations, args.decode_chunk, args.hidden, args.layers, args.kv_heads, args.max_turns or 1) < 1:
        raise common.BenchError("--conversations, --decode-chunk, --hidden, --layers, --kv-heads and --max-turns "
                                "must be >= 1")
    if args.vocab < 2 or args.latency_scale < 0 or (args.user_latency or 0) < 0 or (args.system_tokens or 1) < 1:
        raise common.BenchError("need --vocab >= 2, --system-tokens >= 1, latencies >= 0")
    return args


# ---------------------------------------------------------------------------------------------- the workload


def draw_workload(args) -> dict:
    """The conversations, drawn once for every mode: the profile's shapes with the system
    prompt and user latency as asked, their token ids and sampling seeds."""
    import dataclasses

    from muajax.planning.rollout_profile import Distribution, ProfileError, RolloutProfile
    from muajax.planning.rollout_schedule import draw_conversations

    try:
        profile = RolloutProfile.load(args.profile)
    except ProfileError as exc:
        raise common.BenchError(str(exc)) from None
    system = args.system_tokens or profile.system_tokens
    latency = profile.user_latency_s
    if args.user_latency is not None:
        latency = Distribution(args.user_latency)
    elif latency.mean <= 0:
        latency = Distribution(2.0)
    profile = dataclasses.replace(profile, system_tokens=system, user_latency_s=latency)
    rng = np.random.default_rng(args.seed)
    convs = draw_conversations(profile, args.conversations, rng, max_new_tokens=1 << 20)
    if args.max_turns:
        for c in convs:
            c.sampled, c.replies, c.latency = (c.sampled[: args.max_turns], c.replies[: args.max_turns - 1],
                                               c.latency[: args.max_turns - 1])
    ids = np.random.default_rng(args.seed + 1)
    system_ids = ids.integers(0, args.vocab, system).tolist()
    prompts = [system_ids + ids.integers(0, args.vocab, c.prompt - system).tolist() for c in convs]
    replies = [[ids.integers(0, args.vocab, n).tolist() for n in c.replies] for c in convs]
    lengths = [c.prompt + sum(c.sampled) + sum(c.replies) for c in convs]
    return {"profile": profile, "convs": convs, "system_ids": system_ids, "prompts": prompts, "replies": replies,
            "max_len": max(lengths) + 1, "real_tokens": sum(lengths), "seeds": [args.seed * 100003 + i
                                                                                  for i in range(len(convs))]}


# ---------------------------------------------------------------------------------------------- one mode


def build_engine(args, mode: str, max_len: int, params, cfg):
    from muajax.engine.engine import Engine

    return Engine(params, cfg, num_slots=args.conversations, max_len=max_len, stop_ids=(),
                  decode_chunk=args.decode_chunk, **MODES[mode](args.conversations))


def play(engine, work: dict, latency_scale: float) -> dict:
    """Every conversation to its end on `engine`, replies arriving after their (scaled)
    latency; returns the engine's counts over the run, its wall time and what it sampled."""
    from muajax.engine.engine import SamplingParams

    convs, before = work["convs"], dict(engine.stats)
    engine.register_prefix(work["system_ids"])
    slots: dict[int, int] = {}  # engine slot -> conversation
    slot_of: dict[int, int] = {}  # conversation -> engine slot
    turn = [0] * len(convs)
    sampled = [0] * len(convs)
    arrivals = [(0.0, i) for i in range(len(convs))]  # (seconds after the start, conversation)
    heapq.heapify(arrivals)
    generating, start, shown = 0, time.perf_counter(), 0.0
    total = sum(len(c.sampled) for c in convs)
    while arrivals or generating:
        now = time.perf_counter() - start
        if now - shown >= 30:
            shown = now
            common.log(f"    {now:6.0f}s: {sum(turn)}/{total} turns, {len(slots)} open, {generating} generating")
        while arrivals and arrivals[0][0] <= now:
            i = heapq.heappop(arrivals)[1]
            if turn[i] == 0:
                slot = slot_of[i] = engine.open(work["prompts"][i], seed=work["seeds"][i])
                slots[slot] = i
            else:
                slot = slot_of[i]
                engine.append(slot, work["replies"][i][turn[i] - 1])
            engine.start(slot, SamplingParams(max_new_tokens=convs[i].sampled[turn[i]]))
            generating += 1
        if not generating:
            time.sleep(max(arrivals[0][0] - (time.perf_counter() - start), 0.0))
            continue
        for gen in engine.step():
            i, generating = slots[gen.slot], generating - 1
            if len(gen.tokens) != convs[i].sampled[turn[i]]:
                raise common.BenchError(f"conversation {i} turn {turn[i]}: sampled {len(gen.tokens)} tokens, drew "
                                        f"{convs[i].sampled[turn[i]]} ({gen.finish_reason})")
            sampled[i] += len(gen.tokens)
            turn[i] += 1
            if turn[i] == len(convs[i].sampled):
                engine.release(gen.slot)
                del slots[gen.slot]
            else:
                wait = convs[i].latency[turn[i] - 1] * latency_scale
                heapq.heappush(arrivals, (time.perf_counter() - start + wait, i))
    wall = time.perf_counter() - start
    engine.clear_prefixes()
    stats = {k: engine.stats[k] - before[k] for k in before if k != "peak_pages"}
    shared = len(work["system_ids"]) // engine.page_size * engine.page_size  # full pages only are shared
    return {"wall_s": wall, "stats": stats, "sampled": sampled, "prefix_tokens": shared}


def figures(run: dict) -> dict:
    """A mode's figures from its run."""
    s = run["stats"]
    return {
        "extend_computed_over_real": common.ratio(s["extend_positions"], s["extend_tokens"]),
        "decode_computed_over_real": common.ratio(s["decode_positions"], s["decode_tokens"]),
        "busy_share": common.ratio(s["device_s"], run["wall_s"]), "wall_s": run["wall_s"],
        "device_s": s["device_s"], "extend_calls": s["extend_calls"], "decode_calls": s["decode_calls"],
        "calls": s["extend_calls"] + s["decode_calls"], "extend_tokens": s["extend_tokens"],
        "extend_positions": s["extend_positions"], "decode_tokens": s["decode_tokens"],
        "decode_positions": s["decode_positions"], "decode_steps": s["decode_steps"],
        "prefix_hits": s["prefix_hits"], "prefix_prefill_tokens": s["prefix_prefill_tokens"],
        "preemptions": s["preemptions"], "prefix_tokens": run["prefix_tokens"],
    }


def run_mode(args, mode: str, work: dict, params, cfg) -> dict:
    engine = build_engine(args, mode, work["max_len"], params, cfg)
    start = time.perf_counter()
    programs = engine.warmup()
    compile_s = time.perf_counter() - start
    common.log(f"{mode}: compiled {programs} programs in {compile_s:.1f}s")
    run = play(engine, work, args.latency_scale)
    engine.release_memory()
    out = dict(figures(run), compile_s=compile_s, programs=programs, engine_kwargs=MODES[mode](args.conversations))
    if run["sampled"] != [sum(c.sampled) for c in work["convs"]]:
        raise common.BenchError(f"{mode}: the conversations did not sample their drawn turns")
    common.log(f"  {mode:7s} extend computed/real {out['extend_computed_over_real']:7.2f}  decode computed/real "
                f"{out['decode_computed_over_real']:5.2f}  busy {out['busy_share']:.3f}  wall {out['wall_s']:7.2f}s  "
                f"device {out['device_s']:7.2f}s  calls {out['extend_calls']} extend + {out['decode_calls']} decode")
    return out


# ---------------------------------------------------------------------------------------------- the benchmark


def tiny_model(args):
    import jax

    from muajax.models.qwen3 import Qwen3Config, init_params

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_layers=args.layers, num_heads=2 * args.kv_heads, num_kv_heads=args.kv_heads, head_dim=8)
    return cfg, init_params(cfg, jax.random.key(args.seed))


def run(argv: list[str]) -> dict:
    args = parse(argv)
    work = draw_workload(args)
    profile, convs = work["profile"], work["convs"]
    cfg, params = tiny_model(args)
    users = sum(1 for c in convs for x in c.latency if x > 0)
    common.log(f"profile {profile.name}: {len(convs)} conversations, {sum(len(c.sampled) for c in convs)} agent "
               f"turns ({users} user replies, {profile.user_latency_s.mean:g}s latency x {args.latency_scale:g}), "
               f"system prompt {profile.system_tokens} tokens, {work['real_tokens']} tokens in all (longest "
               f"{work['max_len'] - 1}); tiny Qwen3 hidden {cfg.hidden_size} x {cfg.num_layers} layers, "
               f"vocab {cfg.vocab_size}")
    modes = {mode: run_mode(args, mode, work, params, cfg) for mode in args.modes}
    return report(args, work, modes)


def report(args, work: dict, modes: dict) -> dict:
    """Log the packed mode beside the fixed one; the benchmark's JSON (the headline figures
    are the last mode's: packed by default)."""
    profile, convs = work["profile"], work["convs"]
    head = modes[args.modes[-1]]
    out = {key: head[key] for key in ("extend_computed_over_real", "decode_computed_over_real", "busy_share",
                                       "wall_s")}
    out["mode"] = args.modes[-1]
    if "fixed" in modes and "packed" in modes:
        fixed, packed = modes["fixed"], modes["packed"]
        for key in ("extend_computed_over_real", "decode_computed_over_real", "busy_share", "wall_s", "device_s",
                    "calls"):
            out[f"fixed_{key}"] = fixed[key]
            out[f"{key}_ratio"] = common.ratio(packed[key], fixed[key])
            common.log(f"{key:26s} packed {packed[key]:9.3f}  fixed rows {fixed[key]:9.3f}  "
                       f"(packed / fixed {out[f'{key}_ratio']:.3f})")
        for key, limit in TARGETS.items():
            common.log(f"{key}: {packed[key]:.3f} (target <= {limit}, fixed rows today {fixed[key]:.3f})")
    out["targets"] = dict(TARGETS)
    out["modes"] = modes
    out["workload"] = {
        "profile": profile.name, "conversations": len(convs), "system_prompt_tokens": profile.system_tokens,
        "agent_turns": sum(len(c.sampled) for c in convs), "sampled_tokens": sum(sum(c.sampled) for c in convs),
        "reply_tokens": sum(sum(c.replies) for c in convs), "real_tokens": work["real_tokens"],
        "longest": work["max_len"] - 1, "user_latency_s": profile.user_latency_s.mean,
        "latency_scale": args.latency_scale, "user_replies": sum(1 for c in convs for x in c.latency if x > 0),
        "decode_chunk": args.decode_chunk, "seed": args.seed,
        "model": {"hidden": args.hidden, "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": 8,
                  "vocab": args.vocab},
    }
    out["machine"] = common.machine_info()
    return out
