"""The programs a run compiles, built by the code the trainer and the engine use, from
abstract sharded arguments (nothing is allocated).

- `grpo_program`: `muajax.rl.grpo.make_grpo_step` called as `muajax.train.grpo.run_grpo`
  calls it (its GRPOConfig, the rollout temperature, the
  microbatches the config's microbatch_size gives), on the rows the trainer pads a batch
  to, with the reference model as the trainer keeps it: a copy of the params in their own
  dtype (float32 master weights when param_dtype is float32).
- `sft_program`: `muajax.rl.sft.make_sft_step` as `muajax.train.sft.run_sft` calls it.
- `engine_programs`: `muajax.engine.programs.abstract_programs`, the engine's own decode and
  extend programs as the trainer builds them (packed extends in tiles of 16 tokens at the
  most rows a call can have, or with `rollout.call_layout: fixed_rows` one program per
  width; token tiles with `rollout.deterministic`; attention resolved as the engine
  resolves "auto": the Pallas paged attention on a TPU mesh, "paged" in place on a GPU,
  also where a GPU plan is compiled by XLA:CPU) on the mesh the trainer's
  engine uses (`muajax.runtime.rollout_engine.engine_mesh`: one host's devices), reading the
  params as that engine does (its own compute-dtype copy in its own layout, or the train
  state's in place), with this host's share of the page pool as its state.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from muajax import parallel
from muajax.engine import batching, kv_cache
from muajax.engine.programs import abstract_programs, build_spec
from muajax.models.qwen3 import Qwen3Config
from muajax.planning import topology
from muajax.planning.compile import AbstractProgram
from muajax.rl.grpo import GRPOConfig
from muajax.rl.optim import optimizer_from_config
from muajax.rl.sft import make_sft_step
from muajax.rl.step import model_abstract_params
from muajax.agent.rollout_config import RolloutMeshConfig
from muajax.models.sharding import param_shardings
from muajax.runtime import rollout_engine
from muajax.runtime.grpo_layout import GRPOLayout, abstract_reference, rows_attention, shared_prefix_tokens
from muajax.runtime.host_batch import microbatch_count

DECODE_CHUNK = rollout_engine.DECODE_CHUNK
EXTEND_WIDTHS = (32, 128, 512, 2048)  # the Engine's default extend_widths
MAX_EXTEND_TOKENS = 8192  # the Engine's default


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def padded_batch(batch: int, microbatches: int, mesh: Mesh) -> int:
    """Rows after the trainer's padding: a multiple of data*fsdp*microbatches
    (`muajax.runtime.host_batch.pad_to_multiple` with `batch_divisor`)."""
    divisor = parallel.batch_divisor(mesh) * microbatches
    return -(-batch // divisor) * divisor


def _batch(mesh: Mesh, fields: dict) -> dict:
    return {n: jax.ShapeDtypeStruct(s, d, sharding=parallel.batch_sharding(mesh, len(s))) for n, (s, d) in fields.items()}


def state_parts(state) -> dict[str, int]:
    return {"params": shard_bytes(state.params), "optimizer state": shard_bytes(state.opt_state),
            "step counters": shard_bytes((state.step, state.skipped))}


def grpo_program(cfg: Qwen3Config, mesh: Mesh, grpo: GRPOConfig, layout: GRPOLayout):
    """(program, abstract train state) of one GRPO update as the trainer runs it: the step
    and its batch (one update's rows at the longest length bucket: every padded row, or the
    most packed rows the layout allows) from the same `GRPOLayout` the trainer builds them
    from, and the KL reference as it keeps it."""
    step = layout.make_step(cfg, mesh, grpo, total_steps=1000)
    state = step.abstract_state(model_abstract_params(cfg))
    data = layout.abstract_batch(mesh)
    resident = state_parts(state)
    args = (state, data)
    if grpo.uses_reference:
        reference = abstract_reference(state.params, step.param_shardings, grpo)
        resident["reference"] = shard_bytes(reference)
        args = (state, data, reference)
    attention = rows_attention(cfg, length=layout.longest, platform=mesh.devices.flat[0].platform,
                               shared_prefix=layout.shared_prefix)
    return AbstractProgram("grpo step", lambda: step.lower(*args), resident, input_bytes=shard_bytes(data),
                           attention=attention), state


def old_logprobs_program(cfg: Qwen3Config, mesh: Mesh, grpo: GRPOConfig, layout: GRPOLayout, state):
    """The forward that recomputes a mini-batch's old logprobs before a step's first update
    (`grpo.recompute_old_logprobs` with mini-batches), or None where the trainer runs none."""
    fn = layout.make_old_logprobs_fn(cfg, mesh, grpo)
    if fn is None:
        return None
    data = layout.abstract_batch(mesh)
    attention = rows_attention(cfg, length=layout.longest, platform=mesh.devices.flat[0].platform,
                               shared_prefix=layout.shared_prefix)
    return AbstractProgram("old logprobs", lambda: fn.lower(state.params, data), state_parts(state),
                           input_bytes=shard_bytes(data), attention=attention)


def sft_program(cfg: Qwen3Config, mesh: Mesh, sft, *, seq: int, prompt_prefix: int = 0):
    """(program, abstract train state, rows) of one SFT update as `muajax.train.sft.run_sft`
    runs it (`sft`: the config's SFTConfig). Without the data its rows are an upper bound:
    one conversation a row, packed (with segment ids, no shared prefix) unless
    `sft.packing` is off, when the rows share the `prompt_prefix` as the trainer's rule has it."""
    packed = sft.packing != "off"
    prefix = 0 if packed else shared_prefix_tokens(prompt_prefix, cfg, length=seq,
                                                    platform=mesh.devices.flat[0].platform)
    k = microbatch_count(sft.batch_size, sft.microbatch_size, mesh, "sft.microbatch_size")
    step = make_sft_step(cfg, optimizer_from_config(sft, total_steps=1000), mesh, microbatches=k,
                         shared_prefix=prefix, logits_chunk=sft.logits_chunk)
    state = step.abstract_state(model_abstract_params(cfg))
    rows = padded_batch(sft.batch_size, k, mesh)
    fields = {"tokens": ((rows, seq), jnp.int32), "loss_mask": ((rows, seq), jnp.int32)}
    if packed:
        fields["segment_ids"] = ((rows, seq), jnp.int32)
    if sft.context_weight:  # sft_batch adds the context weights when the config asks for them
        fields["context_mask"] = ((rows, seq), jnp.float32)
    data = _batch(mesh, fields)
    platform = mesh.devices.flat[0].platform
    rows_info = {"batch": sft.batch_size, "microbatches": k, "padded": rows, "length": seq, "packed": packed,
                 "shared_prefix": prefix,
                 "attention": rows_attention(cfg, length=seq, platform=platform, shared_prefix=prefix)}
    return AbstractProgram("sft step", lambda: step.lower(state, data), state_parts(state),
                           input_bytes=shard_bytes(data), attention=rows_info["attention"]), state, rows_info


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The engine the trainer builds (`RunContext.engine` -> `make_rollout_engine`)."""

    num_slots: int                      # this host's conversations at once
    max_len: int
    kv_cache_tokens: int | None = None  # the run's (rollout.kv_cache_tokens); None: max(num_slots, shards) * max_len
    page_size: int | None = None
    decode_chunk: int = DECODE_CHUNK
    widths: tuple[int, ...] = EXTEND_WIDTHS
    max_extend_tokens: int = MAX_EXTEND_TOKENS
    attention: str = "auto"
    mesh: RolloutMeshConfig | None = None  # rollout.mesh; None: the trainer's default for the platform
    eval_slots: int = 0                 # the evaluation's conversations, all hosts' (trials x held-out tasks)
    eval_trials: int = 1                # its trials per task: a host holds trials x its block of the tasks
    # the call layout (`RunContext.engine`): token tiles (rollout.deterministic with packed
    # calls), or fixed rows (rollout.call_layout fixed_rows: `call_rows` rows, all shards, in
    # every call); neither: packed calls with whole-call dots
    deterministic: bool = True          # the trainer's default (rollout.deterministic)
    call_rows: int | None = None
    extend_tile: int | None = None      # rollout.extend_tile / decode_tile; None: the engine's for the platform
    decode_tile: int | None = None
    platform: str | None = None         # where the engine runs, when not where the plan compiles ("gpu": h100:8)

    def host_slots(self, hosts: int) -> int:
        """One host's slots (`RunContext.engine_slots`): its share of a step's conversations,
        or of the evaluation's (trials x its block of the held-out tasks) when more."""
        tasks = self.eval_slots // max(self.eval_trials, 1)
        return max(-(-self.num_slots // hosts), self.eval_trials * -(-tasks // hosts))

    def tiles(self, platform: str, slots: int, shards: int) -> tuple[int, int]:
        """(extend_tile, decode_tile) as the engine resolves them (`batching.default_tiles`)."""
        extend, decode = batching.default_tiles(self.platform or platform, slots, shards)
        return self.extend_tile or extend, self.decode_tile or decode

    @property
    def call_layout(self) -> str:
        return "fixed_rows" if self.call_rows else "packed"

    def resolved_attention(self) -> str:
        """"auto" as the engine on `platform` resolves it (`paged_attention.resolve_attention`):
        a GPU reads the pages in place; elsewhere the mesh's platform decides (build_spec)."""
        return "paged" if self.attention == "auto" and self.platform == "gpu" else self.attention


def host_devices(devices: list) -> tuple[list, int]:
    """(the first host's devices, the number of hosts): each host runs its own engine."""
    hosts = sorted({d.process_index for d in devices})
    return sorted((d for d in devices if d.process_index == hosts[0]), key=lambda d: d.id), len(hosts)


def engine_copy(params, cfg: Qwen3Config, mesh: Mesh):
    """The abstract params as `RolloutEngine` copies them: in its copy dtype, on `mesh`."""
    dtype = rollout_engine.copy_dtype(cfg)

    def leaf(path, x, sharding):
        keep = dtype is None or rollout_engine.stays_fp32(path, cfg)
        return jax.ShapeDtypeStruct(x.shape, x.dtype if keep else jnp.dtype(dtype), sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, params, param_shardings(cfg, mesh))


def engine_cast_bytes(params, cfg: Qwen3Config) -> int:
    """Bytes per device of the params cast to the engine's copy dtype in their own (train)
    layout, the sync's first half (0: the copy keeps the params' dtype)."""
    dtype = rollout_engine.copy_dtype(cfg)
    if dtype is None:
        return 0

    def leaf(path, x):
        keep = rollout_engine.stays_fp32(path, cfg)
        return jax.ShapeDtypeStruct(x.shape, x.dtype if keep else jnp.dtype(dtype), sharding=x.sharding)

    return shard_bytes(jax.tree_util.tree_map_with_path(leaf, params))


def engine_programs(cfg: Qwen3Config, mesh: Mesh, params, engine: EngineSettings) -> tuple[list[AbstractProgram],
                                                                                            dict[str, int], int]:
    """The engine's decode and extend programs as AbstractPrograms, the bytes per device of
    its resident state (its page pool), and of its own copy of the params (0: it reads the
    train state's `params` in place). A packed extend is planned at its largest call (every
    row of `max_extend_tokens`), the decode at every slot: the memory of the worst call."""
    devices, hosts = host_devices(list(mesh.devices.flat))
    devices = topology.one_host_devices(devices)
    local = rollout_engine.engine_mesh(engine.mesh, mesh, cfg, devices=devices, multiprocess=hosts > 1)
    slots = engine.host_slots(hosts)  # RunContext.engine_slots
    tokens = None if engine.kv_cache_tokens is None else -(-engine.kv_cache_tokens // hosts)
    attention = engine.resolved_attention()
    tiled = engine.deterministic and not engine.call_rows
    extend_tile, decode_tile = engine.tiles(local.devices.flat[0].platform, slots, parallel.batch_divisor(local))
    spec = build_spec(cfg, local, num_slots=slots, max_len=engine.max_len, kv_cache_tokens=tokens,
                      page_size=engine.page_size, decode_chunk=engine.decode_chunk, attention=attention,
                      tiled=tiled, decode_tile=decode_tile)
    pool = shard_bytes(kv_cache.abstract_pool(spec.pool))
    layout = "x".join(str(n) for n in local.devices.shape)
    per_host = " per host" if hosts > 1 else ""
    state = {f"KV pool ({spec.pool.tokens} tokens{per_host}, pages of {spec.pool.page_size}, {spec.attention}, "
             f"{engine.call_layout}{', token tiles' if tiled else ''}, mesh {layout})": pool}
    copy_bytes = 0
    if rollout_engine.copies_params(cfg, local, mesh, hosts > 1):
        params = engine_copy(params, cfg, local)
        copy_bytes = shard_bytes(params)
    calls = abstract_programs(cfg, local, kv_cache_tokens=spec.pool.tokens, page_size=spec.pool.page_size,
                              max_seqs=slots, max_len=engine.max_len, widths=engine.widths,
                              decode_chunk=engine.decode_chunk, max_extend_tokens=engine.max_extend_tokens,
                              attention=attention, params=params,
                              extend_tile=None if engine.call_rows else extend_tile, deterministic=tiled,
                              decode_tile=decode_tile)
    which = "its own copy" if copy_bytes else "the train state's"
    resident = {f"params ({which})": shard_bytes(params), **state}
    # the decode's while_loop runs up to decode_chunk steps: its trip count is not in the HLO
    programs = [AbstractProgram(f"engine {call.name}", call.lower, resident,
                                engine.decode_chunk if call.name == "decode" else 1,
                                shard_bytes(call.args) - sum(resident.values()), attention=spec.attention)
                for call in calls]
    return programs, state, copy_bytes
