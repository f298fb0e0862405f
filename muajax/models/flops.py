"""Model FLOPs of a Qwen3 forward and of the train steps, counted from the architecture.

These are the *useful* FLOPs that MFU is measured in (2 per multiply-add of every matmul
weight per token, plus attention's QK^T and PV), not what the compiled program executes:
remat's recomputation and the einsum attention's masked upper triangle are excluded. With
`causal=True` a query attends to itself and the keys before it, (T+1)/2 keys on average;
`causal=False` counts every (query, key) pair, which is what the einsum attention computes.
A packed row (SFT) is counted as one causal sequence, a little more attention than its
segments need.
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


def head_params(cfg: Qwen3Config) -> int:
    """Weights of the LM head matmul (the embedding table itself when tied)."""
    return cfg.vocab_size * cfg.hidden_size


def _layer_flops(cfg: Qwen3Config, batch: int, seq: int, keys: int | None, causal: bool) -> float:
    """The decoder layers' FLOPs (matmuls and attention) over `batch` rows of `seq` new tokens."""
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attention_pairs(seq, keys, causal)
    return batch * (2.0 * (matmul_params(cfg) - head_params(cfg)) * seq + attn)


def forward_flops(cfg: Qwen3Config, batch: int, seq: int, keys: int | None = None, *, causal: bool = True,
                  shared_prefix: int = 0, prefix_runs: int = 1) -> float:
    """One forward of `batch` rows of `seq` new tokens (over `keys` positions in all).

    `shared_prefix` = P > 0: every row begins with the same P tokens, which run through the
    layers once per call for one row (`prefix_runs` calls, e.g. one per microbatch) before
    the rows extend them (`muajax.models.qwen3.forward_shared_prefix`); the LM head still
    runs on every position."""
    if not shared_prefix:
        return _layer_flops(cfg, batch, seq, keys, causal) + 2.0 * head_params(cfg) * batch * seq
    if keys is not None or not 0 < shared_prefix < seq:
        raise ValueError(f"a shared prefix needs 0 < shared_prefix < seq and no cached keys, got shared_prefix="
                         f"{shared_prefix}, seq={seq}, keys={keys}")
    prefix = prefix_runs * _layer_flops(cfg, 1, shared_prefix, None, causal)
    rest = _layer_flops(cfg, batch, seq - shared_prefix, seq, causal)
    return prefix + rest + 2.0 * head_params(cfg) * batch * seq


def train_step_flops(cfg: Qwen3Config, batch: int, seq: int, *, reference: bool = False, causal: bool = True,
                     shared_prefix: int = 0, microbatches: int = 1) -> float:
    """A train step's model FLOPs: forward + backward (twice the forward) of the policy, plus
    the reference model's forward when GRPO keeps one (kl_coef > 0). With `shared_prefix`,
    the prefix runs once per microbatch in each of them."""
    forward = forward_flops(cfg, batch, seq, causal=causal, shared_prefix=shared_prefix, prefix_runs=microbatches)
    return forward * (4.0 if reference else 3.0)
