"""Per-step metrics: a JSONL log, TensorBoard scalars, and a terminal progress bar.

`metrics.jsonl` in the run directory gets one line per step: the flattened metrics
(nested dicts joined with '/') plus `step` and `wall_time`. Each line is flushed as it is
written, so a crash loses at most the step in flight. On resume from a checkpoint at step
k, lines with step > k (written after that checkpoint, and about to be redone) are dropped
first, and TensorBoard is told to purge its events past k, so neither log has duplicates.
Only the main process writes; the others get a writer that does nothing.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

__all__ = ["MetricsWriter", "ProgressBar", "read_metrics", "flatten_metrics", "JSONL_NAME", "TB_DIR"]

JSONL_NAME = "metrics.jsonl"
TB_DIR = "tensorboard"
_RESERVED = ("step", "wall_time")


def _scalar(value: Any, key: str) -> Any:
    """A plain Python int/float/str for one metric value (bools become ints)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None:
        if tuple(shape) != ():
            raise ValueError(f"metric '{key}' must be a scalar, got an array of shape {tuple(shape)}")
        return _scalar(np.asarray(value).item(), key)  # also pulls a jax scalar off the device
    raise TypeError(f"metric '{key}' must be a number or a string, got {type(value).__name__}")


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """{"rollout": {"reward": 0.5}} → {"rollout/reward": 0.5}; None values are left out."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric names must be non-empty strings, got {key!r} under '{prefix or '/'}'")
        name = f"{prefix}{sep}{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, name, sep))
        elif value is not None:
            out[name] = _scalar(value, name)
    return out


def _parse_lines(path: str) -> tuple[list[dict], list[int]]:
    records, bad = [], []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(lineno)
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
            else:
                bad.append(lineno)
    return records, bad


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of `run_dir/metrics.jsonl` in file order ([] if there is none).

    A line that does not parse (e.g. cut short by a crash) is skipped with a warning.
    """
    path = os.path.join(os.fspath(run_dir), JSONL_NAME)
    if not os.path.exists(path):
        return []
    records, bad = _parse_lines(path)
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} malformed line(s) (line {', '.join(map(str, bad[:5]))})",
                      RuntimeWarning, stacklevel=2)
    return records


class MetricsWriter:
    """Writes one record per step to `run_dir/metrics.jsonl` and to TensorBoard.

    `resume_step`: the step of the checkpoint the run resumes from; records past it are
    dropped before writing. None (a fresh run, or no checkpoint) keeps what is there.
    """

    def __init__(self, run_dir: str | os.PathLike, jsonl: bool = True, tensorboard: bool = True,
                 is_main_process: bool = True, *, resume_step: int | None = None):
        self.run_dir = os.fspath(run_dir)
        self.active = bool(is_main_process and (jsonl or tensorboard))
        self._fh: IO[str] | None = None
        self._tb = None
        self._last_step: int | None = None
        if not self.active:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        if jsonl:
            path = os.path.join(self.run_dir, JSONL_NAME)
            if resume_step is not None and os.path.exists(path):
                self._truncate(path, resume_step)
            self._fh = open(path, "a", encoding="utf-8")
            # A line cut short by a crash must not swallow the next record.
            if self._fh.tell() > 0 and not self._ends_with_newline(path):
                self._fh.write("\n")
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            # tensorboardX names event files by the second and opens them with 'wb', so a
            # restart within the same second would overwrite the previous file; the
            # zero-padded nanosecond suffix keeps names unique and in time order.
            self._tb = SummaryWriter(logdir=os.path.join(self.run_dir, TB_DIR), purge_step=purge,
                                     flush_secs=30, filename_suffix=f".{time.time_ns():020d}")

    @staticmethod
    def _ends_with_newline(path: str) -> bool:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"

    @staticmethod
    def _truncate(path: str, resume_step: int) -> None:
        records, bad = _parse_lines(path)
        keep = [r for r in records if r["step"] <= resume_step]
        dropped = len(records) - len(keep)
        if bad or dropped:
            warnings.warn(f"{path}: resuming at step {resume_step}, dropping {dropped} record(s) past it"
                          + (f" and {len(bad)} malformed line(s)" if bad else ""), RuntimeWarning, stacklevel=3)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            for rec in keep:
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record `metrics` for `step`; returns the flattened record (also on non-main processes)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        flat = flatten_metrics(metrics)
        clash = [k for k in _RESERVED if k in flat]
        if clash:
            raise ValueError(f"metric name(s) {clash} are reserved for the record itself")
        if self._last_step is not None and step <= self._last_step:
            warnings.warn(f"metrics step {step} is not after the previous one ({self._last_step})",
                          RuntimeWarning, stacklevel=2)
        self._last_step = step
        now = time.time()
        record = {"step": step, "wall_time": now, **flat}
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        if self._tb is not None:
            for key, value in flat.items():
                if not isinstance(value, str):
                    self._tb.add_scalar(key, value, global_step=step, walltime=now)
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.3f}"
    return str(value)


class ProgressBar:
    """A tqdm bar over training steps showing reward, KL and tokens/s.

    It is off unless `enabled`, on the main process, and writing to a terminal: in logs
    and CI a bar's carriage-return redraws are noise. `write` prints regardless.
    """

    def __init__(self, total: int | None, initial: int = 0, *, enabled: bool = True,
                 is_main_process: bool = True, file: IO[str] | None = None, desc: str = "train"):
        self._file = file if file is not None else sys.stderr
        self.total = total
        self.is_main_process = is_main_process
        isatty = getattr(self._file, "isatty", None)
        self.enabled = bool(enabled and is_main_process and callable(isatty) and isatty())
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, file=self._file, desc=desc, unit="step",
                             dynamic_ncols=True, leave=True)

    def update(self, step: int, *, reward: float | None = None, kl: float | None = None,
               tokens_per_s: float | None = None, **extra: Any) -> None:
        """Move the bar to `step` (the number of finished steps) and show the given values."""
        if self._bar is None:
            return
        shown = {"reward": reward, "kl": kl, "tok/s": tokens_per_s, **extra}
        postfix = {k: _fmt(_scalar(v, k)) for k, v in shown.items() if v is not None}
        self._bar.set_postfix(postfix, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()

    def log(self, step: int, message: str, every: int = 1) -> None:
        """Without a bar (a log file, CI), print `message` at every `every`-th step and the
        last: a run under nohup still shows its progress."""
        if self._bar is None and (step % max(every, 1) == 0 or step == self.total):
            self.write(message)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if not self.is_main_process:
            return
        if self._bar is not None:
            self._bar.write(message, file=self._file)
        else:
            print(message, file=self._file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
