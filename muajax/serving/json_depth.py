"""How deeply a JSON text nests, found without parsing it (and so without recursing).

Python's json decoder and encoder recurse once per level: a request nested a few thousand
levels deep raises RecursionError in the middle of serving it. Measuring the depth first
lets the server refuse such a body with a 400 before anything recursive touches it.
"""
from __future__ import annotations

import re

import numpy as np

# A JSON string literal (escapes included); the unrolled form matches in linear time.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))


def nesting_depth(text: bytes | str) -> int:
    """The deepest array/object nesting of a JSON text (0 for a scalar, 1 for `[]`).

    Brackets inside strings do not count. For text that is not valid JSON the result is
    still an upper bound of what a parser would reach before it fails, which is what a
    guard needs."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if data.count(b"[") + data.count(b"{") == 0:
        return 0
    data = _STRING.sub(b'""', data)
    codes = np.frombuffer(data, np.uint8)
    step = np.isin(codes, _OPEN).astype(np.int64) - np.isin(codes, _CLOSE).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def exceeds(text: bytes | str, limit: int) -> bool:
    """Whether `text` nests deeper than `limit` (cheap when it has few brackets at all)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    return nesting_depth(data) > limit
