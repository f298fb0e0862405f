"""Model FLOPs of a Qwen3 forward: what MFU and roofline estimates count."""
from __future__ import annotations

from muajax.models.qwen3 import Qwen3Config


def matmul_params(cfg: Qwen3Config) -> int:
    """Weights used in matmuls: everything but the embedding lookup (a tied head is a matmul)."""
    return cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def forward_flops(cfg: Qwen3Config, batch: int, seq: int, keys: int | None = None) -> float:
    """One forward: 2 FLOPs per matmul weight per token, plus the einsum attention's
    QK^T and PV over every (query, key) pair (the model computes the full square)."""
    keys = seq if keys is None else keys
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * keys
    return batch * (2 * matmul_params(cfg) * seq + attn)
