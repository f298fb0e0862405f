"""SIGTERM in the middle of a GRPO step's rollout (`muajax.runtime.stopping`): the run drops the
conversations in flight, saves the last finished step and exits 75 within a minute, on one
process and on both of a two-process run (only one of them signalled); `--resume` then ends
with the params of a run that was never stopped."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from muajax.runtime.checkpoint import finished_steps, read_metadata
from muajax.runtime.stopping import STOPPED_EXIT_CODE
from tests.train.test_multihost import TINY_GRPO, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STOP_WITHIN_S = 60
# The embedded default, shortened: 2 SFT steps, 3 GRPO steps, no scheduled checkpoint (the only
# GRPO checkpoint is the one the stop saves) and users that take 0.5 s a reply, so that a step's
# rollout lasts seconds and the signal lands inside it.
EMBEDDED_SHORT = ["sft.steps=2", "grpo.steps=3", "checkpoint.every_steps=100", "eval.max_tasks=2",
                  "metrics.progress_bar=false", "metrics.tensorboard=false", "user.latency_s=0.5"]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_run_left_behind():
    """A failed test leaves no run going on (a peer of a failed process would wait forever)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Run:
    """`python -m muajax.train ARGS` in the background, its output in files."""

    def __init__(self, args, out_dir, *, name: str, process_id: int | None = None, port: int | None = None,
                 devices: int = 1):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        for key in ("MUAJAX_COORDINATOR", "MUAJAX_NUM_PROCESSES", "MUAJAX_PROCESS_ID", "MUAJAX_DISTRIBUTED"):
            env.pop(key, None)
        if process_id is not None:
            env.update(MUAJAX_COORDINATOR=f"127.0.0.1:{port}", MUAJAX_NUM_PROCESSES="2",
                       MUAJAX_PROCESS_ID=str(process_id))
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out, self.err = out_dir / f"{name}.out", out_dir / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "muajax.train", *args, f"run.out_dir={out_dir}"],
                                         cwd=ROOT, env=env, stdout=out, stderr=err)
        STARTED.append(self.proc)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.err}: still running after {timeout:.0f}s\n{self.stderr()[-3000:]}")

    def stderr(self) -> str:
        return self.err.read_text()

    def summary(self) -> dict:
        return json.loads(self.out.read_text().strip().splitlines()[-1])


def signal_mid_rollout(watched: Run, signalled: list[Run], after_line: str, delay: float = 1.5) -> float:
    """SIGTERM to `signalled` `delay` seconds after `watched` logged `after_line` (the step
    before finished: the next one is rolling out); the time it was sent."""
    deadline = time.time() + 600
    while after_line not in watched.stderr():
        assert watched.proc.poll() is None and time.time() < deadline, watched.stderr()[-3000:]
        time.sleep(0.05)
    time.sleep(delay)
    sent = time.time()
    for run in signalled:
        run.proc.send_signal(signal.SIGTERM)
    return sent


def assert_stopped(runs: list[Run], sent: float, where: str | None = "during step 2/3 (rollouts stopped on request"):
    """Every run exits 75 within STOP_WITHIN_S of the signal, having stopped `where` (by
    default: step 2's rollouts dropped); the slowest exit's seconds after the signal."""
    for run in runs:
        code = run.wait(STOP_WITHIN_S + 30)
        assert code == STOPPED_EXIT_CODE, run.stderr()[-3000:]
        assert f"stopped on request {where or ''}" in run.stderr(), run.stderr()[-3000:]
    took = time.time() - sent
    assert took < STOP_WITHIN_S
    return took


def grpo_checkpoint(run_dir) -> tuple[list[int], dict]:
    ckpt = run_dir / "checkpoints" / "grpo"
    steps = finished_steps(ckpt)
    return steps, read_metadata(ckpt, steps[-1]) if steps else {}


def test_sigterm_mid_rollout_stops_saves_and_resumes_to_the_same_params(tmp_path):
    straight = Run(EMBEDDED_SHORT, tmp_path / "a", name="straight")
    stopped = Run(EMBEDDED_SHORT, tmp_path / "b", name="stopped")
    sent = signal_mid_rollout(stopped, [stopped], "[grpo] step 1/3:")
    took = assert_stopped([stopped], sent)
    steps, meta = grpo_checkpoint(tmp_path / "b" / "embedded-cpu")
    # the last finished step, at the task stream's position before the dropped step's 4 tasks
    assert steps == [1] and meta["data_position"] == 4
    assert "[grpo] step 2/3" not in stopped.stderr()
    resumed = Run([*EMBEDDED_SHORT, "--resume"], tmp_path / "b", name="resumed")
    assert resumed.wait(900) == 0, resumed.stderr()[-3000:]
    assert straight.wait(900) == 0, straight.stderr()[-3000:]
    assert "[grpo] resumed at step 1 (task stream position 4)" in resumed.out.read_text()
    assert resumed.summary()["params_sha256"] == straight.summary()["params_sha256"]
    print(f"exit {took:.1f}s after SIGTERM; params_sha256 {straight.summary()['params_sha256']}")


def test_two_processes_stop_together_when_one_is_signalled_and_resume_to_the_same_params(tmp_path):
    config = [*TINY_GRPO, "grpo.steps=3", "checkpoint.every_steps=100", "user.latency_s=0.5"]

    def pair(name: str, *extra) -> list[Run]:
        port = free_port()
        return [Run([*config, *extra], tmp_path / name, name=f"{extra and 'resumed' or 'run'}{p}", process_id=p,
                    port=port) for p in range(2)]

    straight, stopped = pair("a"), pair("b")
    # only process 1 gets SIGTERM; process 0 learns it through the coordination service
    sent = signal_mid_rollout(stopped[0], [stopped[1]], "[grpo] step 1/3:")
    # both drop step 2 (process 0 may have finished its own share's rollouts by then)
    took = assert_stopped(stopped, sent, where="during step 2/3 (")
    assert "during step 2/3 (rollouts stopped on request" in stopped[1].stderr()
    steps, meta = grpo_checkpoint(tmp_path / "b" / "embedded-cpu")
    assert steps == [1] and meta["data_position"] == 2  # tasks_per_step=2
    resumed = pair("b", "--resume")
    for run in [*resumed, *straight]:
        assert run.wait(900) == 0, run.stderr()[-3000:]
    assert "[grpo] resumed at step 1 (task stream position 2)" in resumed[0].out.read_text()
    assert resumed[0].summary()["params_sha256"] == straight[0].summary()["params_sha256"]
    print(f"both exited within {took:.1f}s of SIGTERM to process 1; params_sha256 "
          f"{straight[0].summary()['params_sha256']}")


def test_an_asynchronous_run_stops_mid_rollout_and_resumes(tmp_path):
    """grpo.max_staleness=1: the rollout thread's conversations (a batch ahead) are dropped and
    an update in progress finishes, so the run stops after step 1 or step 2. A resumed
    asynchronous run is repeatable but not bitwise the uninterrupted one
    (muajax.train.async_grpo), so the stop and the resume are checked, not the params."""
    config = [*EMBEDDED_SHORT, "grpo.max_staleness=1"]
    stopped = Run(config, tmp_path, name="stopped")
    sent = signal_mid_rollout(stopped, [stopped], "[grpo] step 1/3:")
    took = assert_stopped([stopped], sent, where=None)
    last = int(re.search(r"The last finished step is (\d): checkpoint", stopped.stderr()).group(1))
    steps, meta = grpo_checkpoint(tmp_path / "embedded-cpu")
    assert last in (1, 2) and steps == [last] and meta["data_position"] == 4 * last
    resumed = Run([*config, "--resume"], tmp_path, name="resumed")
    assert resumed.wait(900) == 0, resumed.stderr()[-3000:]
    assert f"[grpo] resumed at step {last} (task stream position {4 * last})" in resumed.out.read_text()
    assert "[grpo] step 3/3" in resumed.stderr()
    print(f"exit {took:.1f}s after SIGTERM, after step {last}")
