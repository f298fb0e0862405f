"""Pacing a simulated user's endpoint: requests and tokens per minute, and Retry-After.

`RateLimiter` holds an endpoint's `requests_per_minute` and `tokens_per_minute`. Each is a
token bucket with no burst (the generic cell rate algorithm): a request reserves the
earliest start at which both buckets allow it, and the next request's start moves on by
60 / requests_per_minute seconds and by 60 x its tokens / tokens_per_minute seconds. Over
any window, then, requests started number at most 1 + window x rate, and tokens sent at
most rate x window plus the last request's; no minute ever goes over the settings, at the
cost of never bursting into an idle minute's unused allowance. A reservation that would
start after the caller's deadline is refused and reserves nothing, so a conversation never
waits on the limiter past its turn's deadline.

A request's tokens are estimated before it is sent (`estimate_tokens`): its messages and
tools serialized as JSON, 4 characters to a token (English text in GPT's and Qwen's
tokenizers runs 4 to 4.5 characters a token; JSON's quotes and braces make the estimate
err high), plus `max_tokens` when set, as providers count a request against a tokens
limit. When the reply reports its usage (prompt + completion tokens) and that exceeds the
estimate, the difference is charged too (`RateLimiter.charge`).

One limiter serves every session, simulator and event loop of the process that names the
same endpoint, model and limits (`shared_limiter`); it locks with a `threading.Lock` and
waits with `asyncio.sleep`, so it belongs to no event loop. On multi-host runs the config's
figures are global: each process takes figure / process_count
(`muajax.domains.registry.make_user`).

`retry_after_s` reads how long a 429 or 503 asks a client to wait: `retry-after-ms`
(OpenAI's), else `Retry-After` as seconds or as an HTTP date.
"""
from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

CHARS_PER_TOKEN = 4


def _check_rate(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number (or None: no limit), got {value!r}")


class RateLimiter:
    """Requests and tokens per minute, without bursts; thread- and event-loop-safe."""

    def __init__(self, requests_per_minute: float | None = None, tokens_per_minute: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        _check_rate("requests_per_minute", requests_per_minute)
        _check_rate("tokens_per_minute", tokens_per_minute)
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._lock = threading.Lock()
        self._next_request = -math.inf  # the earliest start of the next request
        self._next_token = -math.inf
        self.admitted = 0  # reservations granted
        self.refused = 0  # reservations refused: they would have started after their deadline
        self.waited_s = 0.0  # the delays granted reservations waited, summed

    def __repr__(self) -> str:
        return (f"RateLimiter(requests_per_minute={self.requests_per_minute}, "
                f"tokens_per_minute={self.tokens_per_minute})")

    def reserve(self, tokens: int = 0, deadline: float | None = None) -> float | None:
        """Reserve a start for a request of `tokens`: the seconds to wait before sending it,
        or None (nothing reserved) when that start would fall after `deadline` (the clock's)."""
        with self._lock:
            now = self._clock()
            start = now
            if self.requests_per_minute:
                start = max(start, self._next_request)
            if self.tokens_per_minute:
                start = max(start, self._next_token)
            if deadline is not None and start > deadline:
                self.refused += 1
                return None
            if self.requests_per_minute:
                self._next_request = start + 60.0 / self.requests_per_minute
            if self.tokens_per_minute:
                self._next_token = start + 60.0 * max(0, tokens) / self.tokens_per_minute
            self.admitted += 1
            self.waited_s += start - now
            return start - now

    async def acquire(self, tokens: int = 0, deadline: float | None = None) -> bool:
        """Wait for a reserved start; False (having waited nothing) when it would pass `deadline`."""
        delay = self.reserve(tokens, deadline)
        if delay is None:
            return False
        if delay > 0:
            await asyncio.sleep(delay)
        return True

    def charge(self, tokens: int) -> None:
        """Count `tokens` more against the tokens limit (a reply that used more than estimated)."""
        if self.tokens_per_minute and tokens > 0:
            with self._lock:
                self._next_token = max(self._next_token, self._clock()) + 60.0 * tokens / self.tokens_per_minute


_shared: dict[tuple, RateLimiter] = {}
_shared_lock = threading.Lock()


def shared_limiter(endpoint: str, model: str, requests_per_minute: float | None,
                   tokens_per_minute: float | None) -> RateLimiter | None:
    """The process's one limiter for (endpoint, model, limits); None when neither is set."""
    if requests_per_minute is None and tokens_per_minute is None:
        return None
    key = (endpoint, model, requests_per_minute, tokens_per_minute)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = RateLimiter(requests_per_minute, tokens_per_minute)
        return _shared[key]


def estimate_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None) -> int:
    """What a request counts against a tokens limit: its input at 4 characters a token, plus
    `max_tokens` when set."""
    chars = len(json.dumps(messages, ensure_ascii=False, default=str))
    if tools:
        chars += len(json.dumps(tools, ensure_ascii=False, default=str))
    return -(-chars // CHARS_PER_TOKEN) + (max_tokens or 0)


def retry_after_s(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds a response asks the client to wait before retrying (>= 0), or None."""
    if not headers:
        return None
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            ms = float(value)
            if math.isfinite(ms):
                return max(0.0, ms / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a zone-less one is read as such
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
