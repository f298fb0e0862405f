"""What one generation is asked for (`SamplingParams`) and what it gives back (`Generation`).

Plain values shared by the engine and its callers (rollouts, the server, benches); the
engine re-exports them (`muajax.engine.engine.SamplingParams`).
"""
from __future__ import annotations

import dataclasses

FINISH_REASONS = ("running", "stop", "length", "context")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"top_k must be >= 0 and max_new_tokens >= 1, got {self.top_k}, {self.max_new_tokens}")


@dataclasses.dataclass
class Generation:
    """A finished generation: sampled ids, their logprobs, and why it stopped
    ('stop' = a stop token, 'length' = max_new_tokens, 'context' = max_len reached)."""

    slot: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
