"""Model FLOPs of a Qwen3 forward and of the train steps, counted from the architecture.

These are the *useful* FLOPs that MFU is measured in (2 per multiply-add of every matmul
weight per token, plus attention's QK^T and PV), not what the compiled program executes:
remat's recomputation and the einsum attention's masked upper triangle are excluded. With
`causal=True` a query attends to itself and the keys before it, (T+1)/2 keys on average;
`causal=False` counts every (query, key) pair, which is what the einsum attention computes.
"""
from __future__ import annotations

from muajax.models.qwen3 import Qwen3Config


def matmul_params(cfg: Qwen3Config) -> int:
    """Weights used in matmuls: all but the norms and the embedding lookup (a tied head is a matmul)."""
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.num_params() - norms - lookup


def attention_pairs(seq: int, keys: int | None = None, causal: bool = True) -> float:
    """(query, key) pairs one row's attention scores: seq queries over `keys` keys (default
    seq). Causal with keys > seq: the queries are the last `seq` of `keys` positions."""
    keys = seq if keys is None else keys
    if not causal:
        return float(seq) * keys
    before = keys - seq  # cached keys every query sees
    return float(seq) * before + seq * (seq + 1) / 2


def forward_flops(cfg: Qwen3Config, batch: int, seq: int, keys: int | None = None, *, causal: bool = True) -> float:
    """One forward of `batch` rows of `seq` new tokens (over `keys` positions in all)."""
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attention_pairs(seq, keys, causal)
    return batch * (2.0 * matmul_params(cfg) * seq + attn)


def train_step_flops(cfg: Qwen3Config, batch: int, seq: int, *, reference: bool = False,
                     causal: bool = True) -> float:
    """A train step's model FLOPs: forward + backward (twice the forward) of the policy, plus
    the reference model's forward when GRPO keeps one (kl_coef > 0)."""
    forward = forward_flops(cfg, batch, seq, causal=causal)
    return forward * (4.0 if reference else 3.0)
