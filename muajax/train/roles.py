"""The rollout engine's role: built in one place for training, evaluation and serving.

With one process the engine runs on the run's mesh and reads the live params (no copy).
With several, each process decodes its own conversations on its own devices
(`muajax.train.distributed.ProcessLocalEngine`): see that module for why.
"""
from __future__ import annotations

from muajax.agent.chat import im_end_id
from muajax.engine.engine import Engine
from muajax.train.distributed import ProcessLocalEngine, multiprocess

DECODE_CHUNK = 16  # decode steps per device call: host work between calls is amortised over them


def make_rollout_engine(params, model_cfg, mesh, tokenizer, *, num_slots: int, max_len: int,
                        decode_chunk: int = DECODE_CHUNK, min_batch_bucket: int = 1, **kwargs) -> Engine:
    """The engine that rolls out (or serves) a policy; it stops at the tokenizer's `<|im_end|>`.

    `params` may be None when they are assigned later (`engine.params = ...`), which is
    how a trainer hands each step's params to it."""
    cls = ProcessLocalEngine if multiprocess() else Engine
    return cls(params, model_cfg, mesh=mesh, num_slots=num_slots, max_len=max_len, stop_ids=(im_end_id(tokenizer),),
               decode_chunk=decode_chunk, min_batch_bucket=min_batch_bucket, **kwargs)
