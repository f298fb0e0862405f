"""Continuous batching for the server: many HTTP requests, one engine.

One driver coroutine owns the engine. Each tick, run in a single worker thread so the
event loop keeps serving HTTP, it releases the slots of cancelled requests, opens slots
for queued requests (prompt in, sampling started), and runs one `engine.step()` (a
decode chunk over every generating slot). Requests therefore join and leave the running
batch at chunk boundaries; a request that arrives while all slots are busy waits in a
FIFO queue. Request handlers never touch the engine: they enqueue a `Job` and read its
event queue; the engine is only ever used from the driver, never concurrently.

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

from muajax.engine.engine import Engine, SamplingParams

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


class Scheduler:
    def __init__(self, engine: Engine, *, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        self.pending: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}
        self._to_release: list[Job] = []
        self._wake = asyncio.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="muajax-serve-engine")
        self._task: asyncio.Task | None = None
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "ticks": 0,
                      "completion_tokens": 0, "prompt_tokens": 0, "peak_running": 0}

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
    def submit(self, job: Job) -> None:
        if not self.alive:
            raise RuntimeError("the engine driver is not running")
        if len(self.pending) >= self.max_queue:
            raise Overloaded(f"{len(self.pending)} requests are already waiting for a slot")
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
            release = self._to_release + [j for j in self.running.values() if j.cancelled]
            self._to_release = []
            if not self.pending and not self.running and not release:
                self._wake.clear()
                await self._wake.wait()
                continue
            admit: list[Job] = []
            free = self.engine.free_slots + len({j.slot for j in release if j.slot is not None})
            while self.pending and len(admit) < free:
                job = self.pending.popleft()
                if not job.cancelled:
                    admit.append(job)
            progress_for = [j for j in self.running.values() if _watched(j) and not j.cancelled]
            try:
                generations, progress = await loop.run_in_executor(self._pool, self._tick, release, admit,
                                                                   progress_for)
            except Exception as e:  # a device failure must not take the server down
                log.exception("engine step failed")
                self._recover(f"engine failure: {type(e).__name__}: {e}", admit)
                continue
            self.stats["ticks"] += 1
            for job in release:
                self.running.pop(job.slot, None)
            for job in admit:
                if job.error is not None:
                    self._fail(job, job.error)
                elif job.cancelled:  # cancelled while its slot was being opened
                    self._to_release.append(job)
                else:
                    self.running[job.slot] = job
            self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
            for gen in generations:
                job = self.running.pop(gen.slot)
                self.engine.release(gen.slot)  # safe: no tick is running now
                if not job.cancelled:
                    self._finish(job, list(gen.tokens), gen.finish_reason)
            for job, tokens in progress:
                if job.finished or job.cancelled or job.slot not in self.running:
                    continue
                if job.should_stop is not None and job.should_stop(tokens):
                    self._finish(job, tokens, "stop")
                    job.cancelled = True  # frees the slot at the next tick; a normal end, not counted
                    self._wake.set()
                elif job.wants_progress:
                    job.events.put_nowait(("tokens", tokens))

    def _tick(self, release: Sequence[Job], admit: Sequence[Job], progress_for: Sequence[Job]):
        engine = self.engine
        for job in release:
            if job.slot is not None:
                engine.release(job.slot)
        for job in admit:
            try:
                job.slot = engine.open(job.prompt, seed=job.seed)
                engine.start(job.slot, job.sampling)
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
                if job.slot is not None:
                    engine.release(job.slot)
                    job.slot = None
                job.error = f"{type(e).__name__}: {e}"
        generations = engine.step()
        done = {g.slot for g in generations}
        watched = list(progress_for) + [j for j in admit if _watched(j) and j.slot is not None]
        progress = [(j, engine.sampled(j.slot)) for j in watched if j.slot not in done]
        return generations, progress

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

    def _recover(self, message: str, admit: Sequence[Job]) -> None:
        """After a failed tick the engine's slots are in an unknown state: fail every job that
        holds one and free them all, so later requests start clean."""
        for job in list(self.running.values()) + list(admit):
            self._fail(job, message)
            if job.slot is not None:
                try:
                    self.engine.release(job.slot)
                except KeyError:
                    pass
        self.running.clear()


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
