"""The step loop: hooks see every finished step; close runs whatever happens; a checkpoint
is only written for a finished step; compile time is counted apart from step time."""
import time

import jax
import jax.numpy as jnp
import pytest

from muajax.train.loop import CallbackHook, CheckpointHook, Hook, NonFiniteHook, TrainingStopped, run_steps


class Recorder(Hook):
    def __init__(self, log, name="h"):
        self.log, self.name = log, name

    def after_step(self, step, state, record):
        self.log.append((self.name, step, state, sorted(record)))

    def close(self):
        self.log.append((self.name, "closed"))


class FakeCheckpointer:
    def __init__(self, every):
        self.every, self.saved, self.closed = every, [], False

    def should_save(self, step):
        return step % self.every == 0

    def save(self, step, state, *, config, force=False, **extra):
        self.saved.append((step, state, force, extra))

    def wait(self):
        pass

    def steps(self):
        return sorted(step for step, *_ in self.saved)

    def close(self):
        self.closed = True


def test_steps_run_from_start_and_hooks_see_each_one_in_order():
    log = []
    final = run_steps(10, 2, 5, lambda state, i: (state + i, {"x": float(i)}), [Recorder(log, "a"), Recorder(log, "b")])
    assert final == 10 + 2 + 3 + 4
    steps = [(name, step) for name, step, *_ in log if step != "closed"]
    assert steps == [("a", 3), ("b", 3), ("a", 4), ("b", 4), ("a", 5), ("b", 5)]
    assert log[-2:] == [("b", "closed"), ("a", "closed")]  # last hook closes first
    assert log[0][3] == ["time/compile_s", "time/step_s", "x"]  # the loop times each step


def test_compile_time_is_reported_apart_from_step_time():
    """A step that compiles reports its compile time; the same step again compiles nothing."""
    records = []

    def step(state, index):
        time.sleep(0.05)
        fn = jax.jit(lambda x: jnp.sin(x) * 3 + index % 2)  # a new function each step: steps 0 and 1 compile
        return state, {"value": float(fn(jnp.ones(64)).sum()) if index < 2 else 0.0}

    run_steps(None, 0, 3, step, [CallbackHook(lambda i, s, r: records.append(r))])
    assert records[0]["time/compile_s"] > 0 and records[1]["time/compile_s"] > 0
    assert records[2]["time/compile_s"] == 0.0
    for r in records:  # the sleep is run time, never compile time
        assert r["time/step_s"] >= 0.045


def test_a_failing_step_still_closes_every_hook_and_saves_nothing_for_it():
    log, ckpt = [], FakeCheckpointer(every=1)

    def step(state, index):
        if index == 2:
            raise RuntimeError("boom")
        return state + 1, {}

    hooks = [Recorder(log), CheckpointHook(ckpt, 5, config={}, extra=lambda s: {"data_position": s})]
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(0, 0, 5, step, hooks)
    assert [s for s, *_ in ckpt.saved] == [1, 2] and ckpt.closed
    assert log[-1] == ("h", "closed")
    assert ckpt.saved[1] == (2, 2, False, {"data_position": 2})


def test_the_last_step_is_always_checkpointed_and_forced():
    ckpt = FakeCheckpointer(every=10)
    run_steps(0, 0, 3, lambda s, i: (s, {}), [CheckpointHook(ckpt, 3, config={})])
    assert [(step, force) for step, _, force, _ in ckpt.saved] == [(3, True)]


def test_a_hook_that_fails_to_close_does_not_hide_the_step_error_nor_stop_the_others():
    log = []

    class BadClose(Hook):
        def close(self):
            raise OSError("disk full")

    def step(state, index):
        raise ValueError("the real error")

    with pytest.raises(ValueError, match="the real error"):
        run_steps(0, 0, 1, step, [Recorder(log), BadClose()])
    assert log == [("h", "closed")]
    with pytest.raises(OSError, match="disk full"):  # with no step error, a close error is raised
        run_steps(0, 0, 1, lambda s, i: (s, {}), [Recorder(log), BadClose()])


def test_callback_hook_sees_state_and_record():
    seen = []
    run_steps(1, 0, 2, lambda s, i: (s * 2, {"i": i}), [CallbackHook(lambda step, s, r: seen.append((step, s, r["i"])))])
    assert seen == [(1, 2, 0), (2, 4, 1)]


def run_with_skips(skipped, hooks, total=20):
    return run_steps(0, 0, total, lambda s, i: (s + 1, {"skipped": float(skipped[i])}), hooks)


def test_more_than_max_consecutive_skips_stops_the_run_after_saving_that_step():
    ckpt = FakeCheckpointer(every=10)
    # a finite step resets the streak; a step with any of its updates skipped (0.5) counts
    skipped = [0, 1, 1, 0, 1, 0.5, 1] + [0] * 13
    # the stopping hook before the checkpoint hook: the stopped step is saved all the same
    hooks = [NonFiniteHook(2, "grpo.max_consecutive_skips"), CheckpointHook(ckpt, 20, config={})]
    with pytest.raises(TrainingStopped, match=r"stopped at step 7: 3 steps in a row \(steps 5-7\) had a non-finite "
                                              r"loss or gradient .*more than grpo.max_consecutive_skips=2\. The state "
                                              r"at step 7 is saved"):
        run_with_skips(skipped, hooks)
    assert [(s, state, force) for s, state, force, _ in ckpt.saved] == [(7, 7, True)] and ckpt.closed


def test_the_stop_saves_the_stopped_step_once():
    for every, saves in ((10, [(3, True)]), (3, [(3, False)])):  # saved on schedule: not saved again
        ckpt = FakeCheckpointer(every=every)
        with pytest.raises(TrainingStopped, match="stopped at step 3"):
            run_with_skips([1, 1, 1, 1], [CheckpointHook(ckpt, 20, config={}), NonFiniteHook(2, "k")])
        assert [(s, force) for s, _, force, _ in ckpt.saved] == saves and ckpt.closed


def test_no_limit_never_stops_and_zero_stops_at_the_first_skip():
    assert run_with_skips([1] * 5, [NonFiniteHook(None, "k")], total=5) == 5
    with pytest.raises(TrainingStopped, match="stopped at step 2: 1 steps in a row"):
        run_with_skips([0, 1, 0], [NonFiniteHook(0, "k")], total=3)
