"""The simulated users' reply delay (`user.latency_s`): drawn as configured, seeded, waited
without blocking the event loop, counted in the reply's latency, and off by default."""
from __future__ import annotations

import asyncio
import statistics
import time

import openai
import pytest

from muajax.config.schema import ConfigError, load_config
from muajax.domains.base import STOP, Task
from muajax.domains.bfcl.user import BfclUser
from muajax.domains.builtin import BuiltinEnvironment
from muajax.domains.builtin.user import ScriptedUser
from muajax.domains.latency import UNIFORM_MAX_JITTER, ReplyDelay, reply_delay
from muajax.domains.registry import make_user
from tests.support.openai_server import ScriptedOpenAIServer

ASK = "Sure. Please tell me your full name and zip code."


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return BuiltinEnvironment(n_users=20, n_test_users=4, n_train_tasks=60, n_test_tasks=15).tasks("train")


def timed_reply(session, text: str = ASK):
    async def one():
        t0 = time.perf_counter()
        turn = await session.reply(text)
        return turn, time.perf_counter() - t0
    return asyncio.run(one())


def draws(delay: ReplyDelay, task_id: str = "t", k: int = 0, n: int = 5) -> list[float]:
    stream = delay.stream(task_id, k)
    return [stream.next() for _ in range(n)]


def test_a_reply_comes_after_its_delay_and_its_latency_counts_it(tasks):
    user = ScriptedUser(delay=ReplyDelay(0.25))
    task = tasks[0]
    turn, wall = timed_reply(user.start(task))
    assert 0.25 <= wall < 0.25 + 0.2
    assert 0.25 <= turn.latency_s <= wall
    assert turn.text == f"I am {task.metadata['name']}, zip {task.metadata['zip']}."
    # the synchronous core (the scripted expert's) never waits
    t0 = time.perf_counter()
    assert user.start(task).respond(ASK).text == turn.text and time.perf_counter() - t0 < 0.05


def test_a_jittered_reply_waits_its_own_seeded_draw(tasks):
    delay = ReplyDelay(0.2, jitter=0.5, seed=3)
    user = ScriptedUser(delay=delay)
    expected = draws(delay, tasks[0].task_id, 0, n=2)
    session = user.start(tasks[0])
    for want in expected:
        turn, wall = timed_reply(session)
        assert want <= turn.latency_s <= wall < want + 0.2
    assert len(set(round(x, 6) for x in expected)) == 2


def test_no_delay_is_today_s_user(tasks):
    messages = [ASK, "Which order?", "Anything else?", "hello", "hello", "hello"]
    for task in tasks[:6]:
        plain, off = ScriptedUser().start(task), ScriptedUser(delay=ReplyDelay(0.0)).start(task)
        for m in messages:
            a, b = asyncio.run(plain.reply(m)), asyncio.run(off.reply(m))
            assert a == b and b.latency_s == 0.0
    assert reply_delay(load_config(None, []).user) is None
    assert ScriptedUser(delay=ReplyDelay(0.0)).delays.start("t") is None


def test_the_delays_repeat_for_a_seed_and_differ_by_session_and_seed():
    delay = ReplyDelay(1.0, jitter=0.4, distribution="lognormal", seed=7)
    assert draws(delay) == draws(ReplyDelay(1.0, jitter=0.4, distribution="lognormal", seed=7))
    assert draws(delay) != draws(delay, k=1) != draws(delay, task_id="u")
    assert draws(delay) != draws(ReplyDelay(1.0, jitter=0.4, distribution="lognormal", seed=8))
    # a simulator numbers each task's sessions: the same k-th session draws the same delays
    # whatever order the sessions of different tasks start in
    one, two = ScriptedUser(delay=delay).delays, ScriptedUser(delay=delay).delays
    a = [one.start("x").next(), one.start("y").next(), one.start("x").next()]
    b = [two.start("y").next(), two.start("x").next(), two.start("x").next()]
    assert (a[0], a[1], a[2]) == (b[1], b[0], b[2]) and a[0] != a[2]


@pytest.mark.parametrize("distribution", ["uniform", "lognormal"])
def test_the_draws_have_the_configured_mean_and_spread(distribution):
    delay = ReplyDelay(1.5, jitter=0.5, distribution=distribution, seed=0)
    xs = draws(delay, n=20000)
    assert statistics.fmean(xs) == pytest.approx(1.5, rel=0.02)
    assert statistics.stdev(xs) == pytest.approx(0.75, rel=0.05)
    assert min(xs) >= 0
    if distribution == "uniform":  # evenly over 1.5 x (1 +- sqrt(3) x 0.5)
        half = 3 ** 0.5 * 0.75
        assert 1.5 - half <= min(xs) < 1.5 - half + 0.01 and 1.5 + half - 0.01 < max(xs) <= 1.5 + half
    else:  # right-skewed: the median below the mean
        assert statistics.median(xs) < 1.5
    assert set(draws(ReplyDelay(0.3), n=4)) == {0.3}


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="at most 1/sqrt"):
        ReplyDelay(1.0, jitter=UNIFORM_MAX_JITTER + 0.01)
    ReplyDelay(1.0, jitter=2.0, distribution="lognormal")
    with pytest.raises(ValueError, match="distribution"):
        ReplyDelay(1.0, distribution="normal")
    with pytest.raises(ValueError, match=">= 0"):
        ReplyDelay(-1.0)


def test_the_config_sets_the_delay_from_the_command_line():
    cfg = load_config(None, ["user.latency_s=1.0", "user.latency_jitter=0.5", "user.latency_seed=4"])
    user = make_user(cfg.user, cfg.env)
    assert isinstance(user, ScriptedUser)
    assert user.delays.delay == ReplyDelay(1.0, 0.5, "uniform", 4)
    with pytest.raises(ConfigError, match="user.latency_jitter"):
        load_config(None, ["user.latency_s=1.0", "user.latency_jitter=0.7"])
    lognormal = load_config(None, ["user.latency_s=1", "user.latency_jitter=0.7",
                                   "user.latency_distribution=lognormal"])
    assert reply_delay(lognormal.user) == ReplyDelay(1.0, 0.7, "lognormal", 0)
    with pytest.raises(ConfigError, match="user.latency_s"):
        load_config(None, ["user.kind=openai", "user.model=m", "user.latency_s=1.0"])
    with pytest.raises(ConfigError, match="user.latency_s"):
        load_config(None, ["user.latency_s=-1"])


class _BfclTurns:
    """The one thing BfclUser reads of a BFCL session: its next scripted user turn."""

    def __init__(self, turns):
        self.turns = list(turns)

    def next_user_turn(self):
        return self.turns.pop(0) if self.turns else None


def test_the_bfcl_user_waits_as_configured():
    task = Task("multi_turn_base_0", "bfcl", "first", "")
    session = BfclUser(ReplyDelay(0.2)).start(task, _BfclTurns(["second"]))
    turn, wall = timed_reply(session, "done")
    assert turn.text == "second" and 0.2 <= turn.latency_s <= wall < 0.4
    turn, _ = timed_reply(session, "done")
    assert turn.end == STOP and turn.latency_s >= 0.2
    assert asyncio.run(BfclUser().start(task, _BfclTurns(["x"])).reply("done")).latency_s == 0.0


def test_concurrent_sessions_wait_together_not_in_turn(tasks):
    """Eight sessions asking at once: the wall is about the longest delay, not the sum."""
    delay = ReplyDelay(0.3, jitter=0.2, seed=1)
    user = ScriptedUser(delay=delay)
    sessions = [user.start(t) for t in tasks[:8]]

    async def main():
        t0 = time.perf_counter()
        turns = await asyncio.gather(*(s.reply(ASK) for s in sessions))
        return turns, time.perf_counter() - t0

    turns, wall = asyncio.run(main())
    waits = [t.latency_s for t in turns]
    assert max(waits) <= wall < max(waits) + 0.15 and sum(waits) > 5 * wall


def test_the_fake_endpoint_draws_its_latency_the_same_way():
    spec = dict(latency_s=0.15, latency_jitter=0.5, latency_distribution="lognormal", seed=2)
    seen = []
    for _ in range(2):
        with ScriptedOpenAIServer(lambda request: "hi", **spec) as server:
            client = openai.OpenAI(base_url=server.url, api_key="x")
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                walls.append(time.perf_counter() - t0)
            client.close()
            assert all(d <= w for d, w in zip(server.delays, walls))
            seen.append(list(server.delays))
    assert seen[0] == seen[1] and len(set(seen[0])) == 3
    with pytest.raises(ValueError, match="at most 1/sqrt"):
        ScriptedOpenAIServer(latency_s=1.0, latency_jitter=0.9)
