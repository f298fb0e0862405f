"""Multi-process runs (TPU pods, multi-node GPUs): each process rolls out its share of a step's
tasks, and the shares form one global batch for the sharded update.

Where rollouts run, and why
---------------------------
The training mesh spans every process's devices, and a program on it is one SPMD program
that every process must launch in the same order with the same shapes. The Engine decides
on the host, chunk by chunk, which slots to extend or decode and at which bucket sizes,
from the state of *its* conversations — and each process's conversations wait on their own
simulated users and tools, with their own latencies. One engine on the global mesh would
need every process to agree on every such decision (an all-gather of scheduler state
before each chunk), and a slow user on one host would stall every host.

So each process runs its own Engine on a mesh of its *local* devices over a replica of the
params (`local_replicas`, used by `muajax.runtime.rollout_engine.RolloutEngine`): when the
trainer hands the engine new params, they are resharded on device from the training layout
to "the local layout, on every process" (one all-gather across hosts per step, no host
copy), and the processes then decode independently, meeting again only when the batch is
assembled. Each sizes its slots and pool from its own share of the conversations. The price: a params-sized
transfer per step and a full copy of the params on each host (sharded over its devices),
so the model must fit one host's memory next to the KV cache.

Who rolls out what
------------------
Process p rolls out tasks [p*k, (p+1)*k) of the step (k = tasks_per_step / processes) with
their global task indices, so rollout seeds, group ids and hence the trajectories are the
ones a one-process run would produce; `muajax.runtime.host_batch` joins the processes'
rows into the step's global batch. The held-out evaluation is split alike
(`evaluation_share`: blocks that may differ by one task) and its trajectories gathered to
every process (`gather_for_report`): every host computes the same report, process 0 writes it.

Everything here is a no-op (or a plain call) with one process, so single-process runs
take exactly the code path they always took. Every function that talks to other processes
must be called by all processes in the same order.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding

from muajax import parallel
from muajax.agent.trajectory import Trajectory

T = TypeVar("T")


def maybe_initialize_distributed() -> None:
    """Join a multi-process run when the launcher says so (see tpu/README.md, gpu/README.md):

    - MUAJAX_COORDINATOR=host:port, MUAJAX_NUM_PROCESSES, MUAJAX_PROCESS_ID: any cluster;
      MUAJAX_LOCAL_DEVICE_IDS=0,1,... restricts a process to those accelerators (one
      process per GPU);
    - MUAJAX_DISTRIBUTED=auto: jax detects the cluster itself (Cloud TPU VM slices through
      the metadata server, SLURM, Open MPI); GKE's TPU variables do the same.
    On TPU pods this is optional for the computation but orbax's multi-host checkpointing
    needs the coordination service it starts.
    """
    if os.environ.get("MUAJAX_COORDINATOR"):
        missing = [v for v in ("MUAJAX_NUM_PROCESSES", "MUAJAX_PROCESS_ID") if not os.environ.get(v)]
        if missing:
            raise SystemExit(f"MUAJAX_COORDINATOR is set but {' and '.join(missing)} is not")
        ids = os.environ.get("MUAJAX_LOCAL_DEVICE_IDS")
        jax.distributed.initialize(
            coordinator_address=os.environ["MUAJAX_COORDINATOR"],
            num_processes=int(os.environ["MUAJAX_NUM_PROCESSES"]),
            process_id=int(os.environ["MUAJAX_PROCESS_ID"]),
            local_device_ids=[int(i) for i in ids.split(",")] if ids else None,
            # explicit settings win: under SLURM, detection would otherwise narrow each
            # process to the one GPU numbered by its SLURM_LOCALID
            cluster_detection_method="deactivate",
        )
    elif (os.environ.get("MUAJAX_DISTRIBUTED") == "auto" or os.environ.get("TPU_WORKER_HOSTNAMES")
          or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS")):
        jax.distributed.initialize()


def multiprocess() -> bool:
    return jax.process_count() > 1


# ---------------------------------------------------------------------- who rolls out what


def task_share(tasks: Sequence[T], process_index: int | None = None,
               process_count: int | None = None) -> tuple[int, list[T]]:
    """(global index of this process's first task, its tasks): a contiguous block, the same
    size on every process, in process order."""
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    if len(tasks) % count:
        raise ValueError(f"rollout.tasks_per_step={len(tasks)} must be divisible by the number of processes "
                         f"({count}): every process rolls out an equal share of each step")
    k = len(tasks) // count
    return index * k, list(tasks[index * k:(index + 1) * k])


def evaluation_share(tasks: Sequence[T], process_index: int | None = None,
                     process_count: int | None = None) -> tuple[int, list[T]]:
    """(global index of this process's first held-out task, its tasks) for an evaluation:
    contiguous blocks in process order whose sizes differ by at most one (a held-out set
    need not divide evenly; with fewer tasks than processes some get none). Rolled out at
    their global indices, they give the trajectories a one-process evaluation gives."""
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    start, end = index * len(tasks) // count, (index + 1) * len(tasks) // count
    return start, list(tasks[start:end])


# ---------------------------------------------------------------------- talking to other processes


def allgather_ints(value: int) -> list[int]:
    if not multiprocess():
        return [int(value)]
    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.asarray([value], np.int32))).ravel()]


def _to_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj`, in process order (pickled: only for our own processes' data)."""
    if not multiprocess():
        return [obj]
    data = _to_bytes(obj)
    sizes = allgather_ints(data.size)
    padded = np.zeros(max(sizes), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


def from_main_process(fn: Callable[[], T]) -> T:
    """`fn()` run on process 0 only, its result sent to every process: files that only the
    first host writes or has (the SFT data) are read once. If it raises there, every
    process raises."""
    if not multiprocess():
        return fn()
    main = jax.process_index() == 0
    outcome: tuple[str, Any] = ("ok", None)
    error: BaseException | None = None
    if main:
        try:
            outcome = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - the others must not wait forever for a result
            error, outcome = e, ("error", f"{type(e).__name__}: {e}")
    data = _to_bytes(outcome) if main else np.zeros(0, np.uint8)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([data.size], np.int32)))[0])
    buffer = np.zeros(size, np.uint8)
    buffer[: data.size] = data
    received = pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())
    if error is not None:
        raise error
    kind, value = received
    if kind == "error":
        raise RuntimeError(f"process 0 failed: {value}")
    return value


def gather_for_metrics(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Every process's trajectories, so the logged rollout metrics are those of the whole
    step. The token-level lists are cut to what `rollout_metrics` reads (their length and
    the number of sampled tokens) and the transcripts dropped, to keep the exchange small."""
    if not multiprocess():
        return list(trajectories)
    light = [dataclasses.replace(t, tokens=range(len(t.tokens)), loss_mask=[1] * t.num_sampled, logprobs=[],
                                 messages=[], assistant_texts=[], sampled_spans=[]) for t in trajectories]
    return [t for part in allgather_objects(light) for t in part]


def gather_for_report(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Every process's trajectories, one list per process in process order, for a report
    that every process then computes alike (`muajax.train.trainer.evaluate`): transcripts,
    outcomes and counters kept, the token-level lists cut to their length and the number of
    sampled tokens (what `rollout_record` reads)."""
    if not multiprocess():
        return [list(trajectories)]
    light = [dataclasses.replace(t, tokens=range(len(t.tokens)), loss_mask=[1] * t.num_sampled, logprobs=[],
                                 assistant_texts=[], sampled_spans=[]) for t in trajectories]
    return allgather_objects(light)


# ---------------------------------------------------------------------- rollouts on local devices


def process_devices(process_index: int) -> list:
    """One process's devices in a fixed order that every process can compute."""
    return sorted((d for d in jax.devices() if d.process_index == process_index), key=lambda d: d.id)


def local_mesh(global_mesh: Mesh, devices: list | None = None) -> Mesh:
    """A mesh over this process's devices (or `devices`, one process's): the global tensor
    axis if it fits on one host (decode is latency bound: tensor parallelism helps it), fsdp
    for the rest."""
    devices = process_devices(jax.process_index()) if devices is None else devices
    tensor = math.gcd(global_mesh.shape["tensor"], len(devices))
    sizes = dict.fromkeys(parallel.MESH_AXES, 1) | {"fsdp": len(devices) // tensor, "tensor": tensor}
    grid = np.array(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, parallel.MESH_AXES, axis_types=(AxisType.Auto,) * len(parallel.MESH_AXES))


def local_replicas(params, local_shardings):
    """Each process's own full copy of `params` (a global tree, e.g. the training layout) in
    the layout `local_shardings` (NamedShardings on this process's `local_mesh`). A collective:
    every process must call it at the same point of the run. The params are resharded on
    device to "the local layout, on every process" (one all-gather across hosts, no host
    copy), then this process keeps its own replica."""
    local = next(iter(jax.tree.leaves(local_shardings))).mesh
    grid = np.stack([np.array(process_devices(p), dtype=object).reshape(local.devices.shape)
                     for p in range(jax.process_count())])
    stacked = Mesh(grid, ("processes",) + parallel.MESH_AXES, axis_types=(AxisType.Auto,) * (1 + len(parallel.MESH_AXES)))
    # the local layout with the "processes" axis unnamed in every spec: one replica per process
    replicas = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(stacked, s.spec), local_shardings))
    return jax.tree.map(
        lambda x, s: jax.make_array_from_single_device_arrays(x.shape, s, [sh.data for sh in x.addressable_shards]),
        replicas, local_shardings)
