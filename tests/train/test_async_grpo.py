"""Asynchronous GRPO (`grpo.max_staleness`): the handoff, the rollout thread's order and
bound, and whole runs whose every row is checked against the bound."""
import asyncio
import json
import os
import random
import threading
import time

import jax
import numpy as np
import pytest

from muajax.agent.trajectory import Trajectory
from muajax.config.schema import load_config
from muajax.domains.base import STOP, Domain, UserSession, UserSimulator, UserTurn
from muajax.models.tokenizer import load_tokenizer
from muajax.models.vocab import DomainTokenizer, DomainVocab
from muajax.runtime import build
from muajax.train import grpo as grpo_stage
from muajax.train.async_grpo import Batch, RolloutAhead, Stopped, WeightBoard, staleness
from muajax.train.context import build_context
from tests.support.tiny_models import arch_override
from tests.support.toy_domain import SayYesEnvironment, StopUser


def traj(*versions):
    return Trajectory(task_id="t", group_id=0, rollout_index=0, seed=0, tokens=[], loss_mask=[], logprobs=[],
                      prompt_len=0, messages=[], termination="user_stop", versions=list(versions))


def test_the_board_hands_over_the_version_asked_for_or_the_newest():
    board = WeightBoard()
    board.publish(0, "v0")
    board.publish(1, "v1")
    assert board.wait(0, exact=True) == (0, "v0") and board.wait(0, exact=False) == (1, "v1")
    board.forget_before(1)
    assert board.newest() == (1, "v1")
    got = []
    waiter = threading.Thread(target=lambda: got.append(board.wait(2, exact=True)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # version 2 is not published yet: the rollout waits for the update
    board.publish(2, "v2")
    waiter.join(5)
    assert got == [(2, "v2")]
    board.close()
    with pytest.raises(Stopped):
        board.wait(3, exact=True)


def test_staleness_is_measured_from_the_oldest_version_and_bounded():
    rows = [traj(3, 4), traj(4), traj()]  # the last row sampled nothing
    assert staleness(rows, 4, 1) == {"async/staleness_mean": 0.5, "async/staleness_max": 1.0}
    with pytest.raises(RuntimeError, match="staleness 0..2"):
        staleness([traj(2), traj(4)], 4, 1)


@pytest.mark.parametrize("bound, partial", [(1, False), (2, False), (2, True)])
def test_rolling_ahead_respects_the_bound_and_hands_batches_over_in_order(bound, partial):
    """A fake rollout thread against a slow trainer: batch k starts on a version >= k - bound
    (exactly max(0, k - bound) without partial rollouts), never earlier than it is published."""
    board, published, started = WeightBoard(), {}, {}
    loop = asyncio.new_event_loop()

    async def rollout(index, version, params):
        assert params == f"v{version}" and version in published
        started[index] = version
        await asyncio.sleep(0.01)
        return Batch(index, [traj(version)], index, index + 1, version, 0.01, 0.0)

    board.publish(0, "v0")
    published[0] = time.perf_counter()
    ahead = RolloutAhead(rollout, board, start=0, total=6, max_staleness=bound, partial=partial, loop=loop)
    try:
        for index in range(6):
            batch = ahead.get(index)
            assert batch.index == index and 0 <= index - batch.version <= bound
            if not partial:
                assert batch.version == max(0, index - bound)
            time.sleep(0.05)  # the update
            published[index + 1] = time.perf_counter()
            board.publish(index + 1, f"v{index + 1}")
    finally:
        ahead.close()
        loop.close()
    assert sorted(started) == list(range(6))


def test_closing_cancels_a_rollout_in_flight():
    board, loop = WeightBoard(), asyncio.new_event_loop()
    cancelled = threading.Event()

    async def rollout(index, version, params):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    board.publish(0, None)
    ahead = RolloutAhead(rollout, board, start=0, total=3, max_staleness=1, partial=False, loop=loop)
    time.sleep(0.2)
    t0 = time.perf_counter()
    ahead.close()
    assert cancelled.is_set() and time.perf_counter() - t0 < 5
    loop.close()


# ------------------------------------------------------------------ whole runs, in process

BASE = ["run.stages=[grpo]", "model.vocab=domain", arch_override(max_position_embeddings=256),
        "rollout.n_per_task=4", "rollout.tasks_per_step=2", "rollout.max_new_tokens_per_turn=4",
        "rollout.max_context=128", "rollout.max_turns=2", "grpo.learning_rate=3e-2", "grpo.kl_coef=0",
        "metrics.progress_bar=false", "metrics.tensorboard=false", "checkpoint.every_steps=100"]


class _TalkSession(UserSession):
    def __init__(self, delay):
        self.delay, self.replies = delay, 0

    async def reply(self, agent_message):
        await asyncio.sleep(self.delay)
        self.replies += 1
        return UserTurn("Go on.") if self.replies == 1 else UserTurn(f"Bye. {STOP}", end=STOP)


class SlowTalkUser(UserSimulator):
    """Answers "Go on." once, then stops; each reply after `delay` seconds."""

    def __init__(self, delay):
        self.delay = delay

    def start(self, task, env=None):
        return _TalkSession(self.delay)


class JitterTalkUser(SlowTalkUser):
    """SlowTalkUser with a random delay (0-0.2 s, from the OS's entropy) before each reply."""

    def __init__(self):
        super().__init__(0.0)
        self.rng = random.Random()

    def start(self, task, env=None):
        return _TalkSession(self.rng.uniform(0, 0.2))


def tiny_run(tmp_path, name, *overrides, user=None):
    """tests/train/test_train.py's learnable say-yes task (rewards differ within groups)."""
    base = load_tokenizer()
    words = [base.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", " maybe", " ok", ".", "!")]
    prompt = base.encode("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nSay yes or no.<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tok = DomainTokenizer(base, DomainVocab(words + prompt))
    cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path}", f"run.name={name}", *overrides])
    ctx = build_context(cfg, domain=Domain(SayYesEnvironment(), user or StopUser()), tokenizer=tok)
    params = build.initial_params(ctx.model_cfg, None, ctx.mesh, 0)
    trained = grpo_stage.run_grpo(ctx, params)
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return trained, records


@pytest.fixture
def trained_rows(monkeypatch):
    """Every row each step trains on, with a deliberately slow update: (step, oldest versions)."""
    seen = []
    original_train, original_update = grpo_stage.GRPOStage.train, grpo_stage._update

    def train(self, state, index, trajectories, *args, **kwargs):
        seen.append((index, [t.oldest_version for t in trajectories], [list(t.versions) for t in trajectories]))
        return original_train(self, state, index, trajectories, *args, **kwargs)

    def slow_update(*args, **kwargs):
        time.sleep(0.5)
        return original_update(*args, **kwargs)

    monkeypatch.setattr(grpo_stage.GRPOStage, "train", train)
    monkeypatch.setattr(grpo_stage, "_update", slow_update)
    return seen


@pytest.mark.parametrize("bound, partial", [(1, False), (2, True)])
def test_no_row_is_trained_above_the_bound(tmp_path, trained_rows, bound, partial):
    _, records = tiny_run(tmp_path, "slow", "grpo.steps=5", f"grpo.max_staleness={bound}",
                          f"rollout.partial={str(partial).lower()}", user=SlowTalkUser(0.05))
    assert [index for index, _, _ in trained_rows] == list(range(5))  # in order, each once
    for index, oldest, _ in trained_rows:
        assert oldest and all(v is not None and 0 <= index - v <= bound for v in oldest), (index, oldest)
        if not partial:
            assert set(oldest) == {max(0, index - bound)}
    assert all(r["async/staleness_max"] <= bound for r in records) and len(records) == 5
    # the rollouts ran ahead: later batches were sampled by older weights than their update's
    assert max(r["async/staleness_max"] for r in records) >= 1


def test_partial_rollouts_switch_weights_inside_a_conversation(tmp_path, trained_rows):
    """A slow user keeps conversations in flight across updates: they go on with the new weights."""
    tiny_run(tmp_path, "partial", "grpo.steps=4", "grpo.max_staleness=1", "rollout.partial=true",
             user=SlowTalkUser(0.6))
    mixed = [versions for _, _, rows in trained_rows for versions in rows if len(set(versions)) > 1]
    assert mixed, trained_rows


def test_max_staleness_zero_is_the_synchronous_loop(tmp_path, trained_rows):
    """max_staleness 0: every row sampled by the very params its step updates (the loop as it
    was: bitwise-equal params to it were checked against the code before this feature, see
    the report of the commit), no async metrics. One step ahead trains step 1 on version 0's
    samples instead, and ends elsewhere."""
    sync, records = tiny_run(tmp_path, "sync", "grpo.steps=3")
    assert [(index, oldest) for index, oldest, _ in trained_rows] == [(i, [i] * 8) for i in range(3)]
    assert all(not any(k.startswith("async/") for k in r) for r in records)
    assert all(r["first_pass/ratio_abs_dev"] < 1e-6 for r in records)  # on-policy: the engine's logprobs
    trained_rows.clear()
    ahead, async_records = tiny_run(tmp_path, "ahead", "grpo.steps=3", "grpo.max_staleness=1")
    assert [(index, oldest) for index, oldest, _ in trained_rows] == [(0, [0] * 8), (1, [0] * 8), (2, [1] * 8)]
    assert [r["async/staleness_max"] for r in async_records] == [0.0, 1.0, 1.0]
    assert async_records[0]["loss"] == records[0]["loss"]  # step 0 is the same on-policy step
    # off-policy by one update from step 1 on: the ratios to the engine's logprobs move off 1
    # (on-policy they are 1 to float32 rounding, < 1e-6 here)
    assert all(r["first_pass/ratio_abs_dev"] > 1e-5 for r in async_records[1:]), async_records
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(sync), jax.tree.leaves(ahead)))


def test_asynchronous_runs_repeat_whatever_the_users_timing(tmp_path):
    """Without partial rollouts a batch rolls out on exactly one version whatever the timing:
    two runs whose users answer after random delays end with the same params. (With a bound
    of 2, batch k could find version k - 1 published or not: it takes k - 2 either way.)"""
    a, _ = tiny_run(tmp_path, "a", "grpo.steps=4", "grpo.max_staleness=2", user=JitterTalkUser())
    b, _ = tiny_run(tmp_path, "b", "grpo.steps=4", "grpo.max_staleness=2", user=JitterTalkUser())
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class _DownAfter(UserSimulator):
    """SlowTalkUser(0) for the first `sessions` conversations; every later one fails."""

    def __init__(self, sessions):
        self.left = sessions

    def start(self, task, env=None):
        self.left -= 1
        inner, up = _TalkSession(0.0), self.left >= 0

        class Session(UserSession):
            async def reply(self, agent_message):
                if not up:
                    raise ConnectionError("the user endpoint is down")
                return await inner.reply(agent_message)

        return Session()


def test_a_step_whose_rollouts_failed_stops_the_asynchronous_run_cleanly(tmp_path):
    """The user is down from batch 2 on (rolled out ahead, during step 1's update): step 2
    stops the run after saving the state it started from, and the rollout thread ends."""
    with pytest.raises(grpo_stage.FailedRolloutsError, match="GRPO step 3: 8 of 8 rollouts failed"):
        tiny_run(tmp_path, "down", "grpo.steps=5", "grpo.max_staleness=1", user=_DownAfter(16))
    assert (tmp_path / "down" / "checkpoints" / "grpo" / "2").is_dir()
    deadline = time.time() + 10
    while any(t.name == "muajax-rollout-ahead" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name == "muajax-rollout-ahead"]


# ------------------------------------------------------------------ kill -9 and resume (a subprocess)

def test_kill9_during_an_asynchronous_run_resumes_and_finishes(tmp_path):
    """Killed once checkpoint 2 is written (batch 2 is then rolling out ahead of its update),
    resumed: the state and version of step 2 come back, batch 2 is rolled out again on
    version 2, and every step is trained exactly once."""
    from tests.train.test_train import (
        TINY_RUN,
        final_summary,
        kill_at_checkpoint,
        resumed_step,
        run_train,
    )

    run_dir = tmp_path / "run"
    args = [*TINY_RUN, "grpo.max_staleness=1", f"run.out_dir={run_dir}"]
    kill_at_checkpoint(args, "grpo", 2, run_dir)
    resumed = run_train([*args, "--resume"], timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = resumed_step(resumed.stdout, "grpo")
    assert 2 <= start < 4
    assert "params_sha256" in final_summary(resumed.stdout)
    (metrics,) = run_dir.glob("*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # nothing trained twice, nothing skipped
    assert [r["data/position"] for r in records] == [2, 4, 6, 8]
    # before the kill: batch k on version k - 1; after: the first batch on the resumed version
    versions = [r["async/rollout_version"] for r in records]
    assert versions[:start] == [0.0] + [float(k - 1) for k in range(1, start)]
    assert versions[start:] == [float(start)] + [float(k - 1) for k in range(start + 1, 4)]
    assert all(r["async/staleness_max"] <= 1 for r in records)
    assert any(p.is_dir() for p in run_dir.glob("*/checkpoints/grpo/4"))
