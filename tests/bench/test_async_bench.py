"""`python -m muajax.bench async`: its name, its user delay, its options and (slow tier) a
quick end-to-end run's JSON. No timing targets asserted: the figures depend on the box."""
import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from muajax.bench import __main__ as bench_main
from muajax.bench import async_grpo
from muajax.bench.common import BenchError
from muajax.domains.base import Task, UserSimulator, UserTurn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_async_is_listed_and_dispatched_to_its_module():
    assert "async" in bench_main.available() and "async_grpo" not in bench_main.available()
    assert bench_main.main(["async", "--steps", "2", "--warmup", "2"]) == bench_main.EXIT_FAILED  # a BenchError


class _Echo(UserSimulator):
    def start(self, task, env=None):
        class Session:
            async def reply(self, agent_message):
                return UserTurn(f"echo {agent_message}")

        return Session()


def test_the_delayed_user_waits_a_seeded_jittered_delay_then_delegates():
    user = async_grpo.delayed_user(_Echo(), 0.2, 0.5)
    task = Task("t1", "d", "do it", "")

    async def one_reply(session):
        start = time.perf_counter()
        turn = await session.reply("hi")
        return turn, time.perf_counter() - start

    async def both():  # concurrently: the delays overlap (asyncio.sleep), they do not add up
        return await asyncio.gather(one_reply(user.start(task)), one_reply(user.start(task)))

    start = time.perf_counter()
    (a, wait_a), (b, wait_b) = asyncio.run(both())
    assert a.text == b.text == "echo hi"
    half = 0.2 * 0.5 * 3 ** 0.5
    assert all(0.2 - half - 0.02 <= w <= 0.2 + half + 0.2 for w in (wait_a, wait_b))
    assert time.perf_counter() - start < wait_a + wait_b
    # the same task's k-th session draws the same delays in any run
    again = async_grpo.delayed_user(_Echo(), 0.2, 0.5)
    first = [again.start(task).rng.random() for _ in range(2)]
    assert first == [user2.rng.random() for user2 in map(async_grpo.delayed_user(_Echo(), 0.2, 0.5).start,
                                                         [task, task])]
    assert first[0] != first[1]


@pytest.mark.parametrize("argv, message", [(["--steps", "3", "--warmup", "2"], "--steps"),
                                           (["--jitter", "0.9"], "--jitter")])
def test_bad_options_are_bench_errors(argv, message):
    with pytest.raises(BenchError, match=message):
        async_grpo.parse(argv)


def test_quick_run_reports_both_runs_and_the_speedups():
    proc = subprocess.run([sys.executable, "-m", "muajax.bench", "async", "--quick"], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "async"
    sync, ahead = out["sync"], out["async"]
    assert out["async_speedup"] == pytest.approx(ahead["steps_per_hour"] / sync["steps_per_hour"])
    assert out["ideal_speedup"] == pytest.approx((sync["rollout_s"] + sync["update_s"])
                                                 / max(sync["rollout_s"], sync["update_s"]))
    assert out["staleness"]["sync"] == [0.0, 0.0] and out["staleness"]["async"][1] == 1.0
    assert "[sync]" in proc.stderr + proc.stdout and "ideal speed-up" in proc.stderr + proc.stdout
