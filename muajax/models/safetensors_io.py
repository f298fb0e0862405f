"""Minimal, validating safetensors reader (memory-mapped) and writer.

The format is an 8-byte little-endian header length, a JSON header mapping tensor names
to {dtype, shape, data_offsets}, then raw little-endian data. We read it ourselves so
that (a) tensors are memory-mapped and only the slices a device needs are ever touched,
(b) bfloat16 works with NumPy (via ml_dtypes), and (c) every defect — truncation, a bad
header, offsets past the end — is reported with the file and tensor it concerns.
"""
from __future__ import annotations

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or does not match what the model expects."""


class SafetensorsFile:
    """Lazily maps one .safetensors file; `get(name)` returns a read-only memory-mapped array."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: file not found")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated file ({size} bytes): no safetensors header")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: corrupt header length {header_len} for a file of {size} bytes")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + header_len
        self._entries = {}
        data_len = size - self._data_start
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}") from None
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != expected:
                raise CheckpointError(
                    f"{path}: tensor {name!r}: {end - begin} bytes stored for shape {shape} {info['dtype']} "
                    f"(needs {expected})"
                )
            if end > data_len or begin < 0:
                raise CheckpointError(
                    f"{path}: tensor {name!r} extends past the end of the file (truncated or corrupt shard: "
                    f"needs {end} data bytes, file has {data_len})"
                )
            self._entries[name] = (dtype, shape, begin)
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        dtype, shape, begin = self._entries[name]
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=self._data_start + begin).reshape(shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (in the given order) atomically: to a temporary file, then rename."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in NAMES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {array.dtype}")
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the reference writer does
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
