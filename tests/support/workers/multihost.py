"""One process of `tests/train/test_multihost.py::test_distributed_helpers_across_two_processes`.

Run as `python -m tests.support.workers.multihost CHECKPOINT_DIR` with MUAJAX_COORDINATOR,
MUAJAX_NUM_PROCESSES=2 and MUAJAX_PROCESS_ID set and two CPU devices per process; prints
one line `RESULT {json}` whose checks the test asserts. The training mesh is fsdp over all
four devices, so params and state are split within and across processes (the end-to-end
test keeps them replicated, see there).
"""
from __future__ import annotations

import json
import sys

from muajax.runtime.distributed import maybe_initialize_distributed

maybe_initialize_distributed()

import jax  # noqa: E402 - the distributed system must start before any jax backend use
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from muajax import parallel  # noqa: E402

from muajax.runtime import distributed, host_batch  # noqa: E402
from muajax.runtime.checkpoint import Checkpointer  # noqa: E402
from muajax.engine.engine import Engine, SamplingParams  # noqa: E402
from muajax.runtime.build import initial_params  # noqa: E402
from muajax.runtime.rollout_engine import RolloutEngine  # noqa: E402
from muajax.agent.trajectory import Trajectory, rollout_metrics  # noqa: E402
from tests.support.tiny_models import ONE_LAYER_CONFIG  # noqa: E402

CFG = ONE_LAYER_CONFIG.replace(max_position_embeddings=128)


def gathered(tree):
    """The full value of every leaf of a global tree, on every process."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def same_tree(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_engine(mesh) -> dict:
    params = initial_params(CFG, None, mesh, seed=3)
    split = [x for x in jax.tree.leaves(params) if not x.is_fully_replicated]
    engine = RolloutEngine(params, CFG, mesh=distributed.local_mesh(mesh), train_mesh=mesh, num_slots=2, max_len=48,
                           stop_ids=(1,), decode_chunk=8)
    first_ok = same_tree(gathered(params), engine.params)
    # a new update reaches the engine through the same setter the trainer uses
    params = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.5 + 0.01, p))(params)
    engine.params = params
    want = gathered(params)
    local_ok = all(x.is_fully_addressable for x in jax.tree.leaves(engine.params))
    prompt = [5, 9, 11, 3, 7, 21]
    slot = engine.open(prompt, seed=123)
    got = engine.generate([slot], SamplingParams(temperature=1.0, max_new_tokens=10))[slot]
    # the same generation from a plain single-device engine over the gathered params
    plain = Engine(jax.tree.map(jnp.asarray, want), CFG, num_slots=2, max_len=48, stop_ids=(1,), decode_chunk=8)
    ref_slot = plain.open(prompt, seed=123)
    ref = plain.generate([ref_slot], SamplingParams(temperature=1.0, max_new_tokens=10))[ref_slot]
    return {"params_split_across_processes": len(split) > 0, "replica_equals_global": first_ok,
            "replica_follows_update": same_tree(want, engine.params), "replica_is_local": local_ok,
            "engine_tokens": got.tokens, "plain_tokens": ref.tokens,
            "logprob_max_diff": float(np.max(np.abs(np.subtract(got.logprobs, ref.logprobs))))}


def local_rows(p: int, rows: int) -> dict:
    return {"tokens": np.arange(rows * 4, dtype=np.int32).reshape(rows, 4) + 100 * p,
            "loss_mask": np.ones((rows, 4), np.int32), "rewards": np.full((rows,), p + 1, np.float32),
            "group_ids": np.arange(rows, dtype=np.int32) // 2 + 10 * p}


def check_batch(mesh, divisor: int, rows: int) -> dict:
    p = jax.process_index()
    batch = host_batch.global_batch(local_rows(p, rows), mesh, divisor, pad_id=0)
    fetch = jax.jit(lambda b: b, out_shardings=parallel.replicated(mesh))
    full = {k: np.asarray(v) for k, v in fetch(batch).items()}
    # the SFT route: a batch every process built identically
    shared = np.arange(16, dtype=np.int32).reshape(8, 2)
    placed = host_batch.same_on_every_process({"tokens": shared}, mesh)["tokens"]
    return {"shape": list(full["tokens"].shape), "first_column": full["tokens"][:, 0].tolist(),
            "group_ids": full["group_ids"].tolist(), "mask_rows": full["loss_mask"].sum(1).tolist(),
            "sharding_ok": all(v.sharding.spec == parallel.batch_sharding(mesh, v.ndim).spec for v in batch.values()),
            "shared_ok": (np.array_equal(np.asarray(fetch({"t": placed})["t"]), shared)
                          and placed.sharding == parallel.batch_sharding(mesh, 2))}


def fake_trajectory(i: int) -> Trajectory:
    n = 20 + i
    return Trajectory(task_id=f"t{i // 2}", group_id=i // 2, rollout_index=i % 2, seed=i, tokens=list(range(n)),
                      loss_mask=[1] * (i + 1) + [0] * (n - i - 1), logprobs=[0.0] * n, prompt_len=3,
                      messages=[{"role": "user", "content": "x" * 50}], termination="max_turns" if i % 3 else "context",
                      reward=float(i % 2), partial=i / 10, turns=i, assistant_turns=i + 1,
                      details={"writes_confirmed": [bool(i % 2)]} if i % 4 else {}, user_latency_s=[0.1 * i])


def check_exchange() -> dict:
    p = jax.process_index()
    everyone = [fake_trajectory(i) for i in range(8)]
    mine = everyone[4 * p:4 * p + 4]
    merged = distributed.gather_for_metrics(mine)

    def only_on_main():
        if jax.process_index() != 0:
            raise AssertionError("called off the main process")
        return {"from": jax.process_index(), "rows": list(range(5))}

    def failing():
        raise ValueError("bad SFT record")

    try:
        distributed.from_main_process(failing)
        failure = "no error"
    except (ValueError, RuntimeError) as e:
        failure = f"{type(e).__name__}: {e}"
    try:
        distributed.task_share(list(range(3)))
        share_error = "no error"
    except ValueError as e:
        share_error = str(e)
    return {"metrics_equal": rollout_metrics(merged) == rollout_metrics(everyone),
            "merged_ids": [(t.task_id, t.rollout_index) for t in merged],
            "broadcast": distributed.from_main_process(only_on_main), "failure": failure,
            "share": distributed.task_share(list("abcd")), "share_error": share_error}


def check_checkpoint(mesh, directory: str) -> dict:
    params = initial_params(CFG, None, mesh, seed=5)
    # from numpy: device_put of a *jax* scalar onto a multi-process sharding gives, with jax
    # 0.10.2 on CPU, an array whose shards cannot be listed (orbax then fails to save it)
    state = {"params": params, "count": jax.device_put(np.int32(7), parallel.replicated(mesh))}
    ckpt = Checkpointer(directory, keep=2, every_steps=1)
    ckpt.save(3, state, data_position=12, force=True)
    ckpt.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = Checkpointer(directory, keep=2, every_steps=1).restore_latest(abstract)
    same_layout = all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored.state)))
    return {"steps": [restored.step], "position": restored.data_position, "restored_equal":
            same_tree(gathered(state), gathered(restored.state)), "same_layout": same_layout}


def main() -> None:
    directory = sys.argv[1]
    mesh = parallel.make_mesh(1, -1, 1)
    out = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count()}
    out["engine"] = check_engine(mesh)
    out["batch"] = check_batch(mesh, divisor=4, rows=4)
    out["batch_padded"] = check_batch(mesh, divisor=4, rows=3)
    # tensor parallelism across the two processes: the batch is not split between them
    out["batch_replicated"] = check_batch(parallel.make_mesh(1, 1, -1), divisor=1, rows=4)
    out["exchange"] = check_exchange()
    out["checkpoint"] = check_checkpoint(mesh, directory)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
