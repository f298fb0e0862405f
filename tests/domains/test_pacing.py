"""The endpoint limiter (requests and tokens per minute, no bursts, deadlines), the token
estimate and Retry-After parsing; the `user` section's pacing keys and each host's share."""
from __future__ import annotations

import asyncio
import email.utils
import threading
import time

import pytest

from muajax.config.schema import ConfigError, load_config
from muajax.domains import registry
from muajax.domains.pacing import RateLimiter, estimate_tokens, retry_after_s, shared_limiter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_spaces_every_start_with_no_burst():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=120, clock=clock)  # one every 0.5 s
    assert [limiter.reserve() for _ in range(4)] == [0.0, 0.5, 1.0, 1.5]
    clock.now += 10.0  # an idle stretch earns no burst: the next two are still 0.5 s apart
    assert [limiter.reserve() for _ in range(2)] == [0.0, 0.5]
    assert limiter.admitted == 6 and limiter.waited_s == pytest.approx(3.5)


def test_tokens_per_minute_moves_the_next_start_by_the_tokens_sent():
    clock = Clock()
    limiter = RateLimiter(tokens_per_minute=6000, clock=clock)  # 100 tokens a second
    assert limiter.reserve(250) == 0.0
    assert limiter.reserve(100) == pytest.approx(2.5)  # waits out the first request's 250 tokens
    assert limiter.reserve(0) == pytest.approx(3.5)
    limiter.charge(50)  # a reply used 50 tokens more than estimated
    assert limiter.reserve(0) == pytest.approx(4.0)
    both = RateLimiter(requests_per_minute=60, tokens_per_minute=6000, clock=clock)
    assert both.reserve(10) == 0.0 and both.reserve(10) == pytest.approx(1.0)  # the requests limit binds
    assert both.reserve(500) == pytest.approx(2.0) and both.reserve(1) == pytest.approx(7.0)  # then the tokens


def test_a_start_past_the_deadline_is_refused_and_reserves_nothing():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=60, clock=clock)
    assert limiter.reserve(deadline=clock.now + 5) == 0.0
    assert limiter.reserve(deadline=clock.now + 0.5) is None  # would start at +1 s
    assert limiter.reserve(deadline=clock.now + 1.0) == pytest.approx(1.0)  # the refusal took no slot
    assert limiter.refused == 1 and limiter.admitted == 2

    real = RateLimiter(requests_per_minute=6)  # one every 10 s
    real.reserve()

    async def main():
        t0 = time.monotonic()
        ok = await real.acquire(deadline=time.monotonic() + 0.1)
        return ok, time.monotonic() - t0

    ok, waited = asyncio.run(main())
    assert ok is False and waited < 0.05  # refused at once, not waited for


def test_the_limiter_holds_across_threads_and_event_loops():
    limiter = RateLimiter(requests_per_minute=1200)  # one every 50 ms
    starts: list[float] = []
    lock = threading.Lock()

    def worker():
        async def main():
            for _ in range(5):
                await limiter.acquire()
                with lock:
                    starts.append(time.monotonic())
        asyncio.run(main())

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts.sort()
    assert len(starts) == 15
    # 15 starts at most every 50 ms: at least 0.7 s from the first to the last (sleeps never end early)
    assert starts[-1] - starts[0] >= 14 * 0.05 - 0.01


def test_one_limiter_per_endpoint_model_and_limits():
    a = shared_limiter("http://127.0.0.1:1/v1", "m", 60, None)
    assert shared_limiter("http://127.0.0.1:1/v1", "m", 60, None) is a
    assert shared_limiter("http://127.0.0.1:1/v1", "other", 60, None) is not a
    assert shared_limiter("http://127.0.0.1:1/v1", "m", None, None) is None
    for bad in (0, -5, float("nan"), "10"):
        with pytest.raises(ValueError, match="requests_per_minute must be a positive number"):
            RateLimiter(requests_per_minute=bad)


def test_the_token_estimate_is_a_quarter_of_the_characters_plus_max_tokens():
    messages = [{"role": "user", "content": "x" * 400}]
    base = estimate_tokens(messages)
    assert 100 < base < 115  # 400 characters of text and the JSON around them
    assert estimate_tokens(messages, max_tokens=256) == base + 256
    tools = [{"type": "function", "function": {"name": "f", "description": "y" * 400}}]
    assert estimate_tokens(messages, tools) > base + 100


def test_retry_after_in_seconds_milliseconds_and_http_dates():
    assert retry_after_s({"retry-after": "7"}) == 7.0
    assert retry_after_s({"retry-after": "1.5"}) == 1.5
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25  # OpenAI's finer header wins
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert retry_after_s({"retry-after": date}, now=now) == pytest.approx(30.0)
    assert retry_after_s({"retry-after": email.utils.formatdate(now - 30, usegmt=True)}, now=now) == 0.0
    for bad in ({}, None, {"retry-after": "soon"}, {"retry-after": "nan"}, {"retry-after": ""}):
        assert retry_after_s(bad) is None
    assert retry_after_s({"retry-after": "-3"}) == 0.0


@pytest.mark.parametrize("key,value,match", [
    ("requests_per_minute", -1, "'user.requests_per_minute' must be > 0, got -1"),
    ("tokens_per_minute", 0, "'user.tokens_per_minute' must be > 0, got 0"),
    ("turn_timeout_s", -2.5, "'user.turn_timeout_s' must be > 0, got -2.5"),
    ("requests_per_mnute", 10, "unknown key 'user.requests_per_mnute' \\(did you mean 'user.requests_per_minute'"),
    ("turn_timeout_s", "soon", "user.turn_timeout_s"),
])
def test_bad_pacing_keys_are_refused_naming_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, {"user": {"kind": "openai", "model": "m", key: value}})


def test_pacing_keys_apply_to_an_endpoint_only():
    with pytest.raises(ConfigError, match="'user.turn_timeout_s' paces an LLM endpoint"):
        load_config(None, ["user.turn_timeout_s=30"])
    cfg = load_config(None, ["user.kind=openai", "user.model=m", "user.requests_per_minute=600",
                             "user.tokens_per_minute=2e6", "user.turn_timeout_s=90"])
    assert (cfg.user.requests_per_minute, cfg.user.tokens_per_minute, cfg.user.turn_timeout_s) == (600, 2e6, 90)


def test_each_host_paces_its_share_of_the_run_s_figures(monkeypatch):
    cfg = load_config(None, ["user.kind=openai", "user.model=m", "user.base_url=http://127.0.0.1:9/v1",
                             "user.requests_per_minute=600", "user.tokens_per_minute=40000",
                             "user.turn_timeout_s=45"])
    user = registry.make_user(cfg.user, cfg.env)
    assert registry.process_count() == 1  # jax.distributed is not up here: one process
    assert user._limiter.requests_per_minute == 600 and user._limiter.tokens_per_minute == 40000
    assert user.turn_timeout_s == 45
    monkeypatch.setattr(registry, "process_count", lambda: 4)
    user = registry.make_user(cfg.user, cfg.env)
    assert user._limiter.requests_per_minute == 150 and user._limiter.tokens_per_minute == 10000
    plain = registry.make_user(load_config(None, ["user.kind=openai", "user.model=m",
                                                  "user.base_url=http://127.0.0.1:9/v1"]).user, cfg.env)
    assert plain._limiter is None and plain.turn_timeout_s is None
