"""Continuous batching for the server: many HTTP requests, one engine.

One driver coroutine owns the engine. Each tick, run in a single worker thread so the
event loop keeps serving HTTP, it releases the slots of cancelled requests, opens slots
for queued requests (prompt in, sampling started), and runs one `engine.step()` (a
decode chunk over every generating slot). Requests therefore join and leave the running
batch at chunk boundaries; a request that arrives while all slots are busy waits in a
bounded FIFO queue (beyond it, `submit` raises `Overloaded`). Request handlers never
touch the engine: they enqueue a `Job` and read its event queue; the engine is only
ever used from the driver, never concurrently.

One request's failure fails only that request. Opening its slot fails it alone. A step
is shared, so when one fails the driver finds the culprit: it sets every generating job
aside (releases its slot, keeping the tokens it sampled up to the last good step) and
steps them again group by group, halving a group whose step fails, until a step fails
with one job in it: that job fails, the others go on. A job set aside resumes from its
prompt plus its sampled tokens, with its seed: the engine draws a position's sample from
the seed and the position only, so it continues exactly as it would have.

Events on `Job.events`: ("tokens", ids so far) for streaming or stop-string jobs after
every tick; then ("done", ids, finish_reason) or ("error", message).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from muajax.engine.engine import Engine, Generation, SamplingParams

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The wait queue is full."""


@dataclasses.dataclass(eq=False)
class Job:
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    # called with the ids sampled so far; True ends the generation ("stop")
    should_stop: Callable[[list[int]], bool] | None = None
    wants_progress: bool = False
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    slot: int | None = None
    cancelled: bool = False
    finished: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    error: str | None = None
    # the ids sampled before the current slot was opened (set aside after a failed step)
    carried: list[int] = dataclasses.field(default_factory=list)
    # every id sampled so far, as of the last step that succeeded
    sampled: list[int] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, engine: Engine, *, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        self.pending: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}
        self._admitting = 0  # jobs the tick in flight is opening slots for
        self._wake = asyncio.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="muajax-serve-engine")
        self._task: asyncio.Task | None = None
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "ticks": 0,
                      "completion_tokens": 0, "prompt_tokens": 0, "peak_running": 0, "isolations": 0}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="muajax-serve-driver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        # a tick still running in the worker thread must end before the engine goes away
        self._pool.shutdown(wait=True)
        for job in list(self.pending) + list(self.running.values()):
            self._fail(job, "the server is shutting down")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    # ------------------------------------------------------------------ requests
    @property
    def waiting(self) -> int:
        """Queued jobs that the slots free at the next tick will not take."""
        free = self.engine.num_slots - len(self.running) - self._admitting
        return len(self.pending) - max(free, 0)

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise RuntimeError("the engine driver is not running")
        if self.waiting >= self.max_queue:
            raise Overloaded(f"{max(self.waiting, 0)} requests are already waiting for a slot")
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(job.prompt)
        self.pending.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """The client went away (or a stop string matched): free its slot at the next tick."""
        if job.finished or job.cancelled:
            return
        job.cancelled = True
        self.stats["cancelled"] += 1
        self._wake.set()

    # ------------------------------------------------------------------ the driver
    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.pending and self.pending[0].cancelled:
                self.pending.popleft()
            release = [j for j in self.running.values() if j.cancelled]
            if not self.pending and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            admit: list[Job] = []
            free = self.engine.free_slots + len(release)
            while self.pending and len(admit) < free:
                job = self.pending.popleft()
                if not job.cancelled:
                    admit.append(job)
            jobs = [j for j in self.running.values() if not j.cancelled] + admit
            self._admitting = len(admit)
            try:
                generations = await loop.run_in_executor(self._pool, self._tick, release, jobs)
            except Exception as e:  # not a failed step (those are isolated): the engine itself broke
                log.exception("engine tick failed")
                self._recover(f"engine failure: {type(e).__name__}: {e}", jobs + release)
                continue
            finally:
                self._admitting = 0
            self.stats["ticks"] += 1
            self._settle(jobs, generations)

    def _settle(self, jobs: Sequence[Job], generations: Sequence[Generation]) -> None:
        """After a tick (no tick is running now): deliver what finished, failed or progressed."""
        by_slot = {j.slot: j for j in jobs if j.slot is not None}
        for gen in generations:
            job = by_slot.pop(gen.slot, None)
            self.engine.release(gen.slot)
            if job is None:  # cannot happen unless the engine reports a slot no job holds
                log.error("the engine finished slot %d, which no request holds; released it", gen.slot)
                continue
            job.slot = None
            if not job.cancelled:
                self._finish(job, job.carried + list(gen.tokens), gen.finish_reason)
        for job in jobs:
            if job.error is not None:  # its slot was released in the tick
                self._fail(job, job.error)
        self.running = by_slot
        self.stats["peak_running"] = max(self.stats["peak_running"], len(by_slot))
        for job in by_slot.values():
            if job.finished or job.cancelled or not _watched(job):
                continue
            if job.should_stop is not None and job.should_stop(job.sampled):
                self._finish(job, job.sampled, "stop")
                job.cancelled = True  # frees the slot at the next tick; a normal end, not counted
                self._wake.set()
            elif job.wants_progress:
                job.events.put_nowait(("tokens", job.sampled))

    def _tick(self, release: Sequence[Job], jobs: Sequence[Job]) -> list[Generation]:
        for job in release:
            self.engine.release(job.slot)
            job.slot = None
        for job in jobs:
            if job.slot is None:
                self._open(job)
        try:
            generations = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one request's failure must fail only that request
            live = [j for j in jobs if j.slot is not None]
            log.warning("an engine step over %d requests failed (%s: %s); finding the request that fails it",
                        len(live), type(e).__name__, e)
            self.stats["isolations"] += 1
            generations = self._isolate(live)
        done = {g.slot for g in generations}
        for job in jobs:
            if job.slot is not None and job.slot not in done:
                job.sampled = job.carried + self.engine.sampled(job.slot)
        return generations

    def _open(self, job: Job) -> bool:
        """Give the job a slot and start (or resume) its generation; on failure it fails alone."""
        sampling = dataclasses.replace(job.sampling, max_new_tokens=job.sampling.max_new_tokens - len(job.carried))
        try:
            job.slot = self.engine.open(job.prompt + job.carried, seed=job.seed)
            self.engine.start(job.slot, sampling)
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
            self._set_aside(job)
            job.error = f"{type(e).__name__}: {e}"
            return False
        return True

    def _set_aside(self, job: Job) -> None:
        """Release the job's slot, keeping what it sampled up to the last good step."""
        if job.slot is not None:
            self.engine.release(job.slot)
            job.slot = None
        job.carried = list(job.sampled)

    def _isolate(self, live: Sequence[Job]) -> list[Generation]:
        """A step with `live` generating failed: step them again in ever smaller groups; a job
        whose step fails with it alone in its group fails. The groups that pass make real
        progress (a decode chunk), so nothing is computed twice, and stay in the batch while
        later groups are tried: this trusts that a step which raises leaves the slots it did
        not fail on usable (the engine checks its inputs before running the device program;
        an engine whose device state is lost fails every request, as it must)."""
        for job in live:
            self._set_aside(job)
        generations: list[Generation] = []
        suspects = [list(live)]
        while suspects:
            group = [job for job in suspects.pop() if self._open(job)]
            if not group:
                continue
            try:
                generations += self.engine.step()
            except Exception as e:  # noqa: BLE001
                for job in group:
                    self._set_aside(job)
                if len(group) == 1:
                    group[0].error = f"engine failure: {type(e).__name__}: {e}"
                    log.error("a request fails the engine step on its own; failing it: %s", group[0].error)
                else:
                    half = len(group) // 2
                    suspects += [group[half:], group[:half]]
        return generations

    def _finish(self, job: Job, tokens: list[int], finish_reason: str) -> None:
        job.finished = True
        self.stats["completed"] += 1
        self.stats["completion_tokens"] += len(tokens)
        job.events.put_nowait(("done", tokens, finish_reason))

    def _fail(self, job: Job, message: str) -> None:
        if job.finished:
            return
        job.finished = True
        self.stats["errors"] += 1
        job.events.put_nowait(("error", message))

    def _recover(self, message: str, jobs: Sequence[Job]) -> None:
        """After a tick failed outside a step the engine's slots are in an unknown state: fail
        every job that holds one and free them all, so later requests start clean."""
        for job in jobs:
            if not job.cancelled:
                self._fail(job, message)
            if job.slot is not None:
                try:
                    self.engine.release(job.slot)
                except KeyError:
                    pass
                job.slot = None
        self.running = {}


def _watched(job: Job) -> bool:
    """Whether the driver reads the job's tokens after every tick (streams, stop strings)."""
    return job.wants_progress or job.should_stop is not None


def warmup(engine: Engine, token_id: int = 0) -> int:
    """Compile every program serving can need before the first request: the decode program
    of each batch bucket and the extend program of each (batch bucket, width) pair. On a
    CPU host each costs seconds, which would otherwise land on whichever request first
    hits that shape. Returns the number of generations run. The engine must be idle."""
    from muajax.engine.engine import SamplingParams

    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    runs = 0
    for batch in engine.batch_buckets:
        for width in engine.extend_widths:
            length = min(width + 1, engine.max_len - 1)  # the last prompt token is fed by decode
            slots = [engine.open([token_id] * length) for _ in range(batch)]
            try:
                engine.generate(slots, one)
                runs += 1
            finally:
                for slot in slots:
                    engine.release(slot)
    return runs
