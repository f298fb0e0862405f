"""`python -m muajax.bench multiturn`: a multi-turn conversation whose KV cache the engine
keeps across turns, against the same conversation re-prefilled from scratch every turn.

Each turn appends `user` tokens (a user or tool message, random ids) and generates
exactly `new` tokens (greedy, no stop token). Two engines, identical options:
- kept: one slot for the whole conversation; turn 1 `open`s it, later turns `append`;
  only the new tokens are ever prefilled, so a turn's cost should not grow.
- re-prefill: every turn opens a fresh slot with the whole history so far (its own
  earlier generations included), generates, releases; its prefill grows with the history.
Both engines get the same extend-width buckets, fine-grained (64, then every 128 tokens)
so the re-prefill baseline pads at most 127 tokens per prefill: its best case, which
keeps the speedup conservative. Both engines are built alike, so the only difference between
the two is the KV reuse. A kept turn still costs a little more as the history grows: decode
attends over every cached token (`per_turn_growth` is that growth, last turn over first).

A turn's time is wall time from the first `open`/`append` to the last generation coming
back, host work included. The two conversations advance turn by turn in alternation
(which goes first alternates too), so load from other processes hits both alike.
Compilation is excluded: the whole scenario runs once both ways (every shape bucket)
before the timed repetitions; per-turn figures are medians over repetitions.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np

from muajax.bench import common
from muajax.bench.generate import build_models, make_engine, setup_threads


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.bench multiturn", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1, help="conversations run side by side (one slot each)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--user", type=int, default=60, help="tokens appended per turn")
    p.add_argument("--new", type=int, default=60, help="tokens generated per turn")
    p.add_argument("--decode-chunk", type=int, default=32, help="Engine(decode_chunk=...)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions of the whole conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model and sizes: checks the bench runs")
    p.add_argument("--no-floor", action="store_true", help="skip the model floor's growth")
    common.add_isa_option(p)
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.user, args.new, args.repeat = 3, 6, 4, 1
        args.decode_chunk = min(args.decode_chunk, 4)
    if min(args.batch, args.turns, args.user, args.new, args.repeat, args.decode_chunk) < 1:
        raise common.BenchError("--batch, --turns, --user, --new, --repeat and --decode-chunk must be >= 1")
    return args


def extend_widths(max_len: int) -> tuple[int, ...]:
    return (64,) + tuple(range(128, max_len, 128))


def kept_turns(engine, user_turns: np.ndarray, new: int, histories: list[list[int]]):
    """The engine as meant: one slot per conversation, turns appended to its cache.

    A generator yielding each turn's seconds, so that two scenarios can alternate turn by turn."""
    from muajax.engine.engine import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    slots: list[int] = []
    for turn, users in enumerate(user_turns):
        start = time.perf_counter()
        if turn == 0:
            slots = [engine.open(u.tolist()) for u in users]
        else:
            for slot, u in zip(slots, users):
                engine.append(slot, u.tolist())
        gens = engine.generate(slots, sampling)
        elapsed = time.perf_counter() - start
        for history, slot, u in zip(histories, slots, users):
            history.extend(u.tolist() + gens[slot].tokens)
        if turn == len(user_turns) - 1:
            for slot in slots:
                engine.release(slot)
        yield elapsed


def reprefill_turns(engine, user_turns: np.ndarray, new: int, histories: list[list[int]]):
    """The baseline: each turn prefills the whole history into a fresh slot (yields seconds per turn)."""
    from muajax.engine.engine import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    for users in user_turns:
        start = time.perf_counter()
        slots = [engine.open(h + u.tolist()) for h, u in zip(histories, users)]
        gens = engine.generate(slots, sampling)
        for slot in slots:
            engine.release(slot)
        elapsed = time.perf_counter() - start
        for history, slot, u in zip(histories, slots, users):
            history.extend(u.tolist() + gens[slot].tokens)
        yield elapsed


SCENARIOS = {"kept": kept_turns, "reprefill": reprefill_turns}


def play(engines: dict, user_turns: np.ndarray, new: int, first: str) -> tuple[dict, dict]:
    """Both conversations, alternating turn by turn (and which goes first), so that load
    from other processes hits both alike. Returns (seconds per turn, histories) per scenario."""
    batch = user_turns.shape[1]
    histories = {name: [[] for _ in range(batch)] for name in SCENARIOS}
    turns = {name: fn(engines[name], user_turns, new, histories[name]) for name, fn in SCENARIOS.items()}
    times: dict[str, list[float]] = {name: [] for name in SCENARIOS}
    order = [first] + [n for n in SCENARIOS if n != first]
    for t in range(len(user_turns)):
        for name in (order if t % 2 == 0 else order[::-1]):
            times[name].append(next(turns[name]))
    return times, histories


def _end_growth(times: list[float]) -> float:
    k = max(1, min(3, len(times) // 2))
    return common.ratio(common.median(times[-k:]), common.median(times[:k]))


def run(argv: list[str]) -> dict:
    args = parse(argv)
    common.apply_isa_cap(args.cap_isa)
    setup_threads()
    with tempfile.TemporaryDirectory(prefix="muajax-bench-multiturn-") as workdir:
        hf_model, params, cfg = build_models(args.quick, args.seed, workdir)
    rng = np.random.RandomState(args.seed + 1)
    user_turns = rng.randint(0, cfg.vocab_size, size=(args.turns, args.batch, args.user)).astype(np.int32)
    total = args.turns * (args.user + args.new)
    max_len = -(-(total + 1) // 128) * 128
    widths = extend_widths(max_len)
    engines = {name: make_engine(params, cfg, args.batch, max_len, args.decode_chunk, extend_widths=widths)
               for name in ("kept", "reprefill")}
    common.log(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
               f"{cfg.num_params() / 1e6:.1f}M params, {cfg.dtype}; {args.batch} conversation(s) x {args.turns} turns "
               f"of +{args.user} / generate {args.new}; max_len {max_len}, decode_chunk {args.decode_chunk}")

    start = time.perf_counter()
    _, warm = play(engines, user_turns, args.new, "kept")
    common.log(f"warm-up (whole scenario, both ways; compiles every shape bucket): {time.perf_counter() - start:.1f}s")
    per_turn: dict[str, list[list[float]]] = {name: [] for name in SCENARIOS}
    for r in range(args.repeat):
        times, _ = play(engines, user_turns, args.new, "kept" if r % 2 == 0 else "reprefill")
        for name in SCENARIOS:
            per_turn[name].append(times[name])
    med = {name: [common.median(col) for col in zip(*runs)] for name, runs in per_turn.items()}
    totals = {name: float(sum(times)) for name, times in med.items()}

    common.log("turn  history  kept_s  reprefill_s  ratio")
    for t in range(args.turns):
        history = t * (args.user + args.new) + args.user
        common.log(f"{t + 1:4d}  {history:7d}  {med['kept'][t]:6.3f}  {med['reprefill'][t]:11.3f}  "
                   f"x{common.ratio(med['reprefill'][t], med['kept'][t]):.2f}")
    result = {
        "config": {k: getattr(args, k) for k in ("batch", "turns", "user", "new", "decode_chunk", "repeat", "quick", "cap_isa")}
                  | {"max_len": max_len},
        "kept_per_turn_s": med["kept"],
        "reprefill_per_turn_s": med["reprefill"],
        "kept_total_s": totals["kept"],
        "reprefill_total_s": totals["reprefill"],
        "per_turn_growth": common.ratio(med["kept"][-1], med["kept"][0]),
        "reprefill_growth": common.ratio(med["reprefill"][-1], med["reprefill"][0]),
        # last/first hangs on two single timings; on a shared machine one stall moves it, this does not
        "per_turn_growth_last3_vs_first3": _end_growth(med["kept"]),
        "reprefill_growth_last3_vs_first3": _end_growth(med["reprefill"]),
        "speedup_vs_reprefill": common.ratio(totals["reprefill"], totals["kept"]),
        # same greedy conversation both ways? (a sanity check; float rounding may flip a near-tie)
        "same_conversation": warm["kept"] == warm["reprefill"],
    }
    common.log(f"total: kept {totals['kept']:.3f}s  re-prefill {totals['reprefill']:.3f}s  "
               f"speedup x{result['speedup_vs_reprefill']:.2f}")
    common.log(f"turn cost growth, last/first turn: kept x{result['per_turn_growth']:.2f}, re-prefill "
               f"x{result['reprefill_growth']:.2f}; median of last 3 / first 3 turns: kept "
               f"x{result['per_turn_growth_last3_vs_first3']:.2f}, re-prefill x{result['reprefill_growth_last3_vs_first3']:.2f}")
    if not args.no_floor:
        result.update(floor_growth(hf_model, args, result))
    result["machine"] = common.machine_info()
    return result


def decode_context(args, turn: int) -> int:
    """The mean number of positions a decode step of `turn` (0-based) attends over."""
    return turn * (args.user + args.new) + args.user + (args.new - 1) // 2


def turn_history(args, turn: int) -> int:
    """Positions cached when `turn`'s (0-based) message is extended."""
    return turn * (args.user + args.new)


STREAM_CALLS = 8  # reads of a decode step's bytes per timed sample of the stream floor


def floor_growth(hf_model, args, result: dict) -> dict:
    """The growth a turn's own work has between the same turns, in plain XLA: the extend of
    its `user` tokens over its history (`extend_floor`), then `new` decode steps of the whole
    model (`model_floor`), `batch` rows over the turn's mean decode context, in chunks as the
    engine decodes. Both read the history, so a turn's cost grows with it on any engine; how
    much is the box's (its caches and memory against its arithmetic):
    `per_turn_growth_over_floor` is what the engine adds. `floor_decode_growth` is the decode
    steps' alone, and `stream_step_growth` that of only reading a step's bytes (`model_floor.
    xla_stream_step`): the physical floor of a decode step's growth on this box's memory."""
    from muajax.bench import extend_floor, model_floor

    k = max(1, min(3, args.turns // 2))
    turns = {"first": 0, "last": args.turns - 1, "first3": (k - 1) // 2, "last3": args.turns - 1 - (k - 1) // 2}
    weights, shape = model_floor.model_weights(hf_model), model_floor.model_shape(hf_model.config)
    calls = -(-args.new // args.decode_chunk)
    programs = {("step", name): model_floor.xla_model_step(weights, shape, args.batch, decode_context(args, turn),
                                                          args.decode_chunk, calls)
                for name, turn in turns.items()}
    programs |= {("extend", name): extend_floor.xla_model_extend(weights, shape, args.batch, turn_history(args, turn),
                                                                args.user)
                 for name, turn in turns.items()}
    programs |= {("stream", name): model_floor.xla_stream_step(weights, shape, args.batch, decode_context(args, turn),
                                                              STREAM_CALLS)
                 for name, turn in turns.items()}
    times = common.interleave(programs, warmup=2, repeat=max(5, 5 * args.repeat))
    step_ms = {name: 1e3 * common.median(times[("step", name)]) / (calls * args.decode_chunk) for name in turns}
    stream_ms = {name: 1e3 * common.median(times[("stream", name)]) / STREAM_CALLS for name in turns}
    extend_ms = {name: 1e3 * common.median(times[("extend", name)]) for name in turns}
    turn_ms = {name: extend_ms[name] + args.new * step_ms[name] for name in turns}
    out = {"floor_step_ms": {name: step_ms[name] for name in ("first", "last")},
           "floor_extend_ms": {name: extend_ms[name] for name in ("first", "last")},
           "floor_turn_ms": {name: turn_ms[name] for name in ("first", "last")},
           "floor_contexts": {name: decode_context(args, turn) for name, turn in turns.items()},
           "floor_growth": common.ratio(turn_ms["last"], turn_ms["first"]),
           "floor_growth_last3_vs_first3": common.ratio(turn_ms["last3"], turn_ms["first3"]),
           "floor_decode_growth": common.ratio(step_ms["last"], step_ms["first"]),
           "stream_step_ms": {name: stream_ms[name] for name in ("first", "last")},
           "stream_step_growth": common.ratio(stream_ms["last"], stream_ms["first"])}
    out["per_turn_growth_over_floor"] = common.ratio(result["per_turn_growth"], out["floor_growth"])
    out["per_turn_growth_last3_vs_first3_over_floor"] = common.ratio(result["per_turn_growth_last3_vs_first3"],
                                                                     out["floor_growth_last3_vs_first3"])
    common.log(f"a turn's own work in plain XLA (extend {args.user} tokens, {args.new} decode steps) grows "
               f"x{out['floor_growth']:.2f} from the first turn to the last ({turn_ms['first']:.1f} -> "
               f"{turn_ms['last']:.1f} ms; extend {extend_ms['first']:.1f} -> {extend_ms['last']:.1f} ms, decode step "
               f"{step_ms['first']:.2f} -> {step_ms['last']:.2f} ms, x{out['floor_decode_growth']:.2f}; last 3 / first 3 "
               f"x{out['floor_growth_last3_vs_first3']:.2f}): the engine's growth is x{out['per_turn_growth_over_floor']:.2f} "
               f"its floor's (x{out['per_turn_growth_last3_vs_first3_over_floor']:.2f} last 3 / first 3)")
    common.log(f"reading a decode step's bytes alone (weights, and the cache at the turn's mean context) takes "
               f"{stream_ms['first']:.2f} -> {stream_ms['last']:.2f} ms, x{out['stream_step_growth']:.2f}: the growth of "
               f"a step whose attention read the cache at the box's streaming rate")
    return out


if __name__ == "__main__":
    from muajax.bench.__main__ import main

    raise SystemExit(main(["multiturn", *sys.argv[1:]]))
