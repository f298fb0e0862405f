"""A GRPO step's rollout played through the engine's schedule, call by call.

`simulate` mirrors `muajax.agent.rollout._Driver.run` driving `muajax.engine.engine.Engine`:
- conversations are admitted while slots are free; the first one computes the system
  prompt's full pages once (one extend, the engine's shared prefix: `register_prefix`),
  every admitted one then extends the rest of its prompt;
- each loop iteration is one `engine.step()`: every generating conversation's queued
  tokens but the last are extended, then one decode chunk of up to `decode_chunk` steps
  runs over all of them (as many calls as the rows allow), stopping early when every row
  is done. The calls are laid out as the engine lays them out (`Schedule.call_rows`,
  `tiled`): packed (the default: every waiting token in rows of `extend_tile`, rows per
  shard a power of two, `batching.packed_extend_batches`; with token tiles only the live
  rows, and of a decode only the live tiles of `decode_tile` rows, are computed) or fixed
  rows (every call `call_rows` rows per shard, each conversation extended at its own
  width bucket, every padded slot computed: `batching.extend_batches` with fixed_rows);
- a finished agent turn waits for its tool result or user reply; the reply is posted while
  the next step runs, so it joins the step after that (or at once, when nothing else is
  decoding and the loop waits on its inbox), and not before the user's latency has passed;
  with `overlap_io` off nothing decodes while a reply is pending;
- a conversation ends after its last agent turn, at `max_turns`, or when its context is
  full (`max_context`).
Each call's shape (rows, width, key positions, steps run, rows computed) is priced by
`CallTimes`; the run counts the positions computed beside the real tokens, as the engine's
stats do (`extend_positions` / `extend_tokens`, `decode_positions` / `decode_tokens`).
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from muajax.engine import batching
from muajax.planning.rollout_profile import RolloutProfile


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The engine and rollout settings that shape the calls (one host's engine)."""

    conversations: int                 # this host's share of a step's rollouts
    num_slots: int
    max_context: int
    max_new_tokens: int
    max_turns: int
    decode_chunk: int = 16
    widths: tuple[int, ...] = (32, 128, 512, 2048)
    max_extend_tokens: int = 8192
    page_size: int = 16
    call_rows: int | None = None       # fixed rows per shard of every call (rollout.call_layout fixed_rows)
    min_batch_bucket: int = 1
    shards: int = 1                    # the engine mesh's batch shards
    dense_buckets: bool = True         # the decode gathers a power-of-two bucket of pages (the dense "reference")
    overlap_io: bool = True
    tiled: bool = False                # token tiles (packed and deterministic): only live tiles are computed
    extend_tile: int = 16              # tokens per row of a packed extend (the Engine's extend_tile)
    decode_tile: int = 4               # rows per decode tile (the Engine's decode_tile)

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Rows per shard a decode call can have (`batching.decode_buckets`, as the Engine)."""
        if self.call_rows:
            return (self.call_rows,)
        if self.tiled:
            return batching.decode_buckets(self.num_slots, self.min_batch_bucket, None, self.decode_tile)
        per_shard = -(-self.num_slots // self.shards)
        return batching.buckets(per_shard, min(self.min_batch_bucket, per_shard))

    @property
    def extend_row_buckets(self) -> tuple[int, ...]:
        """Rows per shard a packed extend call can have (`Engine.extend_buckets`: with token
        tiles at least `batching.MIN_TILES`)."""
        least = batching.MIN_TILES if self.tiled else 1
        return batching.buckets(max(least, self.max_extend_tokens // self.extend_tile), least)

    @property
    def layout(self) -> str:
        return "fixed_rows" if self.call_rows else "packed, token tiles" if self.tiled else "packed"

    @property
    def extend_widths(self) -> tuple[int, ...]:
        return tuple(sorted({min(w, self.max_context) for w in self.widths}))

    def dense(self, tokens: int) -> int:
        """Positions one call gathers for rows of up to `tokens` (`batching.dense_pages`)."""
        if not self.dense_buckets:
            return tokens
        spec = _PoolShape(self.page_size, -(-self.max_context // self.page_size))
        return batching.dense_pages(tokens, spec) * self.page_size


@dataclasses.dataclass(frozen=True)
class _PoolShape:  # what batching.dense_pages reads of a PoolSpec
    page_size: int
    max_pages: int


class ExtendCall(NamedTuple):
    rows: int      # the call's rows, all shards
    width: int
    keys: int      # key positions a computed row's attention reads (the longest row's; with tiles their mean)
    computed: int  # rows the layers compute (with token tiles the live ones; else every row)


@dataclasses.dataclass
class CallTimes:
    """Seconds of one engine call: decode(rows, key positions, steps run, row-steps
    computed, row-steps of the call's conversations: those read keys) and extend(rows,
    width, key positions, rows computed); rows are the call's, all shards."""

    decode: Callable[[int, int, int, int, int], float]
    extend: Callable[[int, int, int, int], float]


@dataclasses.dataclass
class Conversation:
    prompt: int                        # tokens before the first agent turn (system prompt included)
    sampled: list[int]                 # tokens per agent turn
    replies: list[int]                 # tokens fed after each agent turn but the last
    latency: list[float]               # seconds before each reply arrives


def draw_conversations(profile: RolloutProfile, n: int, rng: np.random.Generator, *, max_new_tokens: int,
                       overhead: int | None = None) -> list[Conversation]:
    """`n` conversations drawn from the profile, each quantity on its own."""
    overhead = profile.turn_overhead_tokens if overhead is None else overhead
    turns = np.maximum(np.rint(profile.agent_turns.draw(rng, n)), 1).astype(int)
    first = profile.first_user_tokens.draw(rng, n)
    out = []
    for i in range(n):
        a = int(turns[i])
        sampled = np.clip(np.rint(profile.agent_turn_tokens.draw(rng, a)), 1, max_new_tokens).astype(int)
        tool = rng.random(a - 1) < profile.tool_share
        tools = profile.tool_result_tokens.draw(rng, a - 1)
        users = profile.user_turn_tokens.draw(rng, a - 1)
        replies = np.rint(np.where(tool, tools, users)).astype(int) + overhead
        latency = np.where(tool, 0.0, profile.user_latency_s.draw(rng, a - 1))
        out.append(Conversation(profile.system_tokens + int(round(first[i])) + overhead, sampled.tolist(),
                                replies.tolist(), latency.tolist()))
    return out


@dataclasses.dataclass
class _Live:
    conv: Conversation
    length: int = 0                    # tokens in the conversation so far (cache + queue)
    queued: int = 0                    # tokens not in the cache yet
    turn: int = 0
    left: int = 0                      # tokens the current turn still samples (0: not generating)
    ready: float = 0.0                 # when the pending reply arrives
    finished_step: int = -2            # the engine step its last turn finished in
    sampled: int = 0                   # tokens sampled so far
    budget: int = 0                    # tokens the current turn may sample

    def turn_sampled(self) -> int:
        return min(self.conv.sampled[self.turn], self.budget) - self.left


@dataclasses.dataclass
class RolloutRun:
    """What one simulated step's rollout did."""

    seconds: float = 0.0
    decode_s: float = 0.0
    extend_s: float = 0.0
    wait_s: float = 0.0                # waiting on replies with nothing to decode
    decode_calls: int = 0
    extend_calls: int = 0
    steps: int = 0
    sampled_tokens: int = 0
    extend_tokens: int = 0
    extend_positions: int = 0          # positions the extends' layers computed (padding included)
    decode_positions: int = 0          # row-steps the decodes' layers computed
    lengths: list[int] = dataclasses.field(default_factory=list)   # each conversation's final length
    responses: list[int] = dataclasses.field(default_factory=list)  # each conversation's sampled tokens


def _calls_per_round(count: int, schedule: Schedule) -> list[int]:
    """Rows (all shards) of the calls that take `count` rows: as many rounds as the largest
    bucket needs, each bucketed (or fixed)."""
    top = schedule.row_buckets[-1]
    per_shard = -(-count // schedule.shards)
    rounds = -(-per_shard // top)
    rows = []
    for i in range(rounds):
        n = min(top, per_shard - i * top)
        rows.append(schedule.shards * (top if schedule.call_rows else batching.bucket(n, schedule.row_buckets)))
    return rows


def extend_calls(todo: Sequence[tuple[int, int]], schedule: Schedule) -> list[ExtendCall]:
    """The calls that extend `todo` = [(cached, new)] (oldest first), as the engine cuts
    them: packed (`batching.packed_extend_batches`) or fixed rows (`extend_batches`: each
    sequence at its own width). No extend gathers a dense copy: every path reads the pages
    in place, each row up to its own keys."""
    left = [[c, n] for c, n in todo if n > 0]
    return _fixed_extends(left, schedule) if schedule.call_rows else _packed_extends(left, schedule)


def _packed_extends(left: list[list[int]], schedule: Schedule) -> list[ExtendCall]:
    tile, shards = schedule.extend_tile, schedule.shards
    buckets = schedule.extend_row_buckets
    budget = buckets[-1] * shards  # tiles a call holds (the shards' groups taken as even)
    calls = []
    while left:
        reach: list[int] = []  # each row's keys once written
        for item in left:
            while item[1] > 0 and len(reach) < budget:
                n = min(item[1], tile)
                item[0] += n
                item[1] -= n
                reach.append(item[0])
        live = -(-len(reach) // shards)
        rows = shards * batching.bucket(live, buckets)
        if schedule.tiled:  # only the live rows run, each tile over its own row's keys
            calls.append(ExtendCall(rows, tile, -(-sum(reach) // len(reach)), live * shards))
        else:
            calls.append(ExtendCall(rows, tile, max(reach), rows))
        left = [x for x in left if x[1] > 0]
    return calls


def _fixed_extends(left: list[list[int]], schedule: Schedule) -> list[ExtendCall]:
    widths, buckets = schedule.extend_widths, schedule.row_buckets
    calls = []
    while left:
        own = [batching.bucket(min(n, widths[-1]), widths) for _, n in left]
        width = min(own)
        members = [x for x, w in zip(left, own) if w == width]
        cap = batching.extend_cap(width, buckets, schedule.max_extend_tokens) * schedule.shards
        members = members[:cap]
        reach = 0
        for item in members:
            step = min(item[1], width)
            reach = max(reach, item[0] + step)
            item[0] += step
            item[1] -= step
        calls.append(ExtendCall(cap, width, reach, cap))
        left = [x for x in left if x[1] > 0]
    return calls


def _price_extends(run: RolloutRun, todo, schedule: Schedule, times: CallTimes) -> float:
    seconds = 0.0
    for call in extend_calls(todo, schedule):
        seconds += times.extend(*call)
        run.extend_calls += 1
        run.extend_positions += call.computed * call.width
    run.extend_tokens += sum(n for _, n in todo)
    run.extend_s += seconds
    return seconds


def decode_row_steps(advance: Sequence[int], rows: int, schedule: Schedule, steps: int) -> int:
    """Row-steps a decode call of `rows` rows computes over `steps` steps while its rows
    advance `advance` steps each: every row every step, or with token tiles each step the
    live tiles of the fullest shard (the rows still decoding taken as packed first and even
    over the shards)."""
    if not schedule.tiled:
        return rows * steps
    tile, shards = schedule.decode_tile, schedule.shards
    total = 0
    for i in range(steps):
        active = sum(1 for a in advance if a > i)
        total += -(-(-(-active // shards)) // tile) * tile * shards
    return total


def _start_turn(live: _Live, schedule: Schedule) -> None:
    live.budget = max(1, min(schedule.max_new_tokens, schedule.max_context - live.length))
    live.left = min(live.conv.sampled[live.turn], live.budget)


def _engine_step(gen: list[_Live], schedule: Schedule, times: CallTimes, run: RolloutRun) -> float:
    """One `engine.step()` over the generating conversations: its seconds."""
    todo = [(x.length - x.queued, x.queued - 1) for x in gen]
    extend = _price_extends(run, todo, schedule, times)
    advance = [min(x.left, schedule.decode_chunk) for x in gen]
    steps = max(advance)
    # a row's pages cover its chunk's allowance (what its budget allows, not what it samples)
    reach = max(x.length - 1 + min(schedule.decode_chunk, x.budget - x.turn_sampled()) for x in gen)
    dense = schedule.dense(min(reach, schedule.max_context))
    decode, done = 0.0, 0
    for rows in _calls_per_round(len(gen), schedule):
        part = advance[done:done + rows]
        done += rows
        call_steps = max(part, default=0) if schedule.tiled else steps
        computed = decode_row_steps(part, rows, schedule, call_steps)
        # the call's conversations read their keys every step (the tile's padding rows none)
        decode += times.decode(rows, dense, call_steps, computed, min(computed, len(part) * call_steps))
        run.decode_calls += 1
        run.decode_positions += computed
    run.decode_s += decode
    for x, a in zip(gen, advance):
        x.left -= a
        x.length += a
        x.queued = 1
        x.sampled += a
        run.sampled_tokens += a
    run.steps += 1
    return extend + decode


def simulate(conversations: Sequence[Conversation], schedule: Schedule, times: CallTimes,
             prefix_tokens: int = 0) -> RolloutRun:
    """The step's rollout: its seconds and calls (see the module docstring). `prefix_tokens`:
    the system prompt every conversation starts with (its full pages are computed once)."""
    run, clock = RolloutRun(), 0.0
    full_prefix = prefix_tokens // schedule.page_size * schedule.page_size
    queue = collections.deque(conversations)
    live: list[_Live] = []
    prefix_ready = full_prefix == 0
    while queue or live:
        while queue and len(live) < schedule.num_slots:
            x = _Live(queue.popleft())
            x.length = min(x.conv.prompt, schedule.max_context - 1)
            if not prefix_ready:  # the first conversation computes the shared prefix's pages
                clock += _price_extends(run, [(0, full_prefix)], schedule, times)
                prefix_ready = True
            x.queued = x.length - (full_prefix if x.length > full_prefix else 0)
            _start_turn(x, schedule)
            live.append(x)
        waiting = [x for x in live if x.left == 0]
        gen = [x for x in live if x.left > 0]
        if not gen or (not schedule.overlap_io and waiting):
            due = min(x.ready for x in waiting) if schedule.overlap_io else max(x.ready for x in waiting)
            run.wait_s += max(due - clock, 0.0)
            clock = max(clock, due)
            for x in [x for x in waiting if x.ready <= clock]:
                _reply(x, schedule)
            continue
        step_index = run.steps
        clock += _engine_step(gen, schedule, times, run)
        for x in gen:
            if x.left == 0:
                _turn_done(x, clock, step_index, live, run, schedule)
        for x in [x for x in live if x.left == 0 and x.finished_step < run.steps - 1 and x.ready <= clock]:
            _reply(x, schedule)
    run.seconds = clock
    return run


def _turn_done(x: _Live, clock: float, step_index: int, live: list, run: RolloutRun, schedule: Schedule) -> None:
    last = x.turn + 1 >= min(len(x.conv.sampled), schedule.max_turns)
    reply = 0 if last else x.conv.replies[x.turn]
    if last or x.length + reply >= schedule.max_context:
        live.remove(x)
        run.lengths.append(x.length)
        run.responses.append(x.sampled)
        return
    x.ready = clock + x.conv.latency[x.turn]
    x.finished_step = step_index


def _reply(x: _Live, schedule: Schedule) -> None:
    reply = x.conv.replies[x.turn]
    x.length += reply
    x.queued += reply
    x.turn += 1
    _start_turn(x, schedule)
