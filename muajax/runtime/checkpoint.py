"""Resumable training checkpoints with orbax.

A step directory holds two orbax items: `state` (the train-state pytree: params and
optimizer state, possibly sharded) and `meta` (JSON: step, RNG key data, position in the
task stream, the run config, plus a fingerprint of every array leaf, see
`muajax.runtime.checkpoint_records`).

Orbax saves atomically (a `<step>.orbax-checkpoint-tmp` directory, renamed once every
item is written, and unfinalized directories are never listed); the fingerprints catch
bytes changed inside an array chunk, which would otherwise restore as wrong numbers.

`restore_latest` walks back from the newest step. A checkpoint whose content is wrong (a
fingerprint mismatch, a missing or garbled file: `muajax.runtime.checkpoint_errors`), and
stays wrong when read a second time, is corrupt: it is logged as an error and skipped, and
once an older one restores, the corrupt newer ones are moved to `<dir>/corrupt/` (never
deleted) so the run can save those step numbers again, with an error naming both steps.
Any other failure to read (I/O, memory, sharding) raises `CheckpointReadError` and moves
nothing: it says nothing about the checkpoint. A caller's tree that is not the saved one
raises `CheckpointLayoutError`.

The directory is an `etils.epath.Path`, orbax's own path type: a local path is made
absolute, and a URL (`gs://`, `s3://`, ...) stays a URL, so every host of a multi-host run
writes its shards to the same bucket rather than to a local `gs:/...` folder. All
directory handling here (listing, the interrupted-save check, quarantine) goes through
epath too, so it works on either. On `gs://` orbax does not rename a temporary directory
(GCS has no atomic rename); it writes `<step>/` in place and marks it finished with a
`commit_success.txt` written last.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from muajax.runtime.checkpoint_errors import (CheckpointError, CheckpointReadError, ContentError,
                                            NoValidCheckpointError, content_problem, first_line)
from muajax.runtime.checkpoint_records import (CheckpointLayoutError, check_layout, first_unjsonable, leaf_records,
                                             rng_from_json, rng_to_json)

__all__ = ["Checkpointer", "Restored", "CheckpointError", "NoValidCheckpointError", "CheckpointReadError",
           "CheckpointLayoutError", "checkpoint_path", "finished_steps", "read_metadata", "rng_to_json",
           "rng_from_json"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_TMP_MARK = ".orbax-checkpoint-tmp"
# orbax's marker of a finished step where it cannot rename atomically (gs://).
_COMMIT_FILE = "commit_success.txt"
_COMMIT_FILE_PREFIXES = ("gs://",)
_FORMAT = 1
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_META_FILE = ("meta", "metadata")  # orbax's JsonSave writes the item `meta` to meta/metadata


class Restored(NamedTuple):
    step: int
    state: Any
    metadata: dict

    @property
    def rng(self) -> jax.Array | None:
        """The saved RNG key, rebuilt (typed if it was saved typed)."""
        return rng_from_json(self.metadata.get("rng"))

    @property
    def data_position(self) -> Any:
        return self.metadata.get("data_position")

    @property
    def config(self) -> dict | None:
        return self.metadata.get("config")


def _first_device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract_leaf(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            # Unsharded request: place on the first local device.
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_first_device())
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=_first_device())
    return x


def checkpoint_path(directory: str | os.PathLike) -> epath.Path:
    """The checkpoint directory as an epath.Path: URLs kept as they are, local paths absolute.

    `file://` URLs become local paths (epath has no `file://` backend); a scheme epath
    cannot open is refused here rather than when the first save fails.
    """
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"checkpoint directory must be a str or path, got {type(directory).__name__}")
    text = os.fspath(directory)  # an epath URL path gives back its URL
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"checkpoint directory must be a non-empty path, got {directory!r}")
    match = _URL.match(text)
    if match and match.group(1).lower() == "file":
        url = urllib.parse.urlparse(text)
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"checkpoint directory {text!r}: a file:// URL must name a local path "
                             f"(file:///abs/path), not host '{url.netloc}'")
        text, match = urllib.request.url2pathname(url.path), None
    if match:
        try:
            return epath.Path(text)
        except KeyError:  # epath's registry of URL prefixes has no entry for this one
            raise ValueError(f"checkpoint directory {text!r}: etils.epath has no filesystem for "
                             f"'{match.group(1)}://' (it knows gs://, s3://, az://, hf://)") from None
    # Absolute: orbax and tensorstore must not depend on the working directory later on.
    return epath.Path(os.path.abspath(text))


def _uses_commit_file(directory: epath.Path) -> bool:
    return str(directory).startswith(_COMMIT_FILE_PREFIXES)


class Checkpointer:
    """Keeps the last `keep` checkpoints of a run in `directory`, saving every `every_steps`.

    Saves are asynchronous by default: `save` returns once the arrays are copied off the
    device, and a checkpoint counts only after orbax renames its finished directory.
    Call `wait()` before reading it from elsewhere, and `close()` at the end.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, every_steps: int = 1,
                 *, async_save: bool = True):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        self.directory: epath.Path = checkpoint_path(directory)
        self.keep, self.every_steps = keep, every_steps
        self._warn_interrupted_saves()
        # No PreemptionCheckpointingPolicy: it saved the step *after* a preemption notice and
        # training went on. A stop (SIGTERM, a notice) saves the last finished step and ends the
        # run: muajax.runtime.stopping, muajax.train.loop.
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(every_steps),
            preservation_policy=policies.LatestN(keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    # -------------------------------------------------------------- saving

    def _warn_interrupted_saves(self) -> None:
        if not self.directory.is_dir():
            return
        children = list(self.directory.iterdir())
        leftovers = [p.name for p in children if _TMP_MARK in p.name]
        if _uses_commit_file(self.directory):
            # No rename there: an interrupted step is a numbered directory without the marker.
            leftovers += [p.name for p in children
                          if p.name.isdigit() and p.is_dir() and not (p / _COMMIT_FILE).exists()]
        leftovers.sort()
        if leftovers:
            warnings.warn(
                f"{self.directory}: ignoring unfinalized checkpoint director{'ies' if len(leftovers) > 1 else 'y'} "
                f"{', '.join(leftovers)} left by an interrupted save; they will be removed",
                RuntimeWarning, stacklevel=3)

    def should_save(self, step: int) -> bool:
        """True at multiples of `every_steps`, past the latest step (a stop request saves the last
        finished step through `save(force=True)`: `muajax.train.loop.CheckpointHook`)."""
        return self._manager.should_save(step)

    def save(self, step: int, state: Any, *, rng: Any = None, data_position: Any = None,
             config: Mapping | None = None, extra: Mapping | None = None, force: bool = False) -> bool:
        """Save `state` and metadata for `step`; returns whether a save was started.

        Call it on every process (orbax coordinates who writes what). Unless `force`, it
        saves only when `should_save(step)`. `config` should already be free of secrets.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        if not force and not self.should_save(step):
            return False
        meta = {"format": _FORMAT, "step": step, "rng": rng_to_json(rng), "data_position": data_position,
                "config": dict(config) if config is not None else None,
                "extra": dict(extra) if extra is not None else None}
        bad = first_unjsonable(meta, "metadata")
        if bad:
            raise TypeError(f"checkpoint metadata must be JSON-serializable; {bad} is not")
        if step in self._manager.all_steps():  # in memory: includes a save still in flight
            raise CheckpointError(f"{self.directory}: a checkpoint for step {step} already exists")
        meta["saved_unix_time"] = time.time()
        meta["leaves"] = leaf_records(state)
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        return True

    def wait(self) -> None:
        """Block until in-flight saves are finalized (and raise if one failed)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------- restoring

    def steps(self) -> list[int]:
        """Finalized steps on disk, oldest first (waits for in-flight saves)."""
        self.wait()
        # Re-read the directory: another process, or a quarantine, may have changed it.
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> Restored:
        """Restore exactly `step` onto `abstract_state`'s shapes, dtypes and shardings.
        Raises CheckpointError if it is corrupt, CheckpointReadError if it cannot be read."""
        self.wait()
        try:
            return self._restore_verified(step, abstract_state)
        except ContentError as e:
            raise CheckpointError(f"{self._step_dir(step)}: {e}") from None

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that restores and verifies, or None if there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with the target sharding)
        or of arrays whose shardings to use. Raises CheckpointReadError (nothing moved) when
        a checkpoint cannot be read for a reason other than its content, and
        NoValidCheckpointError (nothing moved) when every checkpoint is corrupt.
        """
        self.wait()
        steps = self.steps()
        if not steps:
            return None
        corrupt: list[tuple[int, str]] = []
        for step in reversed(steps):
            try:
                restored = self._restore_verified(step, abstract_state)
            except ContentError as e:
                corrupt.append((step, str(e)))
                log.error("checkpoint %s is corrupt (%s); trying the one before", self._step_dir(step), e)
                continue
            if corrupt:
                self._quarantine([s for s, _ in corrupt], restored.step)
            return restored
        listing = "; ".join(f"step {s}: {why}" for s, why in corrupt)
        raise NoValidCheckpointError(f"{self.directory}: no valid checkpoint left ({listing}); nothing was moved")

    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def _read(self, step: int, what: str, read: Callable[[], T]) -> T:
        """`read()`, with its failure sorted: a content error that repeats on a second read
        raises ContentError (corruption); any other raises CheckpointReadError."""
        for attempt in (1, 2):
            try:
                return read()
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types; sorted below
                problem = content_problem(e)
                if problem is None:
                    raise CheckpointReadError(
                        f"{self._step_dir(step)}: reading the {what} failed with an error that is not about the "
                        f"checkpoint's content ({first_line(e)}); stopping without moving any checkpoint. Fix the "
                        "cause (storage, memory, devices) and resume again") from e
                if attempt == 2:
                    raise ContentError(f"{what}: {problem}") from None
                log.warning("checkpoint %s: reading the %s failed (%s); reading it again", self._step_dir(step),
                            what, problem)
        raise AssertionError("unreachable")

    def _read_meta(self, step: int) -> dict:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, dict) or not isinstance(meta.get("leaves"), list) or meta.get("step") != step:
            raise ContentError("metadata is malformed")
        return meta

    def _restore_verified(self, step: int, abstract_state: Any) -> Restored:
        meta = self._read(step, "metadata", lambda: self._read_meta(step))
        abstract = jax.tree.map(_abstract_leaf, abstract_state)
        compare_dtype = check_layout(meta["leaves"], abstract, f"checkpoint step {step} in {self.directory}")

        def arrays():
            state = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
            for want, have, same_dtype in zip(meta["leaves"], leaf_records(state), compare_dtype):
                if same_dtype and want["fp"] is not None and want["fp"] != have["fp"]:
                    raise ContentError(f"leaf {want['path']} does not match its saved fingerprint "
                                       "(data changed on disk)")
            return state

        return Restored(step, self._read(step, "arrays", arrays), meta)

    def _quarantine(self, steps: list[int], resumed_from: int) -> None:
        # Orbax refuses to save a step at or below the latest one on disk, so corrupt newer
        # steps must leave the directory; moving keeps them for a post-mortem.
        if jax.process_index() == 0:
            target = self.directory / "corrupt"
            target.mkdir(parents=True, exist_ok=True)
            for step in steps:
                src = self._step_dir(step)
                if src.is_dir():
                    dst = target / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}.{time.time_ns() % 10**9}"
                    # Locally a rename within the directory (one filesystem, atomic); on a
                    # bucket, fsspec copies the objects and deletes the originals.
                    src.rename(dst)
                    log.error("checkpoint step %d is corrupt: moved %s to %s; the run resumes from step %d",
                              step, src, dst, resumed_from)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("muajax-checkpoint-quarantine")
        self._manager.reload()


def finished_steps(directory: str | os.PathLike) -> list[int]:
    """The finalized steps in a checkpoint directory, oldest first, read without creating
    or cleaning anything (a Checkpointer's manager does both)."""
    root = checkpoint_path(directory)
    if not root.is_dir():
        return []
    commit = _uses_commit_file(root)
    return sorted(int(p.name) for p in root.iterdir()
                  if p.name.isdigit() and p.is_dir() and (not commit or (p / _COMMIT_FILE).exists()))


def read_metadata(directory: str | os.PathLike, step: int) -> dict:
    """A step's metadata (JSON), read-only; raises OSError or ValueError when unreadable."""
    path = checkpoint_path(directory) / str(step) / _META_FILE[0] / _META_FILE[1]
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: the metadata is not a JSON object")
    return meta
