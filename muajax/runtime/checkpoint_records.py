"""What a checkpoint records beside its arrays, and the checks made with it: a fingerprint,
shape and dtype per leaf, the RNG key as JSON, and the layout test a restore (or a resume's
preflight) runs against the tree the caller asks for.

Why the fingerprints: orbax notices truncated or missing files, but bytes overwritten
inside an array chunk restore silently as wrong numbers. A per-leaf uint32 hash computed on
device at save time and re-checked after restore turns that into a detected corruption.
The hash is a wrapping integer sum, so it does not depend on how the array is sharded.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CheckpointLayoutError", "rng_to_json", "rng_from_json", "leaf_fingerprints", "leaf_records",
           "check_layout", "first_unjsonable"]


class CheckpointLayoutError(ValueError):
    """The tree a caller asks for is not the tree that was saved (other leaves or shapes):
    a mismatch between the run and the checkpoint, never a corruption."""


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


def leaf_records(state: Any) -> list[dict]:
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


def check_layout(saved: list[dict], abstract: Any, where: str) -> list[bool]:
    """Raise CheckpointLayoutError if `abstract` (arrays or ShapeDtypeStructs) is not the
    tree of `saved` leaf records; returns, per leaf, whether the dtypes agree (a cast on
    restore cannot be fingerprint-checked). `where` names the checkpoint in the message."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
    want = [jax.tree_util.keystr(p) for p, _ in flat]
    have = [r["path"] for r in saved]
    if want != have:
        missing = sorted(set(have) - set(want))[:5]
        extra = sorted(set(want) - set(have))[:5]
        order = "" if missing or extra else " (the same leaves in another order)"
        raise CheckpointLayoutError(f"{where} has a different tree than the run asks for{order}: saved but not "
                                    f"requested {missing}, requested but not saved {extra}")
    same = []
    for (_, leaf), rec in zip(flat, saved):
        shape = getattr(leaf, "shape", None)
        if rec["shape"] is not None and shape is not None and list(shape) != rec["shape"]:
            raise CheckpointLayoutError(f"{where}: leaf {rec['path']} was saved with shape {tuple(rec['shape'])}, "
                                        f"the run asks for {tuple(shape)}")
        dtype = getattr(leaf, "dtype", None)
        same.append(dtype is None or str(dtype) == rec["dtype"])
    return same


def first_unjsonable(obj: Any, path: str) -> str | None:
    """Where in `obj` the first value JSON cannot hold sits, or None."""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return None
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{path} (key {k!r} is not a string)"
            bad = first_unjsonable(v, f"{path}.{k}")
            if bad:
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = first_unjsonable(v, f"{path}[{i}]")
            if bad:
                return bad
        return None
    return f"{path} ({type(obj).__name__})"
