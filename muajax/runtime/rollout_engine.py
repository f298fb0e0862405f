"""The rollout engine: built in one place for training, evaluation and serving
(`make_rollout_engine`), with its own copy of the policy: its dtype, its layout, its pool.

Training keeps float32 master weights in the FSDP layout, in which every decode step would
all-gather every layer. The engine decodes from a copy made once per policy update instead:
- cast to the compute dtype when that is narrower (bfloat16 runs: half the bytes to read per
  step). The model casts every weight to the compute dtype before using it, so the copy
  computes the same numbers as the master; with `model.logits_fp32` the LM head stays
  float32, as the trainer uses it, so the engine's logprobs are the ones it recomputes.
  float32 runs are not cast.
- resharded with `jax.device_put` to the rollout mesh (`rollout.mesh`, over one process's
  devices). Default: tensor parallel over a host's devices on TPU and GPU (decode is latency
  bound, and tensor parallelism reads each weight once per step without gathering it), as
  wide as the kv heads split evenly, data parallel over the rest; the training mesh on CPU.
  With several processes each has its own engine on its own devices and a replica of the
  params (`distributed.local_replicas`): replicated across hosts, each decoding its share.
When neither changes anything (one process, the training mesh, no cast) the engine reads
the live params: no copy. The master weights are never written.

The copy is dropped before each train step (`RolloutEngine.release_params`), and the page
pool with it unless `rollout.keep_kv_pool` (`RunContext.engine_idle`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from muajax import parallel
from muajax.agent.rollout_config import RolloutConfig, RolloutMeshConfig
from muajax.engine.engine import Engine
from muajax.models.qwen3 import Qwen3Config
from muajax.agent.chat import im_end_id
from muajax.models.sharding import param_shardings
from muajax.runtime import distributed


def default_shape(platform: str, devices: int, cfg: Qwen3Config) -> tuple[int, ...]:
    """The default rollout mesh's sizes (MESH_AXES order) on an accelerator host."""
    tensor = max(t for t in range(1, devices + 1) if devices % t == 0 and cfg.num_kv_heads % t == 0)
    return devices // tensor, 1, tensor, 1


def rollout_mesh(config: RolloutMeshConfig | None, train_mesh: Mesh, cfg: Qwen3Config) -> Mesh:
    """The engine's mesh over this process's devices (see the module docstring)."""
    multi = distributed.multiprocess()
    devices = (distributed.process_devices(jax.process_index()) if multi
               else list(train_mesh.devices.flat))
    return engine_mesh(config, train_mesh, cfg, devices=devices, multiprocess=multi)


def engine_mesh(config: RolloutMeshConfig | None, train_mesh: Mesh, cfg: Qwen3Config, *, devices: list,
                multiprocess: bool) -> Mesh:
    """The mesh an engine on `devices` (one process's) uses; the planner calls it with one
    host's devices of a topology it compiles for."""
    platform = devices[0].platform
    if config is None and platform == "cpu":
        return distributed.local_mesh(train_mesh, devices) if multiprocess else train_mesh
    if config is None:
        shape = parallel.resolve_mesh_shape(*default_shape(platform, len(devices), cfg), len(devices))
    else:
        # decode runs no sequence axis: each conversation's rows stay on its devices
        shape = parallel.resolve_mesh_shape(config.data, config.fsdp, config.tensor, 1, len(devices))
    if not multiprocess and shape == tuple(train_mesh.devices.shape):
        return train_mesh
    return parallel.make_mesh(*shape, devices=devices)


def copies_params(cfg: Qwen3Config, mesh: Mesh, train_mesh: Mesh, multiprocess: bool) -> bool:
    """Whether the engine decodes from its own copy rather than the live params."""
    return copy_dtype(cfg) is not None or mesh is not train_mesh or multiprocess


def copy_dtype(cfg: Qwen3Config):
    """The dtype of the engine's copy, or None to keep the params' own."""
    narrower = jnp.dtype(cfg.compute_dtype).itemsize < jnp.dtype(cfg.weight_dtype).itemsize
    return cfg.compute_dtype if narrower else None


def stays_fp32(path, cfg: Qwen3Config) -> bool:
    """Whether the leaf at `path` stays float32 in the engine's copy (the LM head with logits_fp32)."""
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    return cfg.logits_fp32 and getattr(path[0], "key", None) == head


def cast_params(params, cfg: Qwen3Config, dtype):
    """`params` in `dtype` (the LM head kept with `logits_fp32`), in their own layout."""
    def cast(tree):
        return jax.tree_util.tree_map_with_path(lambda p, x: x if stays_fp32(p, cfg) else x.astype(dtype), tree)

    return jax.jit(cast, out_shardings=jax.tree.map(lambda x: x.sharding, params))(params)


class RolloutEngine(Engine):
    """An Engine handed the training params: it decodes from its own copy (module docstring),
    made when params are assigned; assigning the same tree again does nothing. With several
    processes the copy is a collective: every process assigns at the same point of the run."""

    def __init__(self, params, cfg: Qwen3Config, *, mesh: Mesh, train_mesh: Mesh, **kwargs):
        self.version = 0  # the policy version (updates applied) of the params it decodes from
        self.copy_dtype = copy_dtype(cfg)
        self.param_shardings = param_shardings(cfg, mesh)
        self.copies = copies_params(cfg, mesh, train_mesh, distributed.multiprocess())
        self._layout_cfg, self._source, self._params = cfg, None, None
        super().__init__(params, cfg, mesh=mesh, **kwargs)

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params) -> None:
        if params is None or params is self._source:
            return
        self._params = self._copy(params) if self.copies else params
        self._source = params

    def _copy(self, params):
        if self.copy_dtype is not None:
            params = cast_params(params, self._layout_cfg, self.copy_dtype)
        if distributed.multiprocess():
            return distributed.local_replicas(params, self.param_shardings)
        return jax.device_put(params, self.param_shardings)

    def prepare(self, params):
        """The engine's copy of `params` in buffers of its own, for a later `adopt`: the
        weight handoff of asynchronous GRPO, where the update that follows donates the
        params' buffers while the engine still decodes from this copy. A collective with
        several processes (as assigning `params` is)."""
        copy = self._copy(params) if self.copies else params
        return jax.tree.map(lambda c, p: c.copy() if c is p or _same_buffer(c, p) else c, copy, params)

    def adopt(self, version: int, prepared) -> None:
        """Decode from `prepared` (a `prepare`d copy) from the next call on: between calls,
        never inside one. Shared prefixes computed for the old weights are dropped."""
        self._params = self._source = prepared
        self.version = int(version)

    def release_params(self) -> None:
        """Let go of the params (the copy's memory); the next assignment makes a new copy."""
        self._params = self._source = None


def _same_buffer(a, b) -> bool:
    """Whether two arrays share a device buffer (a no-op `device_put` returns an alias)."""
    try:
        return any(x.device == y.device and x.data.unsafe_buffer_pointer() == y.data.unsafe_buffer_pointer()
                   for x, y in zip(a.addressable_shards, b.addressable_shards))
    except Exception:  # noqa: BLE001 - a backend without buffer pointers: copy to be safe
        return True


def free_device_bytes(mesh: Mesh) -> int | None:
    """The least free memory of the mesh's devices, or None where the backend does not say."""
    free = []
    for device in mesh.devices.flat:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)


def pool_tokens(rollout: RolloutConfig, cfg: Qwen3Config, mesh: Mesh) -> int | None:
    """This process's page pool in tokens: its share of `rollout.kv_cache_tokens`, or
    `rollout.kv_cache_share` of each device's free memory; None: the engine's default."""
    if rollout.kv_cache_tokens is not None:
        return -(-rollout.kv_cache_tokens // jax.process_count())
    if rollout.kv_cache_share is None:
        return None
    free = free_device_bytes(mesh)
    if free is None:
        print(f"[rollout] {mesh.devices.flat[0].platform} devices report no free memory: rollout.kv_cache_share "
              "is ignored, the pool holds every slot at max_context", flush=True)
        return None
    tensor = mesh.shape["tensor"]
    split = tensor if cfg.num_kv_heads % tensor == 0 else 1  # the pool's head axis (kv_cache.PoolSpec)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize // split
    return int(rollout.kv_cache_share * free // per_token) * parallel.batch_divisor(mesh)

DECODE_CHUNK = 16  # decode steps per device call: host work between calls is amortised over them


def make_rollout_engine(params, model_cfg, mesh, tokenizer, *, num_slots: int, max_len: int,
                        rollout: RolloutConfig | None = None, call_rows: int | None = None,
                        decode_chunk: int = DECODE_CHUNK, min_batch_bucket: int = 1, **kwargs) -> Engine:
    """The engine that rolls out (or serves) a policy; it stops at the tokenizer's `<|im_end|>`.

    `mesh` is the training (or loading) mesh; `num_slots` the conversations this process
    holds at once; `rollout` the run's engine settings (pool, page size, attention, layout;
    default: `RolloutConfig`'s); `call_rows`: every call has this many rows, split evenly over
    the engine's shards (`Engine(batch_rows=...)`; None: calls bucketed to their rows).
    `params` may be None when they are assigned later (`engine.params = ...`), which is how a
    trainer hands each step's params to it."""
    r = rollout or RolloutConfig.for_engine(max_len)
    local = rollout_mesh(r.mesh, mesh, model_cfg)
    options = dict(kv_cache_tokens=pool_tokens(r, model_cfg, local), page_size=r.page_size,
                   attention=r.attention,
                   batch_rows=None if call_rows is None else -(-call_rows // parallel.batch_divisor(local)),
                   deterministic=r.deterministic and call_rows is None, extend_tile=r.extend_tile,
                   decode_tile=r.decode_tile)
    return RolloutEngine(params, model_cfg, mesh=local, train_mesh=mesh, num_slots=num_slots, max_len=max_len,
                         stop_ids=(im_end_id(tokenizer),), decode_chunk=decode_chunk,
                         min_batch_bucket=min_batch_bucket, **{**options, **kwargs})
