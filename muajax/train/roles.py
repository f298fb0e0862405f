"""The rollout engine's role: built in one place for training, evaluation and serving.

The engine is a `muajax.train.rollout_layout.RolloutEngine`: it decodes from its own copy of
the params (the compute dtype, the rollout mesh) or, when that would change nothing, reads
the live params. With several processes each decodes its own conversations on its own
devices, over a replica (see `muajax.train.distributed` for why).
"""
from __future__ import annotations

from muajax import parallel
from muajax.agent.chat import im_end_id
from muajax.agent.rollout_config import RolloutConfig
from muajax.engine.engine import Engine
from muajax.train import rollout_layout
from muajax.train.rollout_layout import RolloutEngine

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
    local = rollout_layout.rollout_mesh(r.mesh, mesh, model_cfg)
    options = dict(kv_cache_tokens=rollout_layout.pool_tokens(r, model_cfg, local), page_size=r.page_size,
                   attention=r.attention,
                   batch_rows=None if call_rows is None else -(-call_rows // parallel.batch_divisor(local)))
    return RolloutEngine(params, model_cfg, mesh=local, train_mesh=mesh, num_slots=num_slots, max_len=max_len,
                         stop_ids=(im_end_id(tokenizer),), decode_chunk=decode_chunk,
                         min_batch_bucket=min_batch_bucket, **{**options, **kwargs})
