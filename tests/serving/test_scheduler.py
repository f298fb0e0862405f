"""A shared engine step that fails because of one request fails that request only: the
scheduler finds it and the others finish with exactly the text they have alone."""
import asyncio

import httpx

from tests.serving.bad_requests import GOOD
from tests.serving.conftest import health
from tests.serving.test_app import client, send, until
from tests.serving.test_serve import CALCULATE

POISON_SEED = 424242


def poison_step(engine, monkeypatch) -> list[int]:
    """Make `engine.step` raise whenever the slot opened with POISON_SEED is generating, as a
    request whose parameters break the device program would. Returns, per raise, how many
    slots were generating (so a test sees that others shared the failing step)."""
    opened, poisoned, raised = set(), set(), []
    real_open, real_release, real_step = engine.open, engine.release, engine.step

    def open_(tokens, *, seed=0):
        slot = real_open(tokens, seed=seed)
        opened.add(slot)
        if seed == POISON_SEED:
            poisoned.add(slot)
        return slot

    def release(slot):
        real_release(slot)
        opened.discard(slot)
        poisoned.discard(slot)

    def step():
        generating = [s for s in opened if engine.is_generating(s)]
        if poisoned & set(generating):
            raised.append(len(generating))
            raise RuntimeError("injected failure: a poisoned row")
        return real_step()

    monkeypatch.setattr(engine, "open", open_)
    monkeypatch.setattr(engine, "release", release)
    monkeypatch.setattr(engine, "step", step)
    return raised


def test_a_failing_step_fails_only_the_request_that_fails_it(served, monkeypatch):
    url = served.url + "/chat/completions"
    service, engine = served.service, served.service.engine
    # long enough that every good request is still generating when the poisoned one joins
    sampled = {**GOOD, "temperature": 1.0, "max_tokens": 600}
    goods = [{**sampled, "seed": 1}, {**sampled, "seed": 2, "stream": True},
             {**GOOD, "tools": [CALCULATE], "stop": "never", "max_tokens": 600}]
    poison = {**GOOD, "seed": POISON_SEED}

    async def run(raised):
        async with client() as http:
            alone = [await send(http, url, body) for body in goods]
            before = health(served)
            tasks = [asyncio.create_task(send(http, url, body)) for body in goods]
            await until(lambda: len(service.scheduler.running) == len(goods))
            poisoned = await http.post(url, json=poison)
            return alone, before, await asyncio.gather(*tasks), poisoned

    raised = poison_step(engine, monkeypatch)
    alone, before, together, poisoned = asyncio.run(run(raised))
    assert poisoned.status_code == 500
    error = poisoned.json()["error"]
    assert "injected failure" in error["message"] and error["type"] == "server_error", error
    assert max(raised) == len(goods) + 1  # the failing step was shared with every good request
    assert together == alone and all(status == 200 for status, _ in alone)
    now = health(served)
    assert now["errors"] - before["errors"] == 1 and now["completed"] - before["completed"] == len(goods)
    assert now["isolations"] > before["isolations"]
    assert engine.free_slots == engine.num_slots and not service.scheduler.running
    monkeypatch.undo()
    assert httpx.post(url, json=poison, timeout=60).status_code == 200  # it was the injected fault
