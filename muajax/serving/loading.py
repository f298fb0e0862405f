"""A chat service for a saved policy: the checkpoint loaded, its engine built and, if asked,
every program compiled before the first request (`python -m muajax.serve`)."""
from __future__ import annotations

import dataclasses
import os
import time

from muajax.agent.rollout_config import RolloutConfig
from muajax.serving.app import ChatService
from muajax.serving.scheduler import warmup as compile_programs
from muajax.runtime.policy import Policy, load_policy, make_engine


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    checkpoint: str  # a muajax run/checkpoint directory, or a Hugging Face directory
    stage: str | None = None
    step: int | None = None
    dtype: str | None = None
    slots: int = 8  # requests decoded side by side
    max_len: int = 8192  # context per request: prompt + completion tokens
    max_tokens: int = 1024  # completion tokens when a request sets none
    max_queue: int = 256  # requests waiting for a slot before 503s
    decode_chunk: int = 16  # decode steps per engine step
    model_name: str | None = None  # default: the checkpoint directory's name
    api_key_env: str | None = None  # NAME of the env var holding the key clients must send
    warmup: bool = False  # compile every batch/width program before serving
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    max_json_depth: int = 128  # deeper JSON (tool-call arguments included) gets 400


def build_service(opts: ServeOptions, policy: Policy | None = None) -> tuple[Policy, ChatService]:
    """The service for `opts` (`policy`: already loaded from opts.checkpoint, else loaded here)."""
    if policy is None:
        policy = load_policy(opts.checkpoint, stage=opts.stage, step=opts.step, dtype=opts.dtype)
    max_len = min(opts.max_len, policy.model_cfg.max_position_embeddings)
    # serving wants throughput, not bits that ignore the batch: each dot over the whole call
    engine = make_engine(policy, num_slots=opts.slots, max_len=max_len, decode_chunk=opts.decode_chunk,
                         rollout=RolloutConfig.for_engine(max_len, deterministic=False))
    if opts.warmup:
        start = time.perf_counter()
        runs = compile_programs(engine)
        print(f"warm-up: {runs} programs compiled in {time.perf_counter() - start:.1f}s", flush=True)
    name = opts.model_name or os.path.basename(os.path.normpath(opts.checkpoint))
    api_key = os.environ.get(opts.api_key_env) if opts.api_key_env else None
    service = ChatService(engine, policy.tokenizer, name, vocab_size=policy.model_cfg.vocab_size,
                          default_max_tokens=opts.max_tokens, max_queue=opts.max_queue, api_key=api_key,
                          max_body_bytes=opts.max_body_bytes, max_json_depth=opts.max_json_depth)
    return policy, service
