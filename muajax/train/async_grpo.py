"""Asynchronous GRPO: the next batches roll out while the current one updates, on weights
at most `grpo.max_staleness` updates old.

Versions. The state after k updates is policy version k; GRPO step k (0-based) trains
batch k and makes version k + 1. The engine decodes from one version at a time
(`RolloutEngine.version`) and every sampled turn records the version it was sampled with
(`Trajectory.versions`, the oldest when a turn spans an update). A row's staleness at
its update is k minus the oldest version among its tokens; with max_staleness s it is
never above s, and `GRPOStage` checks every row.

The loop (`RolloutAhead`). A rollout thread rolls out batches start, start+1, ... in
order; the main thread trains them in order. Batch k's rollout starts once version
k - s is published (`WeightBoard`): until then it waits for the update (so at most s
batches are rolled out ahead). Without partial rollouts batch k rolls out entirely on
exactly version max(start, k - s), whatever the timing: the same bits as any other run
of the config, and every process of a multi-host run uses the same weights. With
`rollout.partial` it starts on the newest version and the engine takes each newer one
between its calls (`muajax.agent.rollout.run_rollouts(weights=...)`), so conversations in
flight go on with the new weights (timing-dependent).

The weight handoff. After update k the main thread makes the engine's copy of the new
params (`RolloutEngine.prepare`: in buffers of its own, since the next update donates the
params'; with several processes the copy is a collective, so it is made here, on the main
thread, in the same order on every process) and publishes it as version k + 1. The
rollout thread adopts it between engine calls: the engine and the update never share a
buffer, and a JAX call in each thread runs concurrently (the GIL is released while XLA
runs). The engine keeps its params copy and page pool through the updates (they run at
once), so an update's memory must fit beside them; the synchronous loop frees them first.

Long conversations are not starved: batches are trained in order and a batch waits for
every one of its conversations, so no conversation is dropped for being stale. A
conversation of batch k started on a version >= k - s and is trained at version k, so even
with partial rollouts (where it may go on across updates) its staleness is at most s: the
bound on how long a conversation may wait to be trained on is s updates, whatever its
length, and nothing is ever discarded to keep it.

Resume. The checkpoint after update k holds the state (version k) and the task-stream
position of batch k, the first batch not trained; batches rolled out ahead are lost with
the process and rolled out again (nothing is trained twice). The weights of earlier
versions are not saved: the first s batches after a resume roll out on the resumed
version (fresher than an uninterrupted run's, within the bound), so a resumed run is
repeatable from its checkpoint but not bitwise equal to the run that was not stopped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from muajax.agent.trajectory import Trajectory


class Stopped(RuntimeError):
    """The asynchronous loop was closed while the rollout thread waited."""


class WeightBoard:
    """The weight handoff between the update (which publishes each new version's engine
    copy) and the rollout thread (which waits for a version and takes it). Versions no
    future batch can use are forgotten (`forget_before`)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._params: dict[int, Any] = {}
        self._closed = False

    def publish(self, version: int, prepared) -> None:
        with self._cond:
            self._params[int(version)] = prepared
            self._cond.notify_all()

    def newest(self) -> tuple[int, Any] | None:
        """The newest published (version, params), or None."""
        with self._cond:
            if not self._params:
                return None
            version = max(self._params)
            return version, self._params[version]

    def wait(self, version: int, *, exact: bool) -> tuple[int, Any]:
        """Block until `version` (or a newer one) is published; return it exactly, or the
        newest. Raises `Stopped` once closed."""
        with self._cond:
            while not self._closed and (not self._params or max(self._params) < version):
                self._cond.wait()
            if self._closed:
                raise Stopped("the asynchronous GRPO loop stopped")
            chosen = version if exact else max(self._params)
            return chosen, self._params[chosen]

    def forget_before(self, version: int) -> None:
        """Drop versions older than `version`, keeping the newest."""
        with self._cond:
            newest = max(self._params, default=None)
            self._params = {v: p for v, p in self._params.items() if v >= version or v == newest}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclasses.dataclass
class Batch:
    """One rolled-out batch: step `index`'s trajectories, the task-stream positions before
    and after it, the version its rollout started on, and its timings."""
    index: int
    trajectories: list[Trajectory]
    position: int
    next_position: int
    version: int
    rollout_s: float
    weights_wait_s: float  # the rollout thread's wait for the version the bound asks for
    first_task: int = 0  # the global index of this process's first task (multi-host: its share)
    info: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. engine statistics


# (index, version, params) -> a coroutine returning the Batch: run on the rollout loop
RolloutFn = Callable[[int, int, Any], Any]


class RolloutAhead:
    """Rolls out batches [start, total) in a thread, batch k on version >= k - max_staleness
    (exactly max(start, k - max_staleness) unless `partial`); `get(k)` hands them over in
    order. `loop` is the event loop the rollouts run on (the main thread's own, idle while
    it trains: a user simulator bound to it keeps working afterwards). `close()` stops the
    thread, cancelling a rollout in flight."""

    def __init__(self, rollout: RolloutFn, board: WeightBoard, *, start: int, total: int, max_staleness: int,
                 partial: bool, loop: asyncio.AbstractEventLoop):
        if max_staleness < 1:
            raise ValueError(f"RolloutAhead needs max_staleness >= 1, got {max_staleness}")
        self.rollout, self.board, self.loop = rollout, board, loop
        self.start, self.total, self.max_staleness, self.partial = start, total, max_staleness, partial
        self._ready: queue.Queue = queue.Queue()
        self._task: asyncio.Task | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="muajax-rollout-ahead", daemon=True)
        self._thread.start()

    def needed_version(self, index: int) -> int:
        """The oldest version batch `index` may start on."""
        return max(self.start, index - self.max_staleness)

    def _run(self) -> None:
        try:
            for index in range(self.start, self.total):
                waited = time.perf_counter()
                version, params = self.board.wait(self.needed_version(index), exact=not self.partial)
                waited = time.perf_counter() - waited
                self.board.forget_before(self.needed_version(index + 1))
                if self._stop.is_set():
                    return
                self._task = self.loop.create_task(self.rollout(index, version, params))
                batch = self.loop.run_until_complete(self._task)
                batch.weights_wait_s = waited
                self._ready.put(batch)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self._ready.put(e)

    def get(self, index: int) -> Batch:
        """Batch `index`, waiting for its rollout; re-raises the rollout thread's error."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        if item.index != index:
            raise RuntimeError(f"asynchronous GRPO bug: step {index} got batch {item.index}")
        return item

    def close(self) -> None:
        self._stop.set()
        self.board.close()
        task = self._task
        if task is not None and not task.done():
            self.loop.call_soon_threadsafe(task.cancel)
        self._thread.join()


def staleness(trajectories: Sequence[Trajectory], version: int, bound: int) -> dict[str, float]:
    """`async/staleness_mean` and `async/staleness_max` of the rows trained at `version`
    (rows that sampled nothing have no staleness); raises if any row is above `bound`."""
    values = [version - t.oldest_version for t in trajectories if t.oldest_version is not None]
    if not values:
        return {}
    worst = max(values)
    if worst > bound or min(values) < 0:
        raise RuntimeError(f"asynchronous GRPO bug: rows trained at version {version} have staleness "
                           f"{min(values)}..{worst}, outside [0, grpo.max_staleness={bound}]")
    return {"async/staleness_mean": float(np.mean(values)), "async/staleness_max": float(worst)}
