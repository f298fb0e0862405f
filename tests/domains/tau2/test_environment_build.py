"""τ2 sessions build their database copies off the caller's thread: `reset` returns at once,
and an event loop that admits a burst of conversations (as the rollout loop does) keeps
serving while the copies are unpickled."""
from __future__ import annotations

import asyncio
import gc
import os
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest  # noqa: E402

from muajax.domains.base import ToolCall  # noqa: E402
from muajax.domains.tau2 import collector  # noqa: E402
from muajax.domains.tau2.environment import Tau2Environment  # noqa: E402

LOOKUP = ToolCall("get_user_details", {"user_id": "mia_li_3668"})  # a read of airline's database


@pytest.fixture(scope="module")
def airline():
    return Tau2Environment("airline")  # the larger database: 0.1-0.16 s a copy


def test_the_event_loop_keeps_ticking_while_a_burst_of_environments_is_built(airline):
    tasks = airline.tasks("train")[:16]

    async def main():
        gaps, done = [], False

        async def tick():
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        gaps.clear()
        t0 = time.perf_counter()
        sessions = [airline.reset(task) for task in tasks]  # admission: every conversation at once, on the loop
        admitted = time.perf_counter() - t0
        # each conversation's first tool call, in the tool threads, needs its copy
        observations = await asyncio.gather(*(asyncio.to_thread(s.step, LOOKUP) for s in sessions))
        built = time.perf_counter() - t0
        done = True
        await ticker
        for s in sessions:
            s.close()
        return admitted, built, max(gaps), observations

    admitted, built, max_gap, observations = asyncio.run(main())
    print(f"\n{len(tasks)} airline environments: reset took {admitted:.3f} s on the loop, built in {built:.2f} s, "
          f"the loop's longest gap {max_gap * 1e3:.0f} ms")
    assert all(not o.error and "mia_li_3668" in o.content for o in observations)
    assert built > 0.5  # enough unpickling to see: on the loop it would stall the ticker this long
    assert admitted < 0.2 * built and max_gap < 0.25 * built


def test_a_copy_built_in_the_background_is_the_one_built_in_place():
    telecom = Tau2Environment("telecom")  # its tasks set an initial state (the user's phone, the lines)
    task = telecom.tasks("train")[0]
    session = telecom.reset(task)
    in_place = telecom.build_session_environment(session._tau2_task, session._prefix)
    pristine = telecom.new_tau2_environment()
    assert session.state_hash() == (in_place.get_db_hash(), in_place.get_user_db_hash())
    assert session.state_hash() != (pristine.get_db_hash(), pristine.get_user_db_hash())  # the state was applied
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.state_hash()


def test_a_copy_that_cannot_be_built_makes_tool_calls_errors_not_crashes(airline, monkeypatch):
    def broken(tau2_task, prefix):
        raise ValueError("initial state does not apply")

    monkeypatch.setattr(airline, "build_session_environment", broken)
    session = airline.reset(airline.tasks("train")[0])
    for _ in range(2):
        obs = session.step(LOOKUP)
        assert obs.error and obs.setup_error
        assert obs.content == "Error: the τ2 environment could not be set up: ValueError: initial state does not apply"
    with pytest.raises(ValueError, match="initial state"):
        session.state_hash()
    session.close()


def test_copies_stay_out_of_the_collector_while_open_and_go_back_once_all_are_closed(airline):
    before = collector._live_copies
    sessions = [airline.reset(task) for task in airline.tasks("train")[:3]]
    for s in sessions:
        s.state_hash()  # built
    assert collector._live_copies == before + 3 and gc.get_freeze_count() > 100_000  # three copies frozen
    queued = [airline.reset(task) for task in airline.tasks("train")[:8]]
    for s in queued:  # closed at once: the ones the builder had not started are never built
        s.close()
    airline._builder.submit(lambda: None).result()  # the builder is idle again
    for s in sessions:
        s.close()
    assert collector._live_copies == before
    if before == 0:  # no other test's session is open: everything is back in the collector's reach
        assert gc.get_freeze_count() == 0
