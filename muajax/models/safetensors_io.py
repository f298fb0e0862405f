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


class SafetensorsWriter:
    """A safetensors file written one tensor at a time: the header (names, dtypes, shapes and
    offsets, in the given order) is known from the specs, so each tensor goes to the file as
    it is handed over and nothing is held. Atomic: written to a temporary file, renamed by
    `close()`; `abort()` (or an exception inside `with`) removes it.

        with SafetensorsWriter(path, [(name, dtype, shape), ...]) as w:
            for name, ... : w.write(name, array)   # in the specs' order
    """

    def __init__(self, path: str, specs, metadata: dict[str, str] | None = None):
        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self.expected: list[tuple[str, np.dtype, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in specs:
            dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
            if dtype not in NAMES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self.expected.append((name, dtype, shape))
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the reference writer does
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", len(blob)))
        self.file.write(blob)
        self.written = 0

    def write(self, name: str, array: np.ndarray) -> None:
        if self.written >= len(self.expected):
            raise ValueError(f"{self.path}: tensor {name!r} is beyond the {len(self.expected)} declared")
        want_name, dtype, shape = self.expected[self.written]
        array = np.ascontiguousarray(array)
        if (name, array.dtype, array.shape) != (want_name, dtype, shape):
            raise ValueError(f"{self.path}: expected tensor {want_name!r} {dtype}{list(shape)} next, got {name!r} "
                             f"{array.dtype}{list(array.shape)}")
        self.file.write(array.reshape(-1).view(np.uint8).data)  # no copy, any dtype (bfloat16 too)
        self.written += 1

    def close(self) -> None:
        if self.written != len(self.expected):
            missing = self.expected[self.written][0]
            self.abort()
            raise ValueError(f"{self.path}: closed with {len(self.expected) - self.written} tensors unwritten "
                             f"(next: {missing!r})")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
        else:
            self.abort()


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (in the given order) atomically: to a temporary file, then rename."""
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    with SafetensorsWriter(path, [(n, a.dtype, a.shape) for n, a in arrays.items()], metadata) as writer:
        for name, array in arrays.items():
            writer.write(name, array)
