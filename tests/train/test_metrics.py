import glob
import io
import json
import os
import struct
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from muajax.train.metrics import JSONL_NAME, TB_DIR, MetricsWriter, ProgressBar, flatten_metrics, read_metrics


def read_tb_scalars(run_dir):
    """{tag: [(step, value)]} from TensorBoard event files (TFRecord framing of Event protos)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        acc = EventAccumulator(os.path.join(run_dir, TB_DIR))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, TB_DIR, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                # A restart's purge marker: TensorBoard hides older events at or past it.
                out = {tag: [(s, v) for s, v in pts if s < event.step] for tag, pts in out.items()}
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_flatten_metrics():
    flat = flatten_metrics({"rollout": {"reward": np.float32(0.5), "turns": jnp.asarray(21),
                                        "tools": {"think": 3}},
                            "ok": True, "name": "x", "skip": None})
    assert flat == {"rollout/reward": 0.5, "rollout/turns": 21, "rollout/tools/think": 3, "ok": 1, "name": "x"}
    assert type(flat["rollout/reward"]) is float and type(flat["rollout/turns"]) is int
    with pytest.raises(ValueError, match=r"metric 'a/b' must be a scalar, got an array of shape \(3,\)"):
        flatten_metrics({"a": {"b": np.zeros(3)}})
    with pytest.raises(TypeError, match="metric 'c' must be a number or a string, got list"):
        flatten_metrics({"c": [1]})


def test_writer_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in (1, 2, 3):
            w.write(step, {"reward": {"mean": 0.25 * step}, "kl": jnp.float32(1e-3 * step), "phase": "grpo"})
        # Each step is flushed, so a reader sees it before close.
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    recs = read_metrics(tmp_path)
    assert recs[2]["reward/mean"] == 0.75 and recs[0]["phase"] == "grpo"
    assert abs(recs[1]["kl"] - 2e-3) < 1e-9 and recs[0]["wall_time"] > 1e9
    tb = read_tb_scalars(str(tmp_path))
    assert [s for s, _ in tb["reward/mean"]] == [1, 2, 3]
    assert [v for _, v in tb["reward/mean"]] == pytest.approx([0.25, 0.5, 0.75])
    assert "phase" not in tb  # strings go to the JSONL only


def test_writer_rejects_bad_input(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match="reserved"):
            w.write(1, {"step": 3})
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            w.write(-1, {"a": 1})
        w.write(5, {"a": 1})
        with pytest.warns(RuntimeWarning, match="step 5 is not after the previous one"):
            w.write(5, {"a": 2})


def test_only_main_process_writes(tmp_path):
    with MetricsWriter(tmp_path / "run", is_main_process=False) as w:
        rec = w.write(1, {"a": 1.0})
    assert rec["a"] == 1.0 and not (tmp_path / "run").exists()
    with MetricsWriter(tmp_path / "run2", jsonl=False, tensorboard=True) as w:
        w.write(1, {"a": 1.0})
    assert not (tmp_path / "run2" / JSONL_NAME).exists()
    assert os.path.getsize(glob.glob(str(tmp_path / "run2" / TB_DIR / "events.*"))[0]) > 0


def test_resume_drops_records_past_checkpoint(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(1, 6):
            w.write(step, {"loss": float(step)})
    with open(tmp_path / JSONL_NAME, "a") as fh:
        fh.write('{"step": 6, "loss": 6.0')  # a crash mid-write
    with pytest.warns(RuntimeWarning, match=r"resuming at step 3, dropping 2 record\(s\) past it and 1 malformed"):
        w = MetricsWriter(tmp_path, resume_step=3)
    with w:
        w.write(4, {"loss": 40.0})
        w.write(5, {"loss": 50.0})
    recs = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    tb = read_tb_scalars(str(tmp_path))
    assert len(glob.glob(str(tmp_path / TB_DIR / "events.*"))) == 2  # the first run's file survives
    assert tb["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_append_after_partial_line_without_resume(tmp_path):
    (tmp_path / JSONL_NAME).write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(3, {"a": 3})
    with pytest.warns(RuntimeWarning, match=r"skipped 1 malformed line\(s\) \(line 2\)"):
        recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 3]
    assert read_metrics(tmp_path / "missing") == []


def test_nan_survives_round_trip(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(1, {"loss": float("nan"), "grad_norm": float("inf")})
    rec = read_metrics(tmp_path)[0]
    assert np.isnan(rec["loss"]) and rec["grad_norm"] == float("inf")
    json.loads((tmp_path / JSONL_NAME).read_text())  # Python's reader accepts NaN/Infinity


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal():
    out = FakeTTY()
    with ProgressBar(total=10, initial=2, file=out) as bar:
        assert bar.enabled
        bar.update(3, reward=0.5, kl=2.5e-4, tokens_per_s=1234.0, turns=21)
        bar.write("hello")
        bar.log(10, "a log line")  # the bar shows progress itself
    text = out.getvalue()
    assert "3/10" in text and "reward=0.500" in text and "kl=2.50e-04" in text
    assert "tok/s=1234.000" in text and "turns=21" in text and "hello" in text and "a log line" not in text


def test_progress_bar_disabled_off_terminal_or_when_asked():
    plain = io.StringIO()
    bar = ProgressBar(total=5, file=plain)
    assert not bar.enabled
    bar.update(1, reward=1.0)
    bar.write("log line")
    for step in range(1, 6):  # without a bar: every 2nd step and the last
        bar.log(step, f"step {step}", every=2)
    bar.close()
    assert plain.getvalue() == "log line\nstep 2\nstep 4\nstep 5\n"
    tty = FakeTTY()
    for kwargs in ({"enabled": False}, {"is_main_process": False}):
        bar = ProgressBar(total=5, file=tty, **kwargs)
        assert not bar.enabled
        bar.update(2, reward=1.0)
        bar.close()
    assert tty.getvalue() == ""


def test_no_stray_warnings_on_clean_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with MetricsWriter(tmp_path, resume_step=10) as w:  # nothing to truncate yet
            w.write(11, {"a": 1})
        assert read_metrics(tmp_path)[0]["step"] == 11
