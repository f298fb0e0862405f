"""Why a checkpoint did not restore: its content (corruption), or anything else.

Only a content error may make a run fall back to an older checkpoint: a fingerprint that
does not match, a file that is missing, or a file whose bytes do not decode. Anything else
(an I/O error, a bucket that times out, host memory running out, a sharding that does not
fit the devices, a bug) says nothing about the checkpoint, and treating it as corruption
would roll a run back past a good checkpoint. `content_problem(exc)` reads the evidence in
an exception and its causes:

- content: `FileNotFoundError` (and a file where a directory should be, or the reverse),
  JSON or UTF-8 that does not decode, orbax's "item not found", a fingerprint mismatch,
  and tensorstore's status codes NOT_FOUND, DATA_LOSS, OUT_OF_RANGE (a byte range past the
  end of a truncated file), or FAILED_PRECONDITION / INVALID_ARGUMENT about decoding
  (e.g. "Truncated Zstd-compressed stream");
- not content, whatever else the chain holds: `MemoryError`, any other `OSError`
  (EIO, EACCES, ENOSPC, connection errors, timeouts) and tensorstore's UNAVAILABLE,
  DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, PERMISSION_DENIED, UNAUTHENTICATED, ABORTED,
  CANCELLED, INTERNAL, UNKNOWN;
- no evidence either way: not content.

A content error must also repeat on a second read before the Checkpointer calls it
corruption (bytes garbled in transit do not), which is what "verified" means there.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

__all__ = ["CheckpointError", "NoValidCheckpointError", "CheckpointReadError", "ContentError", "content_problem",
           "first_line"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used."""


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist but every one of them is corrupt."""


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read for a reason other than its content (I/O, memory,
    sharding): the run must stop, and no checkpoint was moved."""


class ContentError(Exception):
    """A checkpoint's content is wrong (raised inside the Checkpointer's own checks)."""


_STATUS = re.compile(r"^\s*([A-Z][A-Z_]{3,}):")
_CONTENT_STATUS = {"NOT_FOUND": "missing file", "DATA_LOSS": "garbled file", "OUT_OF_RANGE": "truncated file"}
_DECODE_STATUS = ("FAILED_PRECONDITION", "INVALID_ARGUMENT")
_DECODE_WORDS = ("decompress", "decod", "truncated", "corrupt", "checksum", "malformed", "parse", "zstd")
_ENVIRONMENT_STATUS = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED",
                                 "UNAUTHENTICATED", "ABORTED", "CANCELLED", "INTERNAL", "UNKNOWN"})
_LAYOUT_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def first_line(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.append(e.__cause__ or e.__context__)


def _status(e: BaseException) -> str | None:
    match = _STATUS.match(str(e))
    return match.group(1) if match else None


def _environmental(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    if isinstance(e, OSError) and not isinstance(e, _LAYOUT_ERRORS):
        return True
    return _status(e) in _ENVIRONMENT_STATUS


def _content_evidence(e: BaseException) -> str | None:
    if isinstance(e, ContentError):
        return str(e)
    if isinstance(e, _LAYOUT_ERRORS):
        return f"missing file ({first_line(e)})"
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return f"garbled file ({first_line(e)})"
    if isinstance(e, KeyError) and "was not found in the checkpoint" in str(e):  # orbax: an item's directory is gone
        return f"missing item ({first_line(e)})"
    status = _status(e)
    if status in _CONTENT_STATUS:
        return f"{_CONTENT_STATUS[status]} ({first_line(e)})"
    if status in _DECODE_STATUS and any(w in str(e).lower() for w in _DECODE_WORDS):
        return f"garbled file ({first_line(e)})"
    return None


def content_problem(exc: BaseException) -> str | None:
    """What is wrong with the checkpoint's content according to `exc`, or None when `exc`
    is not evidence of a content error (see the module docstring)."""
    evidence = None
    for e in _chain(exc):
        if _environmental(e):
            return None
        evidence = evidence or _content_evidence(e)
    return evidence
