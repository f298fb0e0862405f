"""A whole GRPO step's time, from a plan's compiled programs and a rollout profile.

    step_s       = rollout_s + sync_s + update_s                      (grpo.max_staleness 0)
    async_step_s = max(rollout_s, rollout_s - wait_s + sync_s + update_s)    (1 and more)
    async_bound_s = max(rollout_s, sync_s + update_s)

With `grpo.max_staleness >= 1` the next batch's rollout runs while this batch updates: in
the steady state a step is the longer of two streams, not their sum: a batch's rollout (its
turns and its users' waits follow one another) and an update with its weight handoff (one
per batch): `async_bound_s`, where the two contend for nothing. But the engine is laid out
over the update's devices (`rollout.mesh`), and a device runs one program at a time: the
engine's calls (`rollout_s - wait_s`: the rollout less its waits with nothing to decode),
the sync and the update follow one another, and the update hides only in the rollout's
waits for its users: `async_step_s`, at best (the update's calls taken to fill the waits
exactly). `run_step_s` is the config's (`step_s`, or `async_step_s` with staleness); the
throughput and MFU are over it.

rollout_s  the rollout played through the engine's schedule call by call
           (`rollout_schedule.simulate`: decode chunks over the generating rows, extends
           packed or in fixed rows as the engine lays them out (with token tiles only the live
           tiles computed), the system prompt computed once, the tail where few rows remain,
           user latency overlapped as the rollout loop allows), each
           call priced from the plan's compiled engine program of its kind (`engine decode`,
           `engine extend_128x64` or `extend_W`), rescaled to the call's rows, key length and
           steps by the analytic model of its work (FLOPs from muajax/models/flops.py, bytes
           from the weights and the KV cache it reads and writes); a token-tiled call by that
           model alone (its loops' counts are the data's; its weights read once per tile; of a
           mixture of experts, the experts its tokens are routed to: `flops.weight_read_share`);
sync_s     the engine's copy of the params (the plan's rollout phase says how many bytes per
           device; 0 when the engine reads the train state's params in place): read and
           written once, and moved over the interconnect when the layouts differ;
update_s   the `grpo step` program per optimizer update (ppo_epochs x mini-batches), at the
           length bucket the simulated batch's longest row falls in (rescaled from the
           compiled length by the train step's analytic FLOPs) and, with packed GRPO rows
           (`grpo.pack_rows`), at the rows the simulated lengths pack into
           (`grpo_packing.pack_bins` and `rows_for`, as the trainer packs each mini-batch;
           with several hosts, each packs its own and all take the most), plus the
           old-logprob recompute forward when `grpo.recompute_old_logprobs` runs one.

A call's seconds are the host's dispatch time plus the roofline of its FLOPs, bytes and
collectives (`Rates`): on an accelerator the largest term (`muajax.planning.roofline`:
compute, HBM and the interconnect overlap), on XLA:CPU their sum (one operation after
another) plus the first touch of the temporaries it allocates at every call (page faults:
a fresh buffer is written several times slower than a warm one). The draws of
conversations are seeded: `samples` batches are simulated and averaged.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from muajax.chips import Chip
from muajax.engine.paged_reference import BLOCK_TOKENS
from muajax.models.flops import forward_flops, head_params, real_token_flops, train_step_flops, weight_read_share
from muajax.planning.compile import ProgramCost
from muajax.planning.roofline import COLLECTIVE_FACTORS
from muajax.planning.rollout_profile import RolloutProfile
from muajax.planning.rollout_schedule import CallTimes, Schedule, draw_conversations, simulate
from muajax.runtime.host_batch import bucket_length


@dataclasses.dataclass(frozen=True)
class Rates:
    """What a device does per second, and the host's time per program call."""

    name: str
    peak_flops: float
    mem_bytes_per_s: float
    ring_bytes_per_s: float | None = None
    dispatch_s: float = 0.0          # host time per program call (measured: host_rates.py)
    overlap: bool = True             # roofline max (an accelerator), else the terms' sum (XLA:CPU)
    source: str = ""
    # the rate a freshly allocated buffer is first written at (page faults): XLA:CPU allocates
    # a program's temporaries at every call; None on an accelerator, whose runtime keeps them
    fresh_bytes_per_s: float | None = None

    @classmethod
    def from_chip(cls, chip: Chip, dispatch_s: float = 0.0) -> Rates:
        return cls(chip.name, chip.peak_flops, chip.hbm_bytes_per_s, chip.ring_bytes_per_s, dispatch_s, True,
                   f"muajax.chips {chip.name}")

    def seconds(self, flops: float, bytes_: float, collective_bytes: float = 0.0, fresh_bytes: float = 0.0) -> float:
        """One call: dispatch + the roofline of its work (+ its temporaries' first touch)."""
        terms = [flops / self.peak_flops, bytes_ / self.mem_bytes_per_s]
        if collective_bytes and self.ring_bytes_per_s:
            terms.append(collective_bytes / self.ring_bytes_per_s)
        fresh = fresh_bytes / self.fresh_bytes_per_s if self.fresh_bytes_per_s else 0.0
        return self.dispatch_s + fresh + (max(terms) if self.overlap else sum(terms))


def temporaries(cost: ProgramCost) -> float:
    """Bytes per device a call allocates for itself (XLA's memory analysis)."""
    return float(cost.memory.get("temporaries", 0))


def moved_bytes(cost: ProgramCost) -> float:
    """Collective bytes weighted as the roofline weighs them (`roofline.COLLECTIVE_FACTORS`)."""
    return sum(COLLECTIVE_FACTORS.get(kind, 1.0) * b for kind, b in cost.collectives.items())


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The engine schedule and the update's shape the plan does not carry."""

    schedule: Schedule
    update_rows: int                 # rows of one optimizer update (padded)
    microbatches: int
    updates_per_epoch: int
    ppo_epochs: int = 1
    recompute: bool = False          # an old-logprob forward per mini-batch first
    reference: bool = True           # the KL reference's forward runs in the update
    buckets: tuple[int, ...] = ()
    shared_prefix: int = 0           # tokens the update computes once per microbatch
    compiled_length: int = 0         # the length the plan compiled the update at
    row_buckets: tuple[int, ...] = ()  # packed GRPO rows: the row counts an update may have (empty: padded)
    # what one update executes by the model's count (the plan's analytic_flops["grpo"], per
    # device), for a compiled program with loops of unknown trip count (`missing_loops`)
    executed_flops: float = 0.0
    hosts: int = 1


class _EngineModel:
    """Per-call seconds of the engine's programs at any shape, from their compiled costs.

    A call without token tiles is its compiled program rescaled to the call's shape by the
    analytic model of its work. With token tiles (`Schedule.tiled`) every layer runs a loop
    over the live tiles whose trip count is the data's, so the compiled counts say little;
    such a call is priced from the model alone: the FLOPs of the rows computed, the weights
    read once per tile (a decode tile of 4 rows reads them as a whole row-batch did) plus
    each row's keys, per device of the engine's mesh; its collectives are left out."""

    def __init__(self, programs: dict[str, ProgramCost], cfg, rates: Rates, schedule: Schedule, decode_rows: int,
                 extend_rows: dict[int, int], engine_devices: int = 1):
        self.cfg, self.rates, self.schedule = cfg, rates, schedule
        self.decode_cost = programs["engine decode"]
        self.extends: dict[int, tuple[ProgramCost, int]] = {}  # width: (cost, rows compiled, all shards)
        for name, cost in programs.items():
            if name.startswith("engine extend_"):
                shape = name.rsplit("_", 1)[1]
                if "x" in shape:  # packed: extend_{tile}x{rows per shard}
                    width, per_shard = map(int, shape.split("x"))
                    self.extends[width] = (cost, per_shard * schedule.shards)
                else:
                    self.extends[int(shape)] = (cost, extend_rows.get(int(shape), 0))
        self.decode_rows, self.compiled_dense = decode_rows, schedule.dense(schedule.max_context)
        itemsize = np.dtype(cfg.compute_dtype).itemsize
        self.kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
        self.weights = cfg.num_params() * itemsize
        self.devices = max(engine_devices, 1)
        # the weights one device reads per pass: the engine's params as its programs take them
        self.device_weights = sum(b for k, b in self.decode_cost.resident_args.items() if k.startswith("params")) \
            or self.weights / self.devices

    def _work(self, rows: int, new: int, keys: int, steps: int, head: bool, gather: bool) -> tuple[float, float]:
        """(FLOPs, bytes) of `steps` passes of `rows` rows of `new` tokens over `keys` positions."""
        flops = forward_flops(self.cfg, rows, new, keys) - (0 if head else 2.0 * head_params(self.cfg) * rows * new)
        bytes_ = self.weights * weight_read_share(self.cfg, rows * new) + rows * keys * self.kv_token
        # the dense decode gathers the cache in and scatters it back, once per call
        copy = 2.0 * rows * keys * self.kv_token if gather else 0.0
        return steps * flops, steps * bytes_ + copy

    def _compiled_keys(self, cost: ProgramCost, trips: int, extend: bool) -> int:
        """The key positions a row's attention reads in the compiled counts: the pure-JAX
        in-place attention's block loop has no trip count in the HLO (counted `trips` times,
        the program's unknown_trips, one block each: every extend off TPU, the "paged"
        decode); the dense gather and the Pallas kernel's cost are at the pool's full length."""
        if cost.attention == "paged" or (extend and cost.attention == "reference"):
            return min(BLOCK_TOKENS * trips, self.schedule.max_context)
        return self.compiled_dense

    def _scaled(self, cost: ProgramCost, now: tuple[float, float], then: tuple[float, float], rows: float) -> float:
        f, b = cost.flops * now[0] / then[0], cost.bytes_accessed * now[1] / then[1]
        return self.rates.seconds(f, b, moved_bytes(cost) * rows, temporaries(cost) * now[1] / then[1])

    def _tiled(self, cost: ProgramCost, computed: int, new: int, keys: int, passes: float, head: bool,
               allocated: float, reading: int | None = None) -> float:
        """A token-tiled call: `computed` rows of `new` tokens over `keys` each, the weights
        read `passes` times, the keys read by `reading` of the rows (default: all; a decode
        tile's padding rows hold no sequence, so the kernel reads no pages for them);
        `allocated`: its temporaries' share of the compiled call's."""
        flops = forward_flops(self.cfg, computed, new, keys) - (0 if head else 2.0 * head_params(self.cfg) * computed
                                                                 * new)
        reading = computed if reading is None else min(reading, computed)
        per_pass = computed * new / (passes * self.schedule.shards) if passes else 0.0  # one shard's tokens a pass
        bytes_ = passes * self.device_weights * weight_read_share(self.cfg, per_pass) \
            + reading * keys * self.kv_token / self.devices
        return self.rates.seconds(flops / self.devices, bytes_, 0.0, temporaries(cost) * allocated)

    def decode(self, rows: int, dense: int, steps: int, computed: int | None = None,
               reading: int | None = None) -> float:
        chunk, gather = self.schedule.decode_chunk, self.schedule.dense_buckets
        if self.schedule.tiled:
            passes = (computed or 0) / (self.schedule.shards * self.schedule.decode_tile)
            return self._tiled(self.decode_cost, computed or 0, 1, dense, passes, True, rows / self.decode_rows,
                               reading)
        now = self._work(rows, 1, dense, steps, True, gather)
        then = self._work(self.decode_rows, 1, self._compiled_keys(self.decode_cost, chunk, False), chunk, True, gather)
        return self._scaled(self.decode_cost, now, then, rows * steps / (self.decode_rows * chunk))

    def extend(self, rows: int, width: int, dense: int, computed: int | None = None) -> float:
        compiled = min((w for w in self.extends if w >= width), default=max(self.extends))
        cost, r0 = self.extends[compiled]
        r0 = r0 or rows
        if self.schedule.tiled:
            passes = (computed or 0) / self.schedule.shards
            return self._tiled(cost, computed or 0, width, dense, passes, False, rows / r0)
        now = self._work(rows, width, dense, 1, False, False)
        then = self._work(r0, compiled, self._compiled_keys(cost, 1, True), 1, False, False)
        return self._scaled(cost, now, then, rows * width / (r0 * compiled))

    def times(self) -> CallTimes:
        return CallTimes(self.decode, self.extend)


def extend_program_rows(schedule: Schedule, compiled_rows: int) -> dict[int, int]:
    """Rows the plan compiled each fixed-row extend width at (`engine.programs.abstract_programs`
    with extend_tile=None)."""
    from muajax.engine import batching

    top = (compiled_rows // schedule.shards)
    buckets = batching.buckets(top)
    return {w: schedule.shards * batching.bucket(max(1, min(schedule.max_extend_tokens // w, top)), buckets)
            for w in schedule.extend_widths}


def _train_flops(cfg, rows: int, length: int, s: StepSettings, forward_only: bool = False) -> float:
    prefix = s.shared_prefix if 0 < s.shared_prefix < length else 0
    if forward_only:
        return forward_flops(cfg, rows, length, shared_prefix=prefix, prefix_runs=s.microbatches)
    return train_step_flops(cfg, rows, length, reference=s.reference, shared_prefix=prefix,
                            microbatches=s.microbatches)


def useful_flops(cfg, lengths, s: StepSettings) -> float:
    """The updates' model FLOPs on the rows' real tokens, counted as the trainer counts them
    for its MFU (`muajax.models.flops.real_token_flops`): forward-equivalents (3 per update, 4
    with the reference, 1 for the recompute) over each row's real length, the shared prefix's
    layers once per microbatch of each update."""
    passes = (4.0 if s.reference else 3.0) * s.ppo_epochs + (1.0 if s.recompute else 0.0)
    return real_token_flops(cfg, lengths, passes=passes, shared_prefix=s.shared_prefix,
                            prefix_runs=s.updates_per_epoch * s.microbatches)


def missing_loops(cost: ProgramCost, executed_flops: float) -> float:
    """How much more the program does than its compiled counts say: where the HLO gives a
    loop no trip count (the chunked attention's key loop on XLA:CPU) its body is counted
    once, so the counts are scaled by the model's executed FLOPs over the compiled ones (the
    missing iterations taken to read and write as the rest of the program does); 1 when
    every loop is counted or the compiled count is the larger."""
    unknown = any(loop.get("trips") is None for loop in cost.loops)
    return max(executed_flops / cost.flops, 1.0) if unknown and cost.flops > 0 and executed_flops else 1.0


def update_rows(lengths, length: int, s: StepSettings) -> int:
    """Rows of one update at bucket `length`: the padded rows, or with packed rows
    (`s.row_buckets`) what one host's trajectories `lengths` pack into, each mini-batch
    packed alone (the most of them; `muajax.runtime.grpo_packing.grpo_packed_batches`)."""
    if not s.row_buckets:
        return s.update_rows
    from muajax.runtime.grpo_packing import pack_bins, rows_for

    prefix = s.shared_prefix if 0 < s.shared_prefix < length else 0
    lengths = [min(int(n), length) for n in lengths]
    per = -(-len(lengths) // max(s.updates_per_epoch, 1))
    bins = max(len(pack_bins(lengths[i:i + per], length, prefix)) for i in range(0, len(lengths), per))
    # with several processes each packs its own and all take the most (`distributed.allgather_ints`);
    # their sum is taken up to a row bucket, a multiple of the batch divisor, as one process's is
    return rows_for(min(bins * max(s.hosts, 1), max(s.row_buckets)), s.row_buckets)


def update_seconds(cost: ProgramCost, cfg, rates: Rates, s: StepSettings, length: int,
                   recompute_cost: ProgramCost | None = None, rows: int | None = None) -> dict:
    """The step's updates at padded `length` over `rows` rows (default: the padded rows):
    each update call rescaled from the compiled length and rows by the train step's FLOPs;
    the old-logprob forward (one per mini-batch) from its own compiled program (`old
    logprobs`) by the forward's FLOPs, or where the plan has none from the update's cost by
    the forward's share of the step's FLOPs."""
    rows = rows or s.update_rows
    length_ratio = _train_flops(cfg, rows, length, s) / _train_flops(cfg, s.update_rows, s.compiled_length, s)
    ratio = length_ratio * missing_loops(cost, s.executed_flops)  # the temporaries are allocated once a call
    per_call = rates.seconds(cost.flops * ratio, cost.bytes_accessed * ratio, moved_bytes(cost) * ratio,
                             temporaries(cost) * length_ratio)
    calls = s.ppo_epochs * s.updates_per_epoch
    recompute = 0.0
    if s.recompute:
        forward = _train_flops(cfg, s.update_rows, length, s, forward_only=True)
        if recompute_cost is not None:
            forward0 = _train_flops(cfg, s.update_rows, s.compiled_length, s, forward_only=True)
            r = forward / forward0 * missing_loops(recompute_cost, s.executed_flops * forward0 / _train_flops(
                cfg, s.update_rows, s.compiled_length, s))
            one = rates.seconds(recompute_cost.flops * r, recompute_cost.bytes_accessed * r,
                                moved_bytes(recompute_cost) * r, temporaries(recompute_cost) * forward / forward0)
        else:
            share = forward / _train_flops(cfg, s.update_rows, length, s)
            one = rates.dispatch_s + (per_call - rates.dispatch_s) * share
        recompute = s.updates_per_epoch * one
    return {"per_call_s": per_call, "calls": calls, "recompute_s": recompute, "seconds": calls * per_call + recompute}


def sync_seconds(copy_bytes: int, rates: Rates, devices: int) -> float:
    """The engine's params copy: each device reads and writes its share, and the copy moves
    over the interconnect when it is laid out anew (several devices)."""
    if copy_bytes <= 0:
        return 0.0
    ring = copy_bytes / rates.ring_bytes_per_s if devices > 1 and rates.ring_bytes_per_s else 0.0
    return rates.dispatch_s + 2.0 * copy_bytes / rates.mem_bytes_per_s + ring


def engine_copy_bytes(plan) -> int:
    """Bytes per device of the engine's own params copy (0: it reads the train state's in
    place), from the plan's rollout phase (`planning.programs.engine_programs` copy_bytes)."""
    for phase in plan.phases:
        if phase.name == "rollout":
            return sum(p.bytes for p in phase.parts if p.name == "engine: params")
    return 0


def compiled_engine_rows(plan, settings: StepSettings) -> int:
    """Rows the plan compiled the decode at: every slot of the host's engine
    (`engine_programs`: its conversations, or the evaluation's when more)."""
    e, sched = plan.settings.engine_settings, settings.schedule
    slots = e.host_slots(settings.hosts)
    return sched.shards * -(-slots // sched.shards)


NO_UPDATE = {"per_call_s": 0.0, "calls": 0, "recompute_s": 0.0, "seconds": 0.0}


def predict_step(plan, profile: RolloutProfile, rates: Rates, settings: StepSettings, *, samples: int = 8,
                 seed: int = 0, decode_rows: int | None = None) -> dict:
    """The step's seconds by phase (means over `samples` simulated batches), its calls, tokens
    per second per chip and the update's MFU on the real (unpadded) tokens."""
    programs = {p.name: p for p in plan.programs if p.error is None}
    sched = settings.schedule
    rows = decode_rows or compiled_engine_rows(plan, settings)
    engine = _EngineModel(programs, plan.cfg, rates, sched, rows, extend_program_rows(sched, rows),
                          engine_devices=plan.devices // max(settings.hosts, 1))
    rng = np.random.default_rng(seed)
    runs, updates = [], []
    for _ in range(samples):
        convs = draw_conversations(profile, sched.conversations, rng, max_new_tokens=sched.max_new_tokens)
        run = simulate(convs, sched, engine.times(), prefix_tokens=profile.system_tokens)
        longest = bucket_length(min(max(run.lengths), max(settings.buckets)), settings.buckets)
        rows = update_rows(run.lengths, longest, settings)
        update = NO_UPDATE if "grpo step" not in programs else update_seconds(  # --phases rollout: not planned
            programs["grpo step"], plan.cfg, rates, settings, longest, programs.get("old logprobs"), rows=rows)
        runs.append(run)
        updates.append({**update, "length": longest, "rows": rows,
                        "useful_flops": useful_flops(plan.cfg, run.lengths, settings)})
    return _summary(plan, rates, settings, runs, updates)


def _mean(xs) -> float:
    return float(np.mean(list(xs)))


def _ratio(runs, computed: str, real: str) -> float:
    tokens = sum(getattr(r, real) for r in runs)
    return sum(getattr(r, computed) for r in runs) / tokens if tokens else 0.0


def step_seconds(rollout: float, wait: float, sync: float, update: float) -> dict:
    """The synchronous step, the asynchronous one on shared devices and its bound (see above)."""
    return {"step_s": rollout + sync + update, "async_step_s": max(rollout, rollout - wait + sync + update),
            "async_bound_s": max(rollout, sync + update)}


def _summary(plan, rates: Rates, settings: StepSettings, runs, updates) -> dict:
    rollout = _mean(r.seconds for r in runs)
    sync = sync_seconds(engine_copy_bytes(plan), rates, plan.devices)
    update = _mean(u["seconds"] for u in updates)
    each = [step_seconds(r.seconds, r.wait_s, sync, u["seconds"]) for r, u in zip(runs, updates)]
    steps = {k: _mean(e[k] for e in each) for k in each[0]}
    staleness = int(getattr(plan.settings.grpo, "max_staleness", 0))
    step = steps["async_step_s"] if staleness else steps["step_s"]
    sampled = _mean(r.sampled_tokens for r in runs) * settings.hosts
    useful = _mean(u["useful_flops"] for u in updates) * settings.hosts
    chip_s = plan.devices * rates.peak_flops
    return {
        "rollout_s": rollout, "sync_s": sync, "update_s": update, **steps, "max_staleness": staleness,
        "rollout": {"decode_s": _mean(r.decode_s for r in runs), "extend_s": _mean(r.extend_s for r in runs),
                    "wait_s": _mean(r.wait_s for r in runs), "engine_steps": _mean(r.steps for r in runs),
                    "decode_calls": _mean(r.decode_calls for r in runs),
                    "extend_calls": _mean(r.extend_calls for r in runs), "sampled_tokens": sampled,
                    "sequence_tokens": _mean(_mean(r.lengths) for r in runs),
                    "longest_row": _mean(max(r.lengths) for r in runs), "layout": settings.schedule.layout,
                    # positions the layers computed over the real tokens (the engine's stats' ratios)
                    "extend_computed_over_real": _ratio(runs, "extend_positions", "extend_tokens"),
                    "decode_computed_over_real": _ratio(runs, "decode_positions", "sampled_tokens")},
        "update": {"calls": updates[0]["calls"], "per_call_s": _mean(u["per_call_s"] for u in updates),
                   "recompute_s": _mean(u["recompute_s"] for u in updates),
                   "length": _mean(u["length"] for u in updates), "rows": _mean(u["rows"] for u in updates),
                   "useful_flops": useful},
        "tokens_per_s_per_chip": sampled / step / plan.devices if step > 0 else 0.0,
        "update_mfu": useful / (update * chip_s) if update > 0 else 0.0,
        "step_mfu": useful / (step * chip_s) if step > 0 and update > 0 else 0.0,
        "run_step_s": step, "rates": dataclasses.asdict(rates), "samples": len(runs),
    }

