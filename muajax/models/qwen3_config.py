"""The Qwen3 architecture's settings (`Qwen3Config`): sizes, dtypes, remat policy and attention.

Validated on construction so that a bad dtype, remat policy or head layout fails where the
config is written rather than deep inside a traced forward.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from muajax.models.attention import IMPLEMENTATIONS
from muajax.models.token_tiles import TokenTiles

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    # Training and full-sequence attention (`muajax.models.attention`); a forward over a KV
    # cache (the engine's extend and decode) uses "xla" unless told otherwise.
    attention: str = "auto"
    # The LM head in float32 (products of bfloat16 values are exact in float32, so with
    # bfloat16 operands only the accumulation changes; see `lm_head`).
    logits_fp32: bool = False
    # Token-wise dots in fixed tiles (`muajax.models.token_tiles`): a token's numbers then do
    # not depend on the other tokens of the call. Set by the engine on its own programs.
    token_tiles: TokenTiles | None = None
    # Mixture of experts (Qwen3-MoE): 0 experts is the dense model. Every layer's MLP is then
    # `num_experts` SwiGLU experts of width `moe_intermediate_size`, each token routed to its
    # top `num_experts_per_tok` by a softmax router (renormalised over those with
    # `norm_topk_prob`, as HF), plus the load-balancing loss at `router_aux_loss_coef`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"Qwen3Config.{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"Qwen3Config.remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"Qwen3Config.attention={self.attention!r}: expected one of {IMPLEMENTATIONS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Qwen3Config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_experts < 0:
            raise ValueError(f"Qwen3Config.num_experts={self.num_experts} must be >= 0 (0: dense)")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"Qwen3Config.num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError(f"Qwen3Config.moe_intermediate_size={self.moe_intermediate_size} must be positive "
                             "for a mixture of experts")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    def replace(self, **changes) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def num_params(self, active: bool = False) -> int:
        """All weights; with `active`, those one token uses (its routed experts only)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * h
        if self.is_moe:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        else:
            mlp = 3 * d * f
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * d + d + head
