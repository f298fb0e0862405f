"""The server under bad input, overload and disconnects: 64 good requests run beside 64+
bad ones and come out exactly as when sent alone; every bad one gets a 4xx with an
OpenAI-style error body; a full queue answers 503 with Retry-After; a client that goes
away (plain or streaming) gives its engine slot back."""
import asyncio
import json
import time

import httpx

from tests.serving.bad_requests import GOOD, chunked, fixed_cases, fuzz_cases
from tests.serving.conftest import MAX_BODY_BYTES, health
from tests.serving.test_serve import CALCULATE, CHAIN_TEXT, USER

ERROR_KEYS = {"message", "type", "param", "code"}


def client(**kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=300, max_keepalive_connections=300),
                             **kwargs)


def good_bodies() -> list[dict]:
    """16 different good requests: greedy (plain, tools, streamed, cut by max_tokens or a stop
    string, a tool-call history) and seeded sampling, whose texts differ by seed."""
    history = USER + [
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calculate",
                                                              "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    bodies = []
    for i in range(2):
        user = [USER[0], {"role": "user", "content": f"What is {i}+3?"}]
        bodies += [
            {**GOOD, "messages": user},
            {**GOOD, "messages": user, "tools": [CALCULATE]},
            {**GOOD, "messages": user, "tools": [CALCULATE], "stream": True, "stream_options": {"include_usage": True}},
            {**GOOD, "messages": user, "stream": True},
            {**GOOD, "messages": user, "max_tokens": 3 + 4 * i},
            {**GOOD, "messages": user, "stop": ["<tool_call>", "calc"][i]},
            # near-uniform over the vocabulary, so each seed writes its own text
            {**GOOD, "messages": user, "temperature": 1.0 + i / 2, "top_k": [0, 100_000][i], "seed": 11 + i,
             "max_tokens": 20},
            {**GOOD, "messages": history, "tools": [CALCULATE], "seed": i},
        ]
    return bodies


def outcome(message: dict, finish_reason: str) -> tuple:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return message.get("content") or "", calls, finish_reason


async def send(http: httpx.AsyncClient, url: str, body: dict) -> tuple[int, object]:
    """(status, (content, tool calls, finish reason)) of a good request, streamed or not."""
    if not body.get("stream"):
        r = await http.post(url, json=body)
        if r.status_code != 200:
            return r.status_code, r.json()
        choice = r.json()["choices"][0]
        return 200, outcome(choice["message"], choice["finish_reason"])
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())
        message, finish = {"content": "", "tool_calls": []}, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return 500, chunk
            for choice in chunk["choices"]:
                message["content"] += choice["delta"].get("content") or ""
                message["tool_calls"] += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
        return 200, outcome(message, finish)


async def send_bad(http: httpx.AsyncClient, url: str, body) -> httpx.Response:
    content = body() if callable(body) else body
    return await http.post(url, content=content, headers={"content-type": "application/json"})


def check_error(r: httpx.Response, status: int | None, param: str | None, what) -> None:
    assert (r.status_code == status) if status else 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    if param is not None:
        assert error["param"] == param, (what, error)


def test_good_requests_come_out_as_alone_while_bad_ones_get_4xx(served):
    url = served.url + "/chat/completions"
    goods = good_bodies()
    fixed = fixed_cases() + [(chunked(MAX_BODY_BYTES + 100_000), 413, None)]
    bads = fixed + fuzz_cases(max(64 - len(fixed), 24))
    before = health(served)

    async def run():
        async with client() as http:
            alone = [await send(http, url, body) for body in goods]
            good_tasks = [send(http, url, goods[i % len(goods)]) for i in range(64)]
            bad_tasks = [send_bad(http, url, body) for body, _, _ in bads]
            mixed = [t for pair in zip(good_tasks, bad_tasks) for t in pair]
            mixed += good_tasks[len(bad_tasks):] + bad_tasks[len(good_tasks):]
            results = await asyncio.gather(*mixed)
            return alone, results, await send(http, url, goods[1])

    alone, results, after = asyncio.run(run())
    assert all(status == 200 for status, _ in alone), alone
    # the references themselves are right: greedy writes the chain, a seed picks its own text
    assert alone[0][1] == (CHAIN_TEXT, [], "stop")
    assert alone[1][1] == ("Sure.", [("calculate", '{"expression": "2+3"}')], "tool_calls")
    assert alone[5][1] == ("Sure.", [], "stop") and alone[6][1] != alone[14][1]
    good_results = [r for r in results if isinstance(r, tuple)]
    bad_results = [r for r in results if isinstance(r, httpx.Response)]
    assert len(good_results) == 64 and len(bad_results) == len(bads) >= 64
    for i, (status, got) in enumerate(good_results):
        assert status == 200 and got == alone[i % len(goods)][1], (goods[i % len(goods)], status, got)
    for r, (body, status, param) in zip(bad_results, bads):
        check_error(r, status, param, body if isinstance(body, bytes) and len(body) < 300 else "(long body)")
    assert after == alone[1]  # the server still answers
    now = health(served)
    assert now["status"] == "ok" and now["running"] == 0 and now["queued"] == 0
    assert now["errors"] == before["errors"] and now["completed"] - before["completed"] == 64 + len(goods) + 1
    assert served.service.engine.free_slots == served.service.engine.num_slots


def test_random_bodies_never_get_anything_but_a_4xx(served):
    url = served.url + "/chat/completions"
    cases = fuzz_cases(300, seed=7)

    async def run():
        async with client() as http:
            return await asyncio.gather(*(send_bad(http, url, body) for body, _, _ in cases))

    for r, (body, _, _) in zip(asyncio.run(run()), cases):
        check_error(r, None, None, body[:300])


async def until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def long_body(seed: int, **extra) -> dict:
    # sampled: ~1/8 chance per token of staying on the chain, so it never reaches <|im_end|>
    return {**GOOD, "temperature": 1.0, "seed": seed, "max_tokens": 900, **extra}


def test_a_full_queue_answers_503_with_retry_after(served, monkeypatch):
    url = served.url + "/chat/completions"
    service, engine = served.service, served.service.engine
    monkeypatch.setattr(service.scheduler, "max_queue", 0)  # no waiting: every slot taken means 503
    before = health(served)

    async def run():
        async with client() as http:
            longs = [asyncio.create_task(http.post(url, json=long_body(i))) for i in range(engine.num_slots)]
            await until(lambda: len(service.scheduler.running) == engine.num_slots)
            refused = await asyncio.gather(*(http.post(url, json=GOOD) for _ in range(3)))
            for task in longs:  # hang up: their slots come back
                task.cancel()
            await until(lambda: engine.free_slots == engine.num_slots and not service.scheduler.running)
            return refused, await http.post(url, json=GOOD)

    refused, after = asyncio.run(run())
    for r in refused:
        check_error(r, 503, None, "overload")
        assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == CHAIN_TEXT
    now = health(served)
    assert now["requests"] - before["requests"] == engine.num_slots + 1  # refused ones were never queued
    assert now["cancelled"] - before["cancelled"] == engine.num_slots and now["errors"] == before["errors"]


def test_a_client_that_hangs_up_gives_its_slot_back(served):
    url = served.url + "/chat/completions"
    service, engine = served.service, served.service.engine
    slots = engine.num_slots

    async def hang_up(stream: bool):
        async with client() as http:
            if stream:
                async with http.stream("POST", url, json=long_body(1, stream=True)) as r:
                    assert r.status_code == 200
                    await anext(r.aiter_lines())  # the first chunk: it is being served
                    await until(lambda: engine.free_slots == slots - 1)
                # leaving the block before the end closes the connection
            else:
                task = asyncio.create_task(http.post(url, json=long_body(2)))
                await until(lambda: engine.free_slots == slots - 1)
                task.cancel()
        await until(lambda: engine.free_slots == slots and not service.scheduler.running)

    for stream in (False, True):
        before = health(served)
        asyncio.run(hang_up(stream))
        now = health(served)
        # dropped, not finished: the slot came back because the client left
        assert now["cancelled"] - before["cancelled"] == 1, stream
        assert now["completed"] == before["completed"] and now["errors"] == before["errors"], stream
