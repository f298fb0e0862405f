"""Model FLOPs of a Qwen3 forward and of the train steps, counted from the architecture.

These are the *useful* FLOPs that MFU is measured in (2 per multiply-add of every matmul
weight per token, plus attention's QK^T and PV), not what the compiled program executes:
remat's recomputation and the einsum attention's masked upper triangle are excluded. With
`causal=True` a query attends to itself and the keys before it, (T+1)/2 keys on average;
`causal=False` counts every (query, key) pair, which is what the einsum attention computes.
A packed row (SFT) is counted as one causal sequence, a little more attention than its
segments need. A mixture of experts (`cfg.is_moe`) counts what one token computes: the
router's matmul and its `num_experts_per_tok` experts (`Qwen3Config.num_params(active=True)`),
never the experts it is not routed to (`muajax.models.moe.grouped_experts` computes none).

`executed_step_flops` counts what a train step's program executes instead: the backward's
recomputation (remat, the chunked LM head, the flash kernels' rebuilt scores) and the
reference model's forward, to set beside the compiled program's count (`muajax.planning`).
"""
from __future__ import annotations

import dataclasses

from muajax.models.attention import resolve
from muajax.models.qwen3 import Qwen3Config
from muajax.models.splash_attention import SPLASH_BLOCK, SPLASH_LANES


def matmul_params(cfg: Qwen3Config) -> int:
    """Weights one token's matmuls use: all but the norms and the embedding lookup (a tied
    head is a matmul); of a mixture of experts, the router and the token's active experts."""
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.num_params(active=True) - norms - lookup


def expert_params(cfg: Qwen3Config) -> int:
    """All the experts' weights (every layer's gate, up and down of every expert); 0 dense."""
    return cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size if cfg.is_moe else 0


def experts_touched(cfg: Qwen3Config, tokens: float) -> float:
    """The expected share of a layer's experts that `tokens` tokens are routed to (each token
    to num_experts_per_tok distinct experts, routing taken as uniform): what a call reads of
    the experts' weights. 1 for a dense model, or once the tokens reach every expert."""
    if not cfg.is_moe or tokens <= 0:
        return 1.0 if not cfg.is_moe else 0.0
    return 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** tokens


def weight_read_share(cfg: Qwen3Config, tokens: float) -> float:
    """The share of the model's weights one pass over `tokens` tokens reads: all of a dense
    model's; of a mixture of experts, all but the experts none of them is routed to."""
    return 1.0 - expert_params(cfg) / cfg.num_params() * (1.0 - experts_touched(cfg, tokens))


def down_projection_flops(cfg: Qwen3Config) -> float:
    """FLOPs per token of every layer's MLP down projection (a token's active experts' downs)."""
    if cfg.is_moe:
        return 2.0 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok * cfg.num_layers
    return 2.0 * cfg.hidden_size * cfg.intermediate_size * cfg.num_layers


def attention_pairs(seq: int, keys: int | None = None, causal: bool = True) -> float:
    """(query, key) pairs one row's attention scores: seq queries over `keys` keys (default
    seq). Causal with keys > seq: the queries are the last `seq` of `keys` positions."""
    keys = seq if keys is None else keys
    if not causal:
        return float(seq) * keys
    before = keys - seq  # cached keys every query sees
    return float(seq) * before + seq * (seq + 1) / 2


def causal_block_pairs(q_len: int, kv_len: int, block_q: int, block_kv: int, q_offset: int = 0) -> int:
    """(q block, kv block) pairs a blockwise causal attention computes for queries at
    positions q_offset .. q_offset + q_len - 1 over kv_len keys: every block holding a key at
    or before one of its queries, the diagonal blocks whole."""
    nkv = -(-kv_len // block_kv)
    pairs = 0
    for start in range(q_offset, q_offset + q_len, block_q):
        last = min(start + block_q, q_offset + q_len) - 1
        pairs += min(nkv, last // block_kv + 1)
    return pairs


def splash_row_pairs(seq: int) -> float:
    """(query, key) pairs splash computes for one row of `seq` tokens: it pads the row to its
    block (`muajax.models.splash_attention`: SPLASH_BLOCK, or the row in whole lanes) and
    computes every block the causal mask touches, whole."""
    lanes = lambda x: -(-x // SPLASH_LANES) * SPLASH_LANES
    block = min(lanes(SPLASH_BLOCK), lanes(seq))
    padded = -(-seq // block) * block
    return float(causal_block_pairs(padded, padded, block, block)) * block * block


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


# ----------------------------------------------------------------------------- executed


@dataclasses.dataclass(frozen=True)
class AttentionWork:
    """How an attention implementation (`muajax.models.attention`) computes: matmuls per
    (query, key) pair in its forward and its backward (each 2 x head_dim FLOPs per pair and
    query head), whether it skips the blocks a causal mask hides or scores every pair, and
    the remat policies under which the backward runs its forward again."""

    forward: int
    backward: int
    causal: bool
    recomputed_by: tuple[str, ...]


# xla: scores and p @ v as einsums over every pair; the backward's 4 (dp, dv, dq, dk). Their
#   outputs are dots with batch dims: "dots" keeps them, "dots_no_batch" runs them again.
# chunked: FlashAttention-2's backward, which first rebuilds each block's scores (5); its
#   output and log-sum-exp are named for the dots policies to keep (qwen3_model._remat_policy).
# splash: separate dq (s, dp, dq: 3) and dkv (s, dv, dp, dk: 4) kernels, muajax's BlockSizes;
#   a kernel's outputs are no dots, so every remat policy runs the forward kernel again.
# cudnn: a fused flash backward (5), its forward likewise run again under remat.
ATTENTION_WORK = {
    "xla": AttentionWork(2, 4, False, ("full", "dots_no_batch")),
    "chunked": AttentionWork(2, 5, True, ("full",)),
    "splash": AttentionWork(2, 7, True, ("full", "dots", "dots_no_batch")),
    "cudnn": AttentionWork(2, 5, True, ("full", "dots", "dots_no_batch")),
}


def _segments(cfg: Qwen3Config, batch: int, seq: int, shared_prefix: int, microbatches: int, platform: str):
    """(rows, new tokens, (query, key) pairs per row, implementation, runs) of the parts
    of a forward: the whole rows, or a shared prefix (one row per microbatch, through the
    cache form) and the rows' rest over it."""
    if not shared_prefix:
        impl = resolve(cfg.attention, num_keys=seq, dtype=cfg.compute_dtype, platform=platform, cache_form=False)
        pairs = splash_row_pairs(seq) if impl == "splash" else attention_pairs(seq, causal=ATTENTION_WORK[impl].causal)
        return [(batch, seq, pairs, impl, 1)]
    if not 0 < shared_prefix < seq:
        raise ValueError(f"a shared prefix needs 0 < shared_prefix < seq, got shared_prefix={shared_prefix}, seq={seq}")
    impl = resolve(cfg.attention, num_keys=seq, dtype=cfg.compute_dtype, platform=platform, cache_form=True)
    causal, rest = ATTENTION_WORK[impl].causal, seq - shared_prefix
    # the cache holds seq slots: the einsum scores every one of them
    prefix_pairs = attention_pairs(shared_prefix) if causal else float(shared_prefix) * seq
    return [(1, shared_prefix, prefix_pairs, impl, microbatches),
            (batch, rest, attention_pairs(rest, seq, causal=causal), impl, 1)]


def executed_step_parts(cfg: Qwen3Config, batch: int, seq: int, *, reference: bool = False, shared_prefix: int = 0,
                        microbatches: int = 1, logits_chunk: int | None = None,
                        platform: str = "tpu") -> dict[str, float]:
    """The matmul FLOPs a train step executes, by part (see `executed_step_flops`)."""
    layers, pairs_unit = 2.0 * (matmul_params(cfg) - head_params(cfg)), 2.0 * cfg.head_dim * cfg.num_heads
    # "full" runs the layers' forward again for what the backward reads: all but the MLP's
    # down projection, whose output only feeds the layer's output (XLA drops it); an
    # expert's down output is read back (the routing weights' gradient), so it runs again
    rerun = layers - (0.0 if cfg.is_moe else down_projection_flops(cfg))
    parts = dict.fromkeys(("forward", "backward", "recompute", "reference"), 0.0)
    for rows, tokens, pairs, impl, runs in _segments(cfg, batch, seq, shared_prefix, microbatches, platform):
        work = ATTENTION_WORK[impl]
        proj = runs * rows * tokens * layers
        attn = runs * rows * pairs * pairs_unit * cfg.num_layers  # one matmul over every pair
        parts["forward"] += proj + work.forward * attn
        parts["backward"] += 2 * proj + work.backward * attn
        parts["recompute"] += (runs * rows * tokens * rerun if cfg.remat == "full" else 0.0) + (
            work.forward * attn if cfg.remat in work.recomputed_by else 0.0)
        parts["reference"] += (proj + work.forward * attn) if reference else 0.0
    head = 2.0 * head_params(cfg) * batch * seq
    chunked_head = logits_chunk is not None and logits_chunk < seq  # the chunks run under jax.checkpoint
    parts["forward"] += head
    parts["backward"] += 2 * head
    parts["recompute"] += head if chunked_head else 0.0
    parts["reference"] += head if reference else 0.0
    return parts


def executed_step_flops(cfg: Qwen3Config, batch: int, seq: int, *, reference: bool = False, shared_prefix: int = 0,
                        microbatches: int = 1, logits_chunk: int | None = None, platform: str = "tpu") -> float:
    """The matmul FLOPs a train step executes, as distinct from `train_step_flops` (the useful
    ones MFU counts):
    - the policy's forward, and its backward: twice the forward's projections and head, and
      the attention backward's own matmuls (`ATTENTION_WORK`: the flash kernels rebuild the
      scores);
    - what the remat policy runs again in the backward: "full", the layers' forward but the
      MLP's down projection, which nothing in the backward reads; "dots" / "dots_no_batch",
      the attention forward where its outputs are not kept (ATTENTION_WORK);
    - the LM head's forward again when it runs in `logits_chunk` chunks (under jax.checkpoint);
    - the reference model's forward when GRPO keeps one.
    The attention is `cfg.attention` as `muajax.models.attention.resolve` picks it on
    `platform`, over causal pairs where it skips masked blocks: splash's in its blocks
    (`splash_row_pairs`), chunked's exactly (its block depends on the rows per device). With
    `shared_prefix` the prefix runs once per microbatch, through the cache form."""
    return sum(executed_step_parts(cfg, batch, seq, reference=reference, shared_prefix=shared_prefix,
                                   microbatches=microbatches, logits_chunk=logits_chunk, platform=platform).values())


def real_token_flops(cfg, lengths, *, passes: float, shared_prefix: int = 0,
                     prefix_runs: int = 1) -> float:
    """Model FLOPs of `passes` forward-equivalents (3 for forward + backward, 4 with a
    reference forward) over rows of these real lengths, padding excluded; with a
    `shared_prefix`, its tokens are counted `prefix_runs` times (as the step computes
    them: once per microbatch) instead of once per row."""
    rows = sum(forward_flops(cfg, 1, n, shared_prefix=shared_prefix, prefix_runs=0) if shared_prefix
               else forward_flops(cfg, 1, n) for n in lengths if n > shared_prefix)
    prefix = 0.0
    if shared_prefix:  # the layers over the prefix, once: its LM-head positions are in the rows'
        one = forward_flops(cfg, 1, shared_prefix + 1, shared_prefix=shared_prefix, prefix_runs=1)
        prefix = prefix_runs * (one - forward_flops(cfg, 1, shared_prefix + 1, shared_prefix=shared_prefix,
                                                    prefix_runs=0))
    return passes * (rows + prefix)
