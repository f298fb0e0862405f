"""The one step loop that SFT, the warm-ups and GRPO share, with everything around a step
(metrics, progress, checkpoints) as hooks.

`run_steps(state, start, total, step_fn, hooks)` calls `step_fn(state, index)` for each
index in [start, total); the step returns the new state and a flat record of floats. Each
hook sees every finished step; `close` runs in a `finally`, so a step that raises still
flushes the metrics, closes the progress bar and waits for checkpoints in flight, and the
error propagates unchanged. A checkpoint is only ever written for a finished step.

A hook ends the run early by raising `TrainingStopped` from `after_step`: every hook's
`on_stop` then runs for that step (the checkpoint hook saves it, if it has not), the hooks
close, and the error propagates with its message (`NonFiniteHook` does this).

A stop request (SIGTERM, a preemption notice: `muajax.runtime.stopping`) ends the run the
same way, at the next step boundary (agreed by every process) or at once when the step raises
`StopRequested` (GRPO abandons its rollouts): every hook's `on_stop` runs for the last
finished step (`index`, the state the abandoned step started from), so the checkpoint hook
saves that step, never the next one, and `StopRequested` propagates.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from muajax.runtime import stopping
from muajax.runtime.checkpoint import Checkpointer
from muajax.train.compilation import CompileClock
from muajax.train.metrics import MetricsWriter, ProgressBar
from muajax.train.step_metrics import ProfileWindow

log = logging.getLogger(__name__)

StepFn = Callable[[Any, int], tuple[Any, dict[str, float]]]


class TrainingStopped(RuntimeError):
    """A hook ended the run after a finished step; the message says why and what to do."""


class Hook:
    """Something done around every step. `step` counts finished steps (1-based)."""

    def before_step(self, step: int) -> None:
        """Step `step` is about to run (outside its timing)."""

    def after_step(self, step: int, state: Any, record: dict[str, float]) -> None:
        pass

    def on_stop(self, step: int, state: Any) -> None:
        """A hook stopped the run after `step` (whose state this is)."""

    def close(self) -> None:
        pass


class MetricsHook(Hook):
    """Every step's record, to metrics.jsonl and TensorBoard."""

    def __init__(self, writer: MetricsWriter):
        self.writer = writer

    def after_step(self, step, state, record):
        self.writer.write(step, record)

    def close(self):
        self.writer.close()


class ProgressHook(Hook):
    """The progress bar with some of the record, and a log line every `every` steps (a
    line per step when `every` is 1) for runs with no terminal."""

    def __init__(self, bar: ProgressBar, total: int, *, show: Callable[[dict], dict],
                 line: Callable[[int, dict], str], every: int = 1):
        self.bar, self.total, self.show, self.line, self.every = bar, total, show, line, every

    def after_step(self, step, state, record):
        self.bar.update(step, **self.show(record))
        self.bar.log(step, self.line(step, record), every=self.every)

    def close(self):
        self.bar.close()


class CheckpointHook(Hook):
    """Saves on the checkpointer's schedule and at the last step; `extra(step)` adds what a
    resumed run needs beside the state (the data position, a done flag)."""

    def __init__(self, checkpointer: Checkpointer, total: int, *, config: dict,
                 extra: Callable[[int], dict] = lambda step: {}):
        self.ckpt, self.total, self.config, self.extra = checkpointer, total, config, extra
        self.saved_step: int | None = None

    def after_step(self, step, state, record):
        last = step == self.total
        if self.ckpt.should_save(step) or last:
            self.ckpt.save(step, state, config=self.config, force=last, **self.extra(step))
            self.saved_step = step

    def on_stop(self, step, state):
        """A stopped run keeps the step it stopped at, to inspect or to resume from (a step
        already on disk, e.g. the one a resumed run started from, is kept as it is)."""
        if self.saved_step != step and step not in self.ckpt.steps():
            self.ckpt.save(step, state, config=self.config, force=True, **self.extra(step))
            log.warning("saved checkpoint %d on stopping", step)
        self.saved_step = step

    def close(self):
        try:
            self.ckpt.wait()
        finally:
            self.ckpt.close()


class NonFiniteHook(Hook):
    """Stops the run when more than `limit` steps in a row skipped an update for a
    non-finite loss or gradient (the record's `skipped` > 0; with several updates per step,
    any of them). The skipped updates change nothing, so the cause (a learning rate, a
    poisoned batch, params already non-finite) persists: going on would only burn time and
    end with a run that "finished". `limit` None never stops; `key` names the setting."""

    def __init__(self, limit: int | None, key: str):
        self.limit, self.key, self.streak = limit, key, 0

    def after_step(self, step, state, record):
        self.streak = self.streak + 1 if record.get("skipped", 0.0) > 0 else 0
        if self.limit is not None and self.streak > self.limit:
            first = step - self.streak + 1
            raise TrainingStopped(
                f"stopped at step {step}: {self.streak} steps in a row (steps {first}-{step}) had a non-finite loss "
                f"or gradient and skipped their update, more than {self.key}={self.limit}. The state at step {step} "
                "is saved (its params are those of the last update applied, which may already be non-finite). Fix "
                "the cause (learning rate, data), then resume from an earlier checkpoint or start again.")


class ProfileHook(Hook):
    """A `jax.profiler` trace of the window's steps (`metrics.profile_steps`)."""

    def __init__(self, window: ProfileWindow):
        self.window = window

    def before_step(self, step):
        self.window.step_started(step)

    def after_step(self, step, state, record):
        self.window.step_finished(step, state)

    def close(self):
        self.window.close()


class CallbackHook(Hook):
    """`fn(step, state, record)` after every step (snapshots, custom logging)."""

    def __init__(self, fn: Callable[[int, Any, dict], None]):
        self.fn = fn

    def after_step(self, step, state, record):
        self.fn(step, state, record)


def run_steps(state: Any, start: int, total: int, step_fn: StepFn, hooks: Sequence[Hook] = ()) -> Any:
    """Steps [start, total) from `state`; returns the final state. The record of each step
    gains `time/compile_s`, the time jax spent compiling during it (tracing, lowering, the
    backend compile or a read from the persistent cache), and `time/step_s`, the wall time
    of `step_fn` without that compile time (the hooks' work is in neither)."""
    finished = False
    clock = CompileClock()
    try:
        for index in range(start, total):
            if stopping.STOP.agree():  # with several processes, every one stops before this same step
                _stop(hooks, index, state, f"before step {index + 1}/{total}")
            for hook in hooks:
                hook.before_step(index + 1)
            clock.take()
            t0 = time.perf_counter()
            try:
                state, record = step_fn(state, index)
            except stopping.StopRequested as e:  # the step was abandoned: `state` is still step `index`'s
                _stop(hooks, index, state, f"during step {index + 1}/{total} ({e})")
            wall, compile_s = time.perf_counter() - t0, clock.take()
            record = {**record, "time/step_s": max(0.0, wall - compile_s), "time/compile_s": compile_s}
            try:
                for hook in hooks:
                    hook.after_step(index + 1, state, record)
            except TrainingStopped:
                for hook in hooks:
                    hook.on_stop(index + 1, state)
                raise
        finished = True
        return state
    finally:
        _close_all(list(hooks), raise_errors=finished)


def _stop(hooks: Sequence[Hook], step: int, state: Any, where: str) -> None:
    """Every hook's `on_stop` for the last finished step, then `StopRequested`."""
    saved = "nothing is saved (this part of the run keeps no checkpoints)"
    for hook in hooks:
        hook.on_stop(step, state)
        if isinstance(hook, CheckpointHook):
            saved = f"checkpoint {step} in {hook.ckpt.directory} holds it"
    raise stopping.StopRequested(f"stopped on request {where}: {stopping.STOP.describe()}. The last finished step "
                                 f"is {step}: {saved}")


def _close_all(hooks: list[Hook], *, raise_errors: bool) -> None:
    """Close every hook, last first, even if one of them raises. With `raise_errors` the
    first such error is raised once all are closed; without (an error is already on its
    way out of the loop) they are dropped, so they cannot hide it."""
    error = None
    for hook in reversed(hooks):
        try:
            hook.close()
        except BaseException as e:  # noqa: BLE001 - the remaining hooks must still close
            if not raise_errors:
                log.exception("closing %s failed while a step error propagates", type(hook).__name__)
            error = error or e
    if error is not None and raise_errors:
        raise error
