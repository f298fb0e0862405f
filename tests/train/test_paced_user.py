"""A short GRPO run whose simulated user is an LLM endpoint on 127.0.0.1 that answers 429 with
Retry-After for a share of requests and stalls a few, reached through the run config's
`user` section with its pacing keys: the run completes, the stalled rollouts fail at the
turn's deadline, out of the update and counted, and the endpoint sees no more than the
requests-per-minute setting."""
import json
import os
import time

from muajax.config.schema import load_config
from muajax.domains.registry import make_user
from tests.support.openai_server import ScriptedOpenAIServer
from tests.train.test_grpo import one_step

RPM, DEADLINE, STALL = 600, 3.0, 60.0


def time_turns(simulator) -> list[float]:
    """Every user turn's wall time, measured around the simulator's `reply`."""
    latencies, start = [], simulator.start

    def timed_start(task, env=None):
        session = start(task, env)
        reply = session.reply

        async def timed(text):
            t0 = time.monotonic()
            try:
                return await reply(text)
            finally:
                latencies.append(time.monotonic() - t0)

        session.reply = timed
        return session

    simulator.start = timed_start
    return latencies


def test_a_grpo_run_against_a_throttling_stalling_endpoint_completes_with_its_failures_masked(tmp_path, monkeypatch):
    with ScriptedOpenAIServer(lambda request: "Thanks, that's all. ###STOP###", fail_rate=0.3, fail_status=429,
                              retry_after="0.2", stall_first=2, stall_s=STALL, seed=1) as server:
        user = ["user.kind=openai", "user.model=sim", f"user.base_url={server.url}", "user.api_key_env=MUAJAX_NO_KEY",
                f"user.requests_per_minute={RPM}", f"user.turn_timeout_s={DEADLINE}", "user.max_retries=6"]
        cfg = load_config(None, user)
        simulator = make_user(cfg.user, cfg.env)
        latencies = time_turns(simulator)
        monkeypatch.setattr("tests.train.test_grpo.StopUser", lambda: simulator)
        one_step(tmp_path, "paced", "rollout.n_per_task=4", "grpo.steps=2", *user)
        times = sorted(r.received_at for r in server.chat_requests)
        counts = server.counts
    with open(os.path.join(tmp_path, "paced", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    stats = simulator.stats()
    measured = (len(times) - 1) * 60.0 / (times[-1] - times[0])
    print(f"\nendpoint: {counts}, {measured:.0f} requests/min (limit {RPM}); user: {stats}; "
          f"longest turn {max(latencies):.2f} s; steps: "
          + "; ".join(f"failed {r['failed_rollouts']}, user_latency_s {r['user_latency_s']:.2f}" for r in records))
    assert len(records) == 2  # the run completed both steps
    assert counts["stalled"] == 2 and counts["failed"] >= 2  # the endpoint misbehaved as asked
    # the two stalled turns failed at their deadline (and any turn whose next retry would
    # have passed it, given up at once): user errors, out of the update, counted
    first = records[0]
    assert first["failed_rollouts"] >= 2 and first["termination/user_error"] == first["failed_rollouts"] / 8
    assert 0 < first["num_tokens"] < first["response_tokens"] * 8
    assert all(r["failed_share"] <= 0.5 for r in records)  # rollout.max_failed_share: the run went on
    assert sum(r["failed_rollouts"] for r in records) == stats["failures"] == stats["deadline_failures"]
    assert stats["throttled"] == counts["failed"] and stats["retries"] >= 1
    # no turn waited past its deadline (a stalled reply holds its request for 60 s)
    assert len(latencies) == 16 and max(latencies) <= DEADLINE + 0.5, latencies
    assert measured <= RPM * 1.01
