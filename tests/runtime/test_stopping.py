"""SIGTERM -> the stop request -> the step loop saves the last finished step -> exit 75
(`muajax.runtime.stopping`). In-process and quick; the whole runs stopped mid-rollout are
tests/train/test_stop_resume.py."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from muajax.agent import rollout
from muajax.runtime import stopping
from muajax.runtime.checkpoint import Checkpointer, read_metadata
from muajax.train import __main__ as train_main
from muajax.train.loop import CheckpointHook, run_steps


def _not_stopping(signum, frame):
    """The handler before install: a SIGTERM that reaches it was not handled by the stop."""
    raise AssertionError("SIGTERM reached the handler that was there before stopping.install()")


@pytest.fixture
def installed():
    original = signal.signal(signal.SIGTERM, _not_stopping)  # a missed SIGTERM fails the test, not pytest
    try:
        stopping.install()
        yield stopping.STOP
        stopping.uninstall()
        assert signal.getsignal(signal.SIGTERM) is _not_stopping  # the handler as it was
        assert not stopping.STOP.requested() and rollout._default_stop[0] is None
    finally:
        signal.signal(signal.SIGTERM, original)


def test_sigterm_only_records_the_request_and_rollouts_see_it(installed):
    assert not installed.requested()
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode: the test goes on
    assert installed.requested() and "SIGTERM to process 0" in installed.describe()
    assert rollout._default_stop[0] is installed.event  # every rollout started without a `stop` obeys it
    assert installed.agree() is True  # one process: its own request


def test_no_request_no_stop(installed):
    assert installed.agree() is False and installed.agree(abandoned=True) is True


def _counting_step(signal_at: int | None, abandon_at: int | None):
    def step(state, index):
        if index == signal_at:  # SIGTERM while the step runs: the step finishes, the next does not start
            os.kill(os.getpid(), signal.SIGTERM)
        if index == abandon_at:  # SIGTERM, then the step abandons (GRPO's rollouts do this)
            os.kill(os.getpid(), signal.SIGTERM)
            raise stopping.StopRequested("rollouts stopped on request")
        return {"w": state["w"] + 1.0}, {"loss": 0.0}
    return step


@pytest.mark.parametrize("signal_at, abandon_at, last", [(2, None, 3), (None, 2, 2), (None, 0, 0)])
def test_a_stop_saves_the_last_finished_step_and_ends_the_loop(installed, tmp_path, signal_at, abandon_at, last):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, every_steps=100)
    hook = CheckpointHook(ckpt, 10, config={}, extra=lambda i: {"data_position": 4 * i})
    with pytest.raises(stopping.StopRequested, match=rf"The last finished step is {last}: checkpoint {last} in "):
        run_steps({"w": np.zeros(3, np.float32)}, 0, 10, _counting_step(signal_at, abandon_at), [hook])
    again = Checkpointer(tmp_path / "ckpt", keep=2, every_steps=100)
    assert again.steps() == [last]  # the last finished step, never a later one
    restored = again.restore(last, {"w": np.zeros(3, np.float32)})
    assert restored.state["w"].tolist() == [float(last)] * 3 and restored.data_position == 4 * last
    assert read_metadata(tmp_path / "ckpt", last)["step"] == last
    again.close()


def test_a_stop_where_the_resumed_run_started_keeps_that_checkpoint(installed, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, every_steps=100)
    ckpt.save(3, {"w": np.full(3, 3.0, np.float32)}, force=True, data_position=12)
    ckpt.wait()
    hook = CheckpointHook(ckpt, 10, config={}, extra=lambda i: {"data_position": 4 * i})
    with pytest.raises(stopping.StopRequested, match="during step 4/10"):
        run_steps({"w": np.full(3, 3.0, np.float32)}, 3, 10, _counting_step(None, 3), [hook])
    assert Checkpointer(tmp_path / "ckpt").steps() == [3]


class _StoppedTrainer:
    """What `python -m muajax.train` builds, standing in: its run gets SIGTERM mid-way."""

    def __init__(self, cfg, **kwargs):
        self.dir = cfg.run_dir

    def run(self):
        ckpt = Checkpointer(os.path.join(self.dir, "ckpt"), every_steps=100)
        run_steps({"w": np.zeros(2, np.float32)}, 0, 5, _counting_step(None, 1),
                  [CheckpointHook(ckpt, 5, config={})])
        raise AssertionError("the run went on after SIGTERM")


def test_the_command_exits_75_on_sigterm_and_gives_the_handler_back(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(train_main, "Trainer", _StoppedTrainer)
    before = signal.signal(signal.SIGTERM, _not_stopping)
    try:
        code = train_main.main([f"run.out_dir={tmp_path}"])
        assert signal.getsignal(signal.SIGTERM) is _not_stopping
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == stopping.STOPPED_EXIT_CODE == 75
    err = capfd.readouterr().err
    assert "SIGTERM received" in err and "stopped on request during step 2/5" in err and "--resume" in err
    assert Checkpointer(tmp_path / "embedded-cpu" / "ckpt").steps() == [1]
    assert not stopping.STOP.requested()
