"""Rollouts whose user or setup failed: out of the update and out of their group's statistics,
counted in the metrics; and a run whose user endpoint is down stops, saved and resumable."""
import json
import os
import socket
import subprocess
import sys

import numpy as np

from muajax.agent.trajectory import USER_ERROR, USER_STOP, Trajectory, rollout_metrics
from muajax.domains.base import UserSession, UserSimulator, UserTurn
from muajax.rl.advantages import group_advantages
from muajax.runtime.host_batch import PAD_GROUP, collate, mask_failed
from tests.support.tiny_models import arch_override
from tests.train.test_grpo import one_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trajectory(task: str, index: int, reward: float, failed: bool) -> Trajectory:
    tokens = [5, 6, 7, 8, 9][: 3 + index % 3]
    mask = [0, 0] + [1] * (len(tokens) - 2)
    return Trajectory(task, 0, index, 0, tokens, mask, [-0.5 * m for m in mask], 2, [],
                      USER_ERROR if failed else USER_STOP, reward=reward)


def reference_advantages(rewards, failed, groups):
    """GRPO's advantage over the rollouts that did not fail, in float64; 0 for the failed."""
    out = np.zeros(len(rewards))
    for g in set(groups):
        rows = [i for i in range(len(rewards)) if groups[i] == g and not failed[i]]
        r = np.array([rewards[i] for i in rows], np.float64)
        if len(r) > 1 and r.max() > r.min():
            out[rows] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return out


def test_failed_rollouts_leave_the_update_and_their_group_statistics():
    spec = [("a", 1.0, False), ("a", 0.0, False), ("a", 1.0, True), ("a", 0.0, False),   # a: 1 of 4 failed
            ("b", 0.0, True), ("b", 1.0, False), ("b", 0.0, True), ("b", 0.0, False),    # b: 2 of 4 failed
            ("c", 1.0, False), ("c", 0.0, True), ("c", 1.0, True), ("c", 1.0, True)]     # c: one left
    trajs = [trajectory(task, i, reward, failed) for i, (task, reward, failed) in enumerate(spec)]
    failed = np.array([f for _, _, f in spec])
    batch = mask_failed(collate(trajs), failed)
    assert (batch["loss_mask"][failed] == 0).all()
    np.testing.assert_array_equal(batch["loss_mask"][~failed], collate(trajs)["loss_mask"][~failed])
    assert (batch["group_ids"][failed] == PAD_GROUP).all()
    assert batch["group_ids"][~failed].tolist() == [0, 0, 0, 1, 1, 2]
    got = np.asarray(group_advantages(batch["rewards"], batch["group_ids"], 3))
    want = reference_advantages([r for _, r, _ in spec], failed, [t for t, _, _ in spec])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # group a: rewards (1, 0, 0) over its three good rollouts, not (1, 0, 1, 0) over all four
    np.testing.assert_allclose(got[:2], [2 / 3 / (np.sqrt(1 / 3) + 1e-6), -1 / 3 / (np.sqrt(1 / 3) + 1e-6)],
                               rtol=1e-6)
    unmasked = np.asarray(group_advantages(collate(trajs)["rewards"], collate(trajs)["group_ids"], 3))
    assert not np.allclose(unmasked[~failed], got[~failed])
    metrics = rollout_metrics(trajs)
    assert metrics["failed_rollouts"] == 6 and metrics["failed_share"] == 0.5


class FailsEveryOther(UserSimulator):
    """Every other user the run starts cannot answer (an endpoint failing part of the time)."""

    def __init__(self):
        self.started = 0

    def start(self, task, env=None):
        self.started += 1
        fail = self.started % 2 == 1

        class Session(UserSession):
            async def reply(self, agent_message):
                return UserTurn("", failed=True, error="endpoint down") if fail else UserTurn("bye ###STOP###")

        return Session()


def test_a_grpo_step_trains_on_the_rollouts_that_did_not_fail(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.train.test_grpo.StopUser", FailsEveryOther)
    _, _, record = one_step(tmp_path, "flaky", "rollout.n_per_task=4")  # 8 rollouts, 4 fail
    assert record["failed_rollouts"] == 4 and record["failed_share"] == 0.5
    # the update's tokens are the good rollouts' sampled tokens: fewer than all sampled tokens
    assert 0 < record["num_tokens"] < record["response_tokens"] * 8
    assert record["termination/user_error"] == 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_user_endpoint_down_for_the_whole_run_stops_training(tmp_path):
    args = ["run.stages=[grpo]", f"run.out_dir={tmp_path}", "run.name=down", "env.builtin_users=4",
            "env.builtin_test_users=0", "env.builtin_train_tasks=4", "env.builtin_test_tasks=2",
            arch_override(), "model.vocab=domain",
            "user.kind=openai", "user.model=m", f"user.base_url=http://127.0.0.1:{free_port()}/v1",
            "user.max_retries=0", "user.timeout_s=5", "rollout.n_per_task=2", "rollout.tasks_per_step=2",
            "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=4", "rollout.max_context=1536", "grpo.steps=3",
            "metrics.progress_bar=false", "metrics.tensorboard=false"]
    (tmp_path / "run.yaml").write_text("{}\n")  # the schema's defaults, not the embedded run's
    result = subprocess.run([sys.executable, "-m", "muajax.train", "--config", str(tmp_path / "run.yaml"), *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("muajax.train: error: GRPO step 1:") and "user_error" in message, message
    assert "rollout.max_failed_share=0.5" in message and "connection error" in message and "--resume" in message
    saved = os.path.join(tmp_path, "down", "checkpoints", "grpo", "0")
    assert os.path.isdir(saved), os.listdir(os.path.dirname(saved))
    meta = json.load(open(os.path.join(saved, "meta", "metadata")))
    assert meta["step"] == 0 and meta["data_position"] == 0  # --resume redoes the failed step
