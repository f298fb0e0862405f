"""Resumable training checkpoints with orbax.

A step directory holds two orbax items: `state` (the train-state pytree: params and
optimizer state, possibly sharded) and `meta` (JSON: step, RNG key data, position in the
task stream, the run config, plus a fingerprint of every array leaf).

Why the fingerprints: orbax saves atomically (a `<step>.orbax-checkpoint-tmp` directory,
renamed once every item is written, and unfinalized directories are never listed), and it
notices truncated or missing files, but bytes overwritten inside an array chunk restore
silently as wrong numbers. A per-leaf uint32 hash computed on device at save time and
re-checked after restore turns that into a detected corruption. The hash is a wrapping
integer sum, so it does not depend on how the array is sharded.

`restore_latest` walks back from the newest step: a checkpoint whose metadata or arrays
cannot be read, or whose fingerprints disagree, is skipped with a warning, and once an
older one restores, the bad newer ones are moved to `<dir>/corrupt/` (never deleted) so
the run can save those step numbers again. A mismatch between the caller's abstract state
and what was saved is a caller error and raises instead of falling back.

The directory is an `etils.epath.Path`, orbax's own path type: a local path is made
absolute, and a URL (`gs://`, `s3://`, ...) stays a URL, so every host of a multi-host run
writes its shards to the same bucket rather than to a local `gs:/...` folder. All
directory handling here (listing, the interrupted-save check, quarantine) goes through
epath too, so it works on either. On `gs://` orbax does not rename a temporary directory
(GCS has no atomic rename); it writes `<step>/` in place and marks it finished with a
`commit_success.txt` written last.
"""
from __future__ import annotations

import os
import re
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = ["Checkpointer", "Restored", "CheckpointError", "NoValidCheckpointError",
           "checkpoint_path", "rng_to_json", "rng_from_json"]

_TMP_MARK = ".orbax-checkpoint-tmp"
# orbax's marker of a finished step where it cannot rename atomically (gs://).
_COMMIT_FILE = "commit_success.txt"
_COMMIT_FILE_PREFIXES = ("gs://",)
_FORMAT = 1
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used."""


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist but none of them restores."""


class _Corrupt(Exception):
    pass


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


def rng_to_json(key: Any) -> dict | None:
    """A JSON-able record of a `jax.random.key` (typed) or a raw uint32 `PRNGKey`."""
    if key is None:
        return None
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"data": np.asarray(jax.random.key_data(key)).tolist(), "impl": str(jax.random.key_impl(key))}
    if key.dtype != jnp.uint32:
        raise TypeError(f"rng must be a jax.random.key or a uint32 PRNGKey array, got dtype {key.dtype}")
    return {"data": np.asarray(key).tolist(), "impl": None}


def rng_from_json(record: Mapping | None) -> jax.Array | None:
    if record is None:
        return None
    data = jnp.asarray(np.asarray(record["data"], dtype=np.uint32))
    impl = record.get("impl")
    return jax.random.wrap_key_data(data, impl=impl) if impl else data


# ------------------------------------------------------------------ fingerprints

def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _fingerprint_one(x: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned)
    if x.dtype.itemsize == 8:
        bits = bits ^ (bits >> 32)
    u = bits.astype(jnp.uint32)
    # Mixing in the position makes swapped or shifted values change the sum.
    pos = jnp.arange(u.size, dtype=jnp.uint32).reshape(u.shape)
    h = (u ^ (pos * jnp.uint32(0x9E3779B1))) * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 15)
    return jnp.sum(h, dtype=jnp.uint32)


@jax.jit
def leaf_fingerprints(leaves: list) -> list:
    return [_fingerprint_one(x) for x in leaves]


def _leaf_records(state: Any) -> list[dict]:
    """[{path, shape, dtype, fp}] in flatten order; `fp` is None for non-array leaves."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = [leaf for _, leaf in flat if _is_array(leaf)]
    fps = iter(int(v) for v in jax.device_get(leaf_fingerprints(arrays))) if arrays else iter(())
    records = []
    for path, leaf in flat:
        is_arr = _is_array(leaf)
        records.append({
            "path": jax.tree_util.keystr(path),
            "shape": list(np.shape(leaf)) if is_arr else None,
            "dtype": str(leaf.dtype) if is_arr else type(leaf).__name__,
            "fp": next(fps) if is_arr else None,
        })
    return records


# ------------------------------------------------------------------ helpers

def _first_unjsonable(obj: Any, path: str) -> str | None:
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return None
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{path} (key {k!r} is not a string)"
            bad = _first_unjsonable(v, f"{path}.{k}")
            if bad:
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = _first_unjsonable(v, f"{path}[{i}]")
            if bad:
                return bad
        return None
    return f"{path} ({type(obj).__name__})"


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


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy([
                policies.FixedIntervalPolicy(every_steps),
                policies.PreemptionCheckpointingPolicy(),
            ]),
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
        """True at multiples of `every_steps` (or on a preemption signal), past the latest step."""
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
        bad = _first_unjsonable(meta, "metadata")
        if bad:
            raise TypeError(f"checkpoint metadata must be JSON-serializable; {bad} is not")
        if step in self._manager.all_steps():  # in memory: includes a save still in flight
            raise CheckpointError(f"{self.directory}: a checkpoint for step {step} already exists")
        meta["saved_unix_time"] = time.time()
        meta["leaves"] = _leaf_records(state)
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
        """Restore exactly `step` onto `abstract_state`'s shapes, dtypes and shardings."""
        self.wait()
        try:
            return self._restore_verified(step, abstract_state)
        except _Corrupt as e:
            raise CheckpointError(f"{self._step_dir(step)}: {e}") from None

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that restores and verifies, or None if there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with the target sharding)
        or of arrays whose shardings to use.
        """
        self.wait()
        steps = self.steps()
        if not steps:
            return None
        problems: list[tuple[int, str]] = []
        for step in reversed(steps):
            try:
                restored = self._restore_verified(step, abstract_state)
            except _Corrupt as e:
                problems.append((step, str(e)))
                warnings.warn(f"checkpoint {self._step_dir(step)} is unusable ({e}); "
                              "falling back to the one before", RuntimeWarning, stacklevel=2)
                continue
            if problems:
                self._quarantine([s for s, _ in problems])
            return restored
        listing = "; ".join(f"step {s}: {why}" for s, why in problems)
        raise NoValidCheckpointError(f"{self.directory}: no valid checkpoint left ({listing})")

    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def _restore_verified(self, step: int, abstract_state: Any) -> Restored:
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any failure to read means unusable
            raise _Corrupt(f"metadata unreadable: {_first_line(e)}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("leaves"), list) or meta.get("step") != step:
            raise _Corrupt("metadata is malformed")
        abstract = jax.tree.map(_abstract_leaf, abstract_state)
        compare_dtype = self._check_layout(step, meta["leaves"], abstract)
        try:
            state = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
            raise _Corrupt(f"arrays unreadable: {_first_line(e)}") from None
        got = _leaf_records(state)
        for want, have, same_dtype in zip(meta["leaves"], got, compare_dtype):
            if same_dtype and want["fp"] is not None and want["fp"] != have["fp"]:
                raise _Corrupt(f"leaf {want['path']} does not match its saved fingerprint (data changed on disk)")
        return Restored(step, state, meta)

    def _check_layout(self, step: int, saved: list[dict], abstract: Any) -> list[bool]:
        """Raise ValueError if the requested tree is not what was saved; returns, per leaf,
        whether the dtypes agree (a cast on restore cannot be fingerprint-checked)."""
        flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
        want = [jax.tree_util.keystr(p) for p, _ in flat]
        have = [r["path"] for r in saved]
        if want != have:
            missing = sorted(set(have) - set(want))[:5]
            extra = sorted(set(want) - set(have))[:5]
            raise ValueError(f"checkpoint step {step} in {self.directory} has a different tree than "
                             f"abstract_state: saved but not requested {missing}, requested but not saved {extra}")
        same = []
        for (_, leaf), rec in zip(flat, saved):
            shape = getattr(leaf, "shape", None)
            if rec["shape"] is not None and shape is not None and list(shape) != rec["shape"]:
                raise ValueError(f"checkpoint step {step}: leaf {rec['path']} was saved with shape "
                                 f"{tuple(rec['shape'])}, abstract_state asks for {tuple(shape)}")
            dtype = getattr(leaf, "dtype", None)
            same.append(dtype is None or str(dtype) == rec["dtype"])
        return same

    def _quarantine(self, steps: list[int]) -> None:
        # Orbax refuses to save a step at or below the latest one on disk, so bad newer
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
                    warnings.warn(f"moved unusable checkpoint {src} to {dst}", RuntimeWarning, stacklevel=3)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("muajax-checkpoint-quarantine")
        self._manager.reload()
