"""Stop means stop: SIGTERM (tpu/stop.sh, gpu/stop_nodes.sh, `scancel`, a spot VM's shutdown, a
scheduler's preemption notice) ends a training run promptly and without losing anything, with
exit code `STOPPED_EXIT_CODE` (75) on every process.

What a stop does
----------------
`install()` (called by `python -m muajax.train`) sets a SIGTERM handler that only records the
request (`STOP.event`). Everything else happens at the run's own check points:

- **mid-rollout** the rollout loop (`muajax.agent.rollout`, GRPO's and evaluation's) sees the
  request within `muajax.agent.rollout.STOP_POLL_S` (or after the engine call in progress) and drops the
  conversations in flight; the step is abandoned, not trained, and its tasks are rolled out
  again on resume (the task stream's position is the one before the step); a stop during
  evaluation ends it the same way (the stage's final checkpoint is already saved);
- **between steps** (`muajax.train.loop.run_steps`, SFT, warm-ups and GRPO alike) the run
  stops before starting the next step; a step whose update is already running finishes it.

Then the checkpoint hook saves the last finished step (if it is not saved already: never the
next one), the checkpoints in flight are finalized, and `StopRequested` ends the run with exit
code 75. The time from the signal to the exit is at most the engine call or update in
progress plus one save. If the process is killed before that save is finalized (a spot VM
with 30 s of notice), orbax's atomic saves leave the previous checkpoint whole, and it
resumes exactly: every checkpoint holds its own task-stream position.

Several processes
-----------------
`jax.distributed.initialize` installs jax's preemption notifier, which catches SIGTERM and
offers `reached_preemption_sync_point(step)`: a save at the next step boundary, with training
going on afterwards. Here the notifier's handler is replaced by ours (SIGTERM is the notice
it waits for, "By default, we use SIGTERM as the signal for preemption notice"), and the
notice travels through the same coordination service: a process that is asked to stop
writes the key `muajax_stop/<process>`, and a watcher thread on every process reads that
directory every `WATCH_S` seconds and stops its own rollouts too. All processes then agree in
one collective (`agree`: any process's request stops all) at the same points of every step:
before it starts and after its rollouts, so every process abandons (or finishes) the same
step, saves the same checkpoint and exits with 75.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import jax
from jax._src import distributed as jax_distributed  # the coordination service's client, the process id

from muajax.agent import rollout as rollout_module
from muajax.runtime import distributed

log = logging.getLogger(__name__)

# The exit code of a run that stopped on request (SIGTERM, a preemption notice) after saving
# what it had: sysexits' EX_TEMPFAIL, "try again later". Continue with `--resume`.
# (0 done, 1 stopped with an error, 2 a config or resume problem, 3 too many failed rollouts.)
STOPPED_EXIT_CODE = 75
WATCH_S = 0.5  # how often each process of a multi-process run reads the others' stop requests
_KEY_DIR = "muajax_stop/"


class StopRequested(RuntimeError):
    """The run stopped on request (SIGTERM, a preemption notice) after saving the last finished
    step; `--resume` continues from it exactly."""


class StopSignal:
    """A process's stop request: set by a signal (`install`), by another process of the run
    (through the coordination service), or by `request`."""

    def __init__(self):
        self.event = threading.Event()
        self.reason: str | None = None
        self.requested_at: float | None = None
        self._previous: dict[int, object] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    def requested(self) -> bool:
        return self.event.is_set()

    def request(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason, self.requested_at = reason, time.time()
            self.event.set()
        self._wake.set()

    def _on_signal(self, signum, frame) -> None:
        first = not self.event.is_set()
        # the process index without jax.process_index(): that would start the backend
        self.request(f"{signal.Signals(signum).name} to process {jax_distributed.global_state.process_id}")
        # os.write, not print: the main thread may be inside a write to stderr
        note = ("stopping: the rollouts in flight are dropped, the last finished step is saved, then exit "
                f"{STOPPED_EXIT_CODE}" if first else "already stopping")
        os.write(2, f"muajax.train: {signal.Signals(signum).name} received; {note}\n".encode())

    def install(self, signals=(signal.SIGTERM,)) -> None:
        """Handle `signals` (from the main thread) and let the rollout loops see the request;
        with several processes, start the watcher that shares it with the others."""
        for sig in signals:
            if sig not in self._previous:
                self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        rollout_module.set_default_stop(self.event)
        # (before jax.distributed.initialize nothing here may touch the backend)
        if jax.distributed.is_initialized() and distributed.multiprocess() and self._watcher is None:
            self._closed.clear()
            self._watcher = threading.Thread(target=self._watch, name="muajax-stop-watcher", daemon=True)
            self._watcher.start()

    def uninstall(self) -> None:
        """The handlers as they were before `install` (None: one jax installed outside Python),
        the watcher stopped, and the request forgotten."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        rollout_module.set_default_stop(None)
        self._closed.set()
        self._wake.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        self.event.clear()
        self._wake.clear()
        self.reason = self.requested_at = None

    def _watch(self) -> None:
        client, me, published = jax_distributed.global_state.client, jax.process_index(), False
        while not self._closed.is_set() and client is not None:
            try:
                if self.event.is_set() and not published:
                    client.key_value_set(f"{_KEY_DIR}{me}", self.reason or "stop", allow_overwrite=True)
                    published = True
                elif not self.event.is_set():
                    for key, value in client.key_value_dir_get(_KEY_DIR):
                        self.request(f"{value}, shared through the coordination service")
                        break
            except Exception as e:  # noqa: BLE001 - the service is gone (shutdown): the collectives decide
                log.debug("stop watcher: %s", e)
                return
            self._wake.wait(WATCH_S)
            self._wake.clear()

    def agree(self, abandoned: bool = False) -> bool:
        """Whether the run stops here: this process's request (or `abandoned`, its rollouts
        dropped), or any other process's. With several processes a collective: every process
        must call it at the same point of the run."""
        local = self.requested() or abandoned
        if not distributed.multiprocess():
            return local
        return any(distributed.allgather_ints(int(local)))

    def describe(self) -> str:
        if self.reason is None:
            return "a stop was requested"
        return f"{self.reason}, {time.time() - self.requested_at:.1f}s ago"


STOP = StopSignal()  # the process's one stop request


def agreed_rollouts(rollout, on_stop=lambda: None):
    """`rollout()`'s result, unless the run stops here: this process's rollouts were stopped
    (`RolloutsStopped`) or any process's were (a collective: every process calls this at the
    same point of the run). Then `on_stop()` and `StopRequested`: the step is abandoned."""
    try:
        result, abandoned = rollout(), None
    except rollout_module.RolloutsStopped as e:
        result, abandoned = None, e
    if STOP.agree(abandoned is not None):
        on_stop()
        raise StopRequested(str(abandoned) if abandoned else "a stop came after its rollouts")
    return result


def install() -> None:
    STOP.install()


def uninstall() -> None:
    STOP.uninstall()
