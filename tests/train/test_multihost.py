"""Multi-process runs on one machine: two jax processes on CPU (gloo collectives) joined
through MUAJAX_COORDINATOR on 127.0.0.1, exactly as tpu/ and gpu/ launch them on real hosts."""
import json
import os
import socket
import subprocess
import sys

import pytest

from muajax.runtime.host_batch import PAD_GROUP, pad_rows
from muajax.runtime.distributed import task_share
from tests.support.tiny_models import arch_override

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 900

# tests/test_train.py's TINY_RUN, at a context where every rollout collates to one length
# (one compilation of the step), for two steps of two microbatches (each holding rows of
# both processes).
TINY_GRPO = [
    "run.stages=[grpo]", "model.hf_dir=null", arch_override(), "model.vocab=domain",
    "rollout.n_per_task=2", "rollout.tasks_per_step=2", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12",
    "rollout.max_context=1024", "grpo.steps=2", "grpo.learning_rate=1e-3", "grpo.microbatch_size=2",
    "checkpoint.every_steps=1",
    "checkpoint.keep=2", "eval.max_tasks=2", "metrics.progress_bar=false", "metrics.tensorboard=false",
    # Padded GRPO rows: packed rows are packed by each host from its own trajectories, so one
    # process and two lay the same global batch out differently (and round differently).
    "grpo.pack_rows=false",
    # Params replicated over two devices in both runs: every cross-device reduction is then a
    # sum of two terms, exact in any order, so gloo's all-reduce between processes and the
    # in-process one agree to the bit. (An fsdp split would make the per-process engine's
    # single-device matmuls round differently from the one-process engine's split ones.)
    "mesh.data=2", "mesh.fsdp=1",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv, *, devices: int, process_id: int | None = None, port: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    for key in ("MUAJAX_COORDINATOR", "MUAJAX_NUM_PROCESSES", "MUAJAX_PROCESS_ID", "MUAJAX_DISTRIBUTED"):
        env.pop(key, None)
    if process_id is not None:
        env.update(MUAJAX_COORDINATOR=f"127.0.0.1:{port}", MUAJAX_NUM_PROCESSES="2", MUAJAX_PROCESS_ID=str(process_id))
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs) -> list[tuple[int, str, str]]:
    """Wait for all; if one fails or hangs, stop the rest (their peers would wait forever)."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT)
            results.append((proc.returncode, out, err))
            if proc.returncode != 0:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for code, out, err in results:
        assert code == 0, err[-4000:]
    assert len(results) == len(procs)
    return results


# ---------------------------------------------------------------------------------- in-process


def test_task_share_is_contiguous_and_equal():
    tasks = list("abcdef")
    shares = [task_share(tasks, p, 3) for p in range(3)]
    assert shares == [(0, ["a", "b"]), (2, ["c", "d"]), (4, ["e", "f"])]
    with pytest.raises(ValueError, match=r"tasks_per_step=6 must be divisible by the number of processes \(4\)"):
        task_share(tasks, 0, 4)


def test_padding_rows_are_in_no_group_and_fully_masked():
    import numpy as np

    batch = {"tokens": np.ones((2, 3), np.int32), "loss_mask": np.ones((2, 3), np.int32),
             "rewards": np.ones((2,), np.float32), "group_ids": np.array([4, 4], np.int32)}
    out = pad_rows(batch, 2, pad_id=9)
    assert out["tokens"][2:].tolist() == [[9] * 3] * 2 and out["loss_mask"][2:].sum() == 0
    assert out["group_ids"].tolist() == [4, 4, PAD_GROUP, PAD_GROUP] and out["rewards"][2:].sum() == 0
    from muajax.rl.advantages import group_advantages

    adv = np.asarray(group_advantages(np.array([1, 0, 1, 1], np.float32), out["group_ids"], 8))
    assert adv[2:].tolist() == [0.0, 0.0] and adv[0] != 0  # the pads neither get nor change an advantage


# ---------------------------------------------------------------------------------- two processes


def test_distributed_helpers_across_two_processes(tmp_path):
    """fsdp over 2 processes × 2 devices: the per-process engine replica, the global batch
    (split, padded, and replicated across processes), metric gathering, broadcast, checkpoints."""
    port = free_port()
    procs = [launch(["-m", "tests.support.workers.multihost", str(tmp_path / "ckpt")], devices=2, process_id=i, port=port)
             for i in range(2)]
    results = [json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
               for _, out, _ in finish(procs)]
    for p, r in enumerate(results):
        assert (r["process"], r["processes"], r["devices"]) == (p, 2, 4)
        e = r["engine"]
        assert e["params_split_across_processes"] and e["replica_is_local"]
        assert e["replica_equals_global"] and e["replica_follows_update"]
        assert e["engine_tokens"] == e["plain_tokens"] and e["logprob_max_diff"] <= 1e-5
        # process p's rows, in process order; group ids as each process offset them
        want = {"shape": [8, 4], "first_column": [0, 4, 8, 12, 100, 104, 108, 112],
                "group_ids": [0, 0, 1, 1, 10, 10, 11, 11], "mask_rows": [4] * 8, "sharding_ok": True,
                "shared_ok": True}
        assert r["batch"] == want
        assert r["batch_replicated"] == want  # the all-gather path gives the same global batch
        assert r["batch_padded"] == {"shape": [8, 4], "first_column": [0, 4, 8, 0, 100, 104, 108, 0],
                                     "group_ids": [0, 0, 1, PAD_GROUP, 10, 10, 11, PAD_GROUP],
                                     "mask_rows": [4, 4, 4, 0, 4, 4, 4, 0], "sharding_ok": True, "shared_ok": True}
        x = r["exchange"]
        assert x["metrics_equal"] and len(x["merged_ids"]) == 8
        assert x["broadcast"] == {"from": 0, "rows": [0, 1, 2, 3, 4]}
        assert x["failure"] == ("ValueError: bad SFT record" if p == 0 else
                                "RuntimeError: process 0 failed: ValueError: bad SFT record")
        assert x["share"] == [2 * p, list("abcd"[2 * p:2 * p + 2])]
        assert "must be divisible by the number of processes (2)" in x["share_error"]
        assert r["checkpoint"] == {"steps": [3], "position": 12, "restored_equal": True, "same_layout": True}
    assert os.path.isdir(tmp_path / "ckpt" / "3")


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_two_processes_train_exactly_like_one_process_with_the_same_global_batch(tmp_path, max_staleness):
    """2 processes × 1 CPU device, each rolling out one of the step's 2 tasks with its own
    engine and simulated users, against 1 process × 2 devices rolling out both: the same
    trajectories, metrics and final params (bitwise); also with the rollouts one step ahead
    (grpo.max_staleness 1: each process's engine takes every version's weights from the
    main thread's handoff while the update runs)."""
    port = free_port()
    train = ["-m", "muajax.train", *TINY_GRPO, f"grpo.max_staleness={max_staleness}"]
    procs = [launch([*train, f"run.out_dir={tmp_path / 'one'}"], devices=2)]
    procs += [launch([*train, f"run.out_dir={tmp_path / 'two'}"], devices=1, process_id=i, port=port)
              for i in range(2)]
    (_, one_out, _), (_, two_out, _), (_, other_out, _) = finish(procs)
    one, two = json.loads(one_out.strip().splitlines()[-1]), json.loads(two_out.strip().splitlines()[-1])
    assert "params_sha256" not in other_out  # only process 0 reports
    assert two["params_sha256"] == one["params_sha256"]
    assert two["heldout_success_grpo"] == one["heldout_success_grpo"] and two["partial_grpo"] == one["partial_grpo"]

    def metrics(name):
        lines = (tmp_path / name / "embedded-cpu" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    a, b = metrics("one"), metrics("two")
    assert [m["step"] for m in b] == [1, 2]  # one writer (process 0), one line per step
    for x, y in zip(a, b):
        # the logged rollout metrics are those of both processes' rollouts together
        for key in ("reward", "partial", "sequence_tokens", "response_tokens", "turns", "num_tokens", "loss",
                    "grad_norm", "all_correct_ratio", "data/position",
                    *(("async/staleness_max", "async/rollout_version") if max_staleness else ())):
            assert y[key] == x[key], key
        assert {k for k in y if k.startswith("termination/")} == {k for k in x if k.startswith("termination/")}
    for name in ("one", "two"):
        assert (tmp_path / name / "embedded-cpu" / "checkpoints" / "grpo" / "2").is_dir()
