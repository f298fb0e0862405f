"""OpenAIUserSimulator over real HTTP when things go wrong: retries, timeouts, failed turns,
the shared concurrency limit; the API key kept secret; argument validation; the test server."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import openai
import pytest

from muajax.domains.openai_user import DEFAULT_USER_GUIDELINES, OpenAIUserSimulator
from tests.domains.openai_user_support import FAST, KEY_ENV, SECRET_KEY, TASK, echo, make_sim
from tests.support.openai_server import ScriptedOpenAIServer


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET_KEY)


# ------------------------------------------------------------------ failures and retries


@pytest.mark.parametrize("status", [500, 503, 429])
def test_retries_transient_errors(status):
    async def main(server):
        sim = make_sim(server)
        turn = await sim.start(TASK).reply("hello")
        await sim.aclose()
        return sim, turn

    with ScriptedOpenAIServer(echo, fail_first=2, fail_status=status) as server:
        sim, turn = asyncio.run(main(server))
        outcomes = [r.outcome for r in server.chat_requests]
    assert not turn.failed and turn.text == "echo[3]: hello"
    assert outcomes == ["failed", "failed", "ok"]
    assert sim.stats() == {"requests": 3, "retries": 2, "failures": 0, "timeouts": 0,
                           "user_tool_calls": 0, "turns": 1, "throttled": 2 * (status == 429), "deadline_failures": 0}


def test_stall_hits_timeout_then_retries():
    async def main(server):
        sim = make_sim(server, timeout_s=0.4)
        t0 = time.monotonic()
        turn = await sim.start(TASK).reply("hello")
        elapsed = time.monotonic() - t0
        await sim.aclose()
        return sim, turn, elapsed

    with ScriptedOpenAIServer(echo, stall_first=1, stall_s=5.0) as server:
        sim, turn, elapsed = asyncio.run(main(server))
        assert server.counts == {"chat": 2, "failed": 0, "stalled": 1}
    assert not turn.failed and turn.text == "echo[3]: hello"
    assert sim.timeouts == 1 and sim.retries == 1 and sim.requests == 2
    assert 0.4 <= turn.latency_s < 3.0 and elapsed < 3.0  # gave up on the stall, did not wait it out


def test_permanent_failure_returns_failed_turn():
    async def main(server):
        sim = make_sim(server, max_retries=2)
        session = sim.start(TASK)
        before = list(session.messages)
        turn = await session.reply("hello")
        await sim.aclose()
        return sim, session, before, turn

    with ScriptedOpenAIServer(echo, fail_rate=1.0, fail_status=503) as server:
        sim, session, before, turn = asyncio.run(main(server))
        assert server.counts["failed"] == 3
    assert turn.failed and turn.text == "" and turn.end is None
    assert "gave up after 3 attempts" in turn.error and "HTTP 503" in turn.error
    assert sim.failures == 1 and sim.retries == 2 and sim.requests == 3
    assert session.messages == before


def test_client_errors_are_not_retried():
    async def main(server):
        sim = make_sim(server)
        turn = await sim.start(TASK).reply("hello")
        await sim.aclose()
        return sim, turn

    with ScriptedOpenAIServer(echo, fail_first=1, fail_status=404) as server:
        sim, turn = asyncio.run(main(server))
    assert turn.failed and "HTTP 404" in turn.error
    assert sim.requests == 1 and sim.retries == 0


def test_unreachable_endpoint_fails_cleanly():
    with ScriptedOpenAIServer(echo) as server:
        url = server.url  # now closed: connections are refused

    async def main():
        sim = OpenAIUserSimulator(model="m", base_url=url, api_key_env=KEY_ENV, max_retries=1, timeout_s=2, **FAST)
        turn = await sim.start(TASK).reply("hello")
        await sim.aclose()
        return sim, turn

    sim, turn = asyncio.run(main())
    assert turn.failed and "connection error" in turn.error and sim.requests == 2


def test_concurrency_limit_is_shared_across_sessions():
    async def main(server):
        sim = make_sim(server, max_concurrency=2)
        sessions = [sim.start(TASK) for _ in range(8)]
        turns = await asyncio.gather(*(s.reply(f"agent {i}") for i, s in enumerate(sessions)))
        await sim.aclose()
        return turns

    with ScriptedOpenAIServer(echo, latency_s=0.15) as server:
        turns = asyncio.run(main(server))
        assert server.max_in_flight == 2  # never more than the limit, and the limit was used
    assert [t.text for t in turns] == [f"echo[3]: agent {i}" for i in range(8)]
    assert max(t.latency_s for t in turns) >= 4 * 0.15  # the last pair queued behind three others


# ------------------------------------------------------------------ keys and validation


def test_api_key_never_in_repr_or_logs(caplog):
    caplog.set_level(logging.DEBUG)

    async def main(server):
        sim = make_sim(server)
        session = sim.start(TASK)
        turn = await session.reply("hello")
        texts = [repr(sim), str(sim), repr(session), repr(turn), json.dumps(sim.stats())]
        redacted = sim._redact(f"Incorrect API key provided: {SECRET_KEY}")
        await sim.aclose()
        return texts, redacted

    with ScriptedOpenAIServer(echo, fail_first=1) as server:
        texts, redacted = asyncio.run(main(server))
    assert any("retrying" in r.getMessage() for r in caplog.records)  # something was logged
    for text in texts + [caplog.text, redacted]:
        assert SECRET_KEY not in text
    assert KEY_ENV in texts[0]


def test_missing_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=KEY_ENV):
        OpenAIUserSimulator(model="gpt-4.1", base_url="https://api.example.com/v1", api_key_env=KEY_ENV)

    async def main(server):
        sim = make_sim(server)  # localhost: a dummy key is fine
        turn = await sim.start(TASK).reply("hi")
        await sim.aclose()
        return turn

    with ScriptedOpenAIServer(echo) as server:
        turn = asyncio.run(main(server))
        assert server.chat_requests[0].headers["authorization"] == "Bearer EMPTY"
    assert turn.text == "echo[3]: hi"


@pytest.mark.parametrize("kwargs,match", [
    ({"model": ""}, "model"),
    ({"base_url": "ftp://x"}, "base_url"),
    ({"temperature": -1}, "temperature"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"max_retries": -1}, "max_retries"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"backoff_base_s": 2, "backoff_max_s": 1}, "backoff"),
])
def test_bad_arguments(kwargs, match):
    args = {"model": "m", "base_url": "http://127.0.0.1:1/v1", **kwargs}
    with pytest.raises(ValueError, match=match):
        OpenAIUserSimulator(**args)


def test_default_guidelines_mention_end_tokens():
    for token in ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"):
        assert token in DEFAULT_USER_GUIDELINES


# ------------------------------------------------------------------ the test server itself


def test_server_models_and_bad_requests():
    async def main(server):
        client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)
        models = await client.models.list()
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages="not-a-list")  # type: ignore[arg-type]
        await client.close()
        return [m.id for m in models.data]

    with ScriptedOpenAIServer(echo, model="scripted") as server:
        ids = asyncio.run(main(server))
        outcomes = [r.outcome for r in server.requests]
    assert ids == ["scripted"] and outcomes == ["ok", "bad_request"]
    with pytest.raises(RuntimeError, match="not started"):
        _ = ScriptedOpenAIServer().url


def test_a_credential_inside_base_url_is_hidden_from_repr_errors_and_logs(monkeypatch, caplog):
    """Run configs refuse such a URL; code may still pass one (some proxies want userinfo)."""
    caplog.set_level(logging.DEBUG)
    password = "pw-9a8b7c6d5e"
    with ScriptedOpenAIServer(echo, fail_first=1) as server:
        url = server.url.replace("http://", f"http://ana:{password}@")

        async def main():
            sim = OpenAIUserSimulator(model="sim-model", base_url=url, api_key_env=KEY_ENV, **FAST)
            turn = await sim.start(TASK).reply("hello")
            await sim.aclose()
            return sim, turn

        sim, turn = asyncio.run(main())
    assert turn.text == "echo[3]: hello"  # the URL works as given
    query = OpenAIUserSimulator(model="m", base_url=f"http://127.0.0.1:9/v1?api_key={password}", api_key_env=KEY_ENV)
    texts = [repr(sim), str(sim), sim._redact(f"cannot reach {url}"), caplog.text, repr(query)]
    for text in texts:
        assert password not in text and SECRET_KEY not in text
    assert "http://***@127.0.0.1" in repr(sim) and "v1?api_key=***" in repr(query)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=r"the user simulator at https://\*\*\*@api.example.com/v1 needs an API key") \
            as info:
        OpenAIUserSimulator(model="m", base_url=f"https://ana:{password}@api.example.com/v1", api_key_env=KEY_ENV)
    assert password not in str(info.value)
