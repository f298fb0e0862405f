"""A paced OpenAIUserSimulator over real HTTP (127.0.0.1) against an endpoint that answers
429 with Retry-After for a share of requests and stalls a few: the requests-per-minute
limit holds at the endpoint, Retry-After is waited out, and no turn outlives its deadline."""
from __future__ import annotations

import asyncio
import email.utils
import time

import pytest

from muajax.domains.pacing import estimate_tokens
from tests.domains.openai_user_support import KEY_ENV, SECRET_KEY, TASK, echo, last_user_text, make_sim
from tests.support.openai_server import ScriptedOpenAIServer


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET_KEY)


def arrivals(server: ScriptedOpenAIServer) -> list[float]:
    return sorted(r.received_at for r in server.chat_requests)


def test_requests_per_minute_hold_at_the_endpoint_through_429s_and_stalls():
    rpm, deadline, conversations, turns = 600, 2.0, 8, 5

    async def conversation(sim, c):
        session, out = sim.start(TASK), []
        for t in range(turns):
            out.append(await session.reply(f"agent {c}.{t}"))
        return out

    async def main(server):
        sim = make_sim(server, requests_per_minute=rpm, turn_timeout_s=deadline, max_retries=5, timeout_s=10.0)
        t0 = time.monotonic()
        results = await asyncio.gather(*(conversation(sim, c) for c in range(conversations)))
        elapsed = time.monotonic() - t0
        await sim.aclose()
        return sim, [t for r in results for t in r], elapsed

    with ScriptedOpenAIServer(echo, fail_rate=0.25, fail_status=429, retry_after="0.3", stall_rate=0.08,
                              stall_s=30.0, seed=3) as server:
        sim, replies, elapsed = asyncio.run(main(server))
        times, requests = arrivals(server), server.chat_requests
        counts = server.counts
    n, span = len(times), times[-1] - times[0]
    measured = (n - 1) * 60.0 / span
    print(f"\n{n} requests in {span:.2f} s: {measured:.0f} requests/min (limit {rpm}); {counts}; "
          f"turns {len(replies)}, failed {sum(t.failed for t in replies)}, whole run {elapsed:.1f} s; {sim.stats()}")
    assert counts["failed"] >= 3 and counts["stalled"] >= 1 and n >= 30  # the endpoint misbehaved as asked
    # At the limit and no faster (1% for the jitter of arrival times at the server) ...
    assert measured <= rpm * 1.01, measured
    # ... and in every window of a second or more: at most 1 + window x rate requests. (The
    # server shares this process's GIL with the client, so a short window can see a few
    # requests sent 0.1 s apart arrive together; 0.2 s is allowed for that.)
    for i in range(n):
        for j in range(i + 1, n):
            if times[j] - times[i] >= 1.0:
                assert j - i <= (times[j] - times[i] + 0.2) * rpm / 60.0 + 1, (i, j, times[j] - times[i])
    assert measured >= 0.6 * rpm  # the limiter bound the rate, not the endpoint (which answers at once)
    # no turn outlived its deadline; the stalled ones failed at it, counted
    assert max(t.latency_s for t in replies) <= deadline + 0.25, max(t.latency_s for t in replies)
    failed = [t for t in replies if t.failed]
    assert sim.deadline_failures >= counts["stalled"] >= 1 and len(failed) == sim.failures == sim.deadline_failures
    assert all("deadline" in t.error for t in failed)
    assert sim.throttled == counts["failed"]
    # every 429 was waited out for its Retry-After (0.3 s) before that conversation's retry
    by_turn: dict[str, list] = {}
    for r in sorted(requests, key=lambda r: r.received_at):
        by_turn.setdefault(last_user_text(r.body), []).append(r)
    for attempts in by_turn.values():
        for before, after in zip(attempts, attempts[1:]):
            if before.outcome == "failed":
                assert after.received_at - before.received_at >= 0.3


def one_turn(server: ScriptedOpenAIServer, **kw):
    async def main():
        sim = make_sim(server, **kw)
        turn = await sim.start(TASK).reply("hello")
        await sim.aclose()
        return sim, turn

    return asyncio.run(main())


@pytest.mark.parametrize("form", ["seconds", "http-date"])
def test_retry_after_is_waited_out_in_seconds_or_as_an_http_date(form):
    with ScriptedOpenAIServer(echo, fail_first=1, fail_status=429) as server:
        # an HTTP date has whole seconds: 3 s ahead is 2 to 3 s from when it is read
        server.retry_after = "2" if form == "seconds" else email.utils.formatdate(time.time() + 3, usegmt=True)
        sim, turn = one_turn(server, turn_timeout_s=10.0)  # FAST: backoff alone would be at most 0.05 s
        times = arrivals(server)
    assert not turn.failed and turn.text == "echo[3]: hello"
    assert len(times) == 2 and 1.9 <= times[1] - times[0] <= 3.5, times[1] - times[0]
    assert sim.throttled == 1 and sim.retries == 1


def test_a_retry_after_past_the_deadline_fails_the_turn_at_once():
    with ScriptedOpenAIServer(echo, fail_first=1, fail_status=429, retry_after="30") as server:
        sim, turn = one_turn(server, turn_timeout_s=3.0)
        assert server.counts["chat"] == 1
    assert turn.failed and turn.latency_s < 1.0  # given up on now, not held until the deadline
    assert "HTTP 429" in turn.error and "would pass the turn's deadline (turn_timeout_s=3.0)" in turn.error
    assert sim.deadline_failures == 1 and sim.failures == 1 and sim.retries == 0


def test_a_stalled_reply_fails_the_turn_at_its_deadline():
    with ScriptedOpenAIServer(echo, stall_first=1, stall_s=30.0) as server:
        sim, turn = one_turn(server, turn_timeout_s=1.0, timeout_s=20.0)
    assert turn.failed and 1.0 <= turn.latency_s <= 1.5, turn.latency_s
    assert turn.error == "no reply within the turn's deadline (turn_timeout_s=1.0)"
    assert sim.deadline_failures == 1 and sim.timeouts == 0


def test_tokens_per_minute_paces_by_the_request_s_size():
    tpm = 36000  # 600 tokens a second

    async def main(server):
        sim = make_sim(server, tokens_per_minute=tpm, max_tokens=60, turn_timeout_s=10.0)
        sessions = [sim.start(TASK) for _ in range(4)]
        # what each request counts: its messages at 4 characters a token, plus max_tokens
        cost = estimate_tokens(sessions[0].messages + [{"role": "user", "content": "agent 0"}], None, 60)
        turns = await asyncio.gather(*(s.reply(f"agent {i}") for i, s in enumerate(sessions)))
        await sim.aclose()
        return turns, cost

    with ScriptedOpenAIServer(echo) as server:
        turns, cost = asyncio.run(main(server))
        times = arrivals(server)
    assert not any(t.failed for t in turns)
    gap = cost * 60.0 / tpm
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"\n{cost} tokens a request at {tpm} tokens/min: gaps {[round(g, 3) for g in gaps]} (paced {gap:.3f} s)")
    assert 0.5 < gap < 1.0 and all(gap - 0.05 <= g <= gap + 0.5 for g in gaps), gaps
