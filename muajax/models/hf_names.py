"""The one table of Hugging Face tensor names <-> muajax params (`muajax.models.hf` loads and
saves through it): each `NameRule` names a HF tensor, the param it lives in and the
transforms between the two layouts.

A name with "{layer}" stands for one tensor per layer (the param stacks them, layers first);
with "{layer}" and "{expert}", one per layer and expert (stacked [layers, experts, ...]).

Qwen3-MoE (`Qwen3MoeForCausalLM`) checkpoints come in two layouts:
- per expert, as the Hub's Qwen3-30B-A3B / 235B-A22B and `save_pretrained` (transformers 5
  reverts its fused weights to this layout by default) write them:
  `mlp.experts.{e}.gate_proj.weight` / `up_proj.weight` [F, D], `down_proj.weight` [D, F];
- fused, as transformers 5 holds them in memory (`save_pretrained(save_original_format=False)`):
  `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows first) and `mlp.experts.down_proj` [E, D, F].
muajax reads both (`active_rules(cfg, fused=...)`) and writes the per-expert layout.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable

import numpy as np

from muajax.models.qwen3_config import Qwen3Config

Array = np.ndarray


def _identity(w: Array, cfg: Qwen3Config) -> Array:
    return w


def _transpose(w: Array, cfg: Qwen3Config) -> Array:
    return w.T


def _heads_in(num_heads: Callable[[Qwen3Config], int]):
    """HF [heads*head_dim, hidden] -> muajax [hidden, heads, head_dim], and back."""

    def to_params(w, cfg):
        return w.reshape(num_heads(cfg), cfg.head_dim, w.shape[-1]).transpose(2, 0, 1)

    def to_hf(w, cfg):
        return w.transpose(1, 2, 0).reshape(-1, w.shape[0])

    return to_params, to_hf


def _o_to_params(w, cfg):  # HF [hidden, heads*head_dim] -> [heads, head_dim, hidden]
    return w.reshape(w.shape[0], cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)


def _o_to_hf(w, cfg):
    return w.transpose(2, 0, 1).reshape(w.shape[2], -1)


def _fused_half(half: int):
    """HF's fused `gate_up_proj` [E, 2F, D] -> the gate (0) or up (1) half as [E, D, F]."""

    def to_params(w, cfg):
        f = cfg.moe_intermediate_size
        if w.ndim != 3 or w.shape[1] != 2 * f:
            raise ValueError(f"gate_up_proj of shape {w.shape} is not [experts, 2 * {f}, hidden]")
        return w[:, half * f:(half + 1) * f, :].transpose(0, 2, 1)

    return to_params


def _experts_transpose(w, cfg):  # [E, D, F] <-> [E, F, D]
    return w.transpose(0, 2, 1)


def _read_only(w, cfg):
    raise ValueError("the fused experts layout (gate_up_proj, down_proj) is read only: muajax writes the per-expert "
                     "layout real Qwen3-MoE checkpoints use, which transformers reads back")


@dataclasses.dataclass(frozen=True)
class NameRule:
    hf_name: str  # "{layer}" / "{expert}" stand for the layer / expert index
    param_path: tuple[str, ...]
    to_params: Callable[[Array, Qwen3Config], Array] = _identity
    to_hf: Callable[[Array, Qwen3Config], Array] = _identity

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_name

    @property
    def stacked(self) -> int:
        """How many leading param dims index HF tensors (0, 1: layers, 2: layers and experts)."""
        return int(self.per_layer) + int("{expert}" in self.hf_name)

    def name(self, *index: int) -> str:
        return self.hf_name.format(**dict(zip(("layer", "expert"), index)))

    def grid(self, cfg: Qwen3Config) -> tuple[int, ...]:
        """The counts of the stacked dims ((), (layers,) or (layers, experts))."""
        return (cfg.num_layers, cfg.num_experts)[:self.stacked]


_q_in, _q_out = _heads_in(lambda c: c.num_heads)
_kv_in, _kv_out = _heads_in(lambda c: c.num_kv_heads)
_LAYER = "model.layers.{layer}."
_MLP = ("w_gate", "w_up", "w_down")
NAME_RULES: tuple[NameRule, ...] = (
    NameRule("model.embed_tokens.weight", ("embed",)),
    NameRule("model.norm.weight", ("final_norm",)),
    NameRule("lm_head.weight", ("lm_head",), _transpose, _transpose),
    NameRule(_LAYER + "input_layernorm.weight", ("layers", "attn_norm")),
    NameRule(_LAYER + "self_attn.q_proj.weight", ("layers", "wq"), _q_in, _q_out),
    NameRule(_LAYER + "self_attn.k_proj.weight", ("layers", "wk"), _kv_in, _kv_out),
    NameRule(_LAYER + "self_attn.v_proj.weight", ("layers", "wv"), _kv_in, _kv_out),
    NameRule(_LAYER + "self_attn.o_proj.weight", ("layers", "wo"), _o_to_params, _o_to_hf),
    NameRule(_LAYER + "self_attn.q_norm.weight", ("layers", "q_norm")),
    NameRule(_LAYER + "self_attn.k_norm.weight", ("layers", "k_norm")),
    NameRule(_LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm")),
    NameRule(_LAYER + "mlp.gate_proj.weight", ("layers", "w_gate"), _transpose, _transpose),
    NameRule(_LAYER + "mlp.up_proj.weight", ("layers", "w_up"), _transpose, _transpose),
    NameRule(_LAYER + "mlp.down_proj.weight", ("layers", "w_down"), _transpose, _transpose),
)
_EXPERT = _LAYER + "mlp.experts.{expert}."
_ROUTER = NameRule(_LAYER + "mlp.gate.weight", ("layers", "router"), _transpose, _transpose)
MOE_RULES: tuple[NameRule, ...] = (  # per expert: what the Hub's checkpoints hold, and what muajax writes
    _ROUTER,
    NameRule(_EXPERT + "gate_proj.weight", ("layers", "expert_gate"), _transpose, _transpose),
    NameRule(_EXPERT + "up_proj.weight", ("layers", "expert_up"), _transpose, _transpose),
    NameRule(_EXPERT + "down_proj.weight", ("layers", "expert_down"), _transpose, _transpose),
)
MOE_FUSED_RULES: tuple[NameRule, ...] = (  # transformers 5's in-memory layout, read only
    _ROUTER,
    NameRule(_LAYER + "mlp.experts.gate_up_proj", ("layers", "expert_gate"), _fused_half(0), _read_only),
    NameRule(_LAYER + "mlp.experts.gate_up_proj", ("layers", "expert_up"), _fused_half(1), _read_only),
    NameRule(_LAYER + "mlp.experts.down_proj", ("layers", "expert_down"), _experts_transpose, _read_only),
)
FUSED_MARKER = "model.layers.0.mlp.experts.gate_up_proj"  # a checkpoint holding it is in the fused layout
# Buffers some exporters include; they carry no weights.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_names(rule: NameRule, cfg: Qwen3Config) -> list[str]:
    """The rule's HF tensor names, stacked-dims order (layer-major, then expert)."""
    return [rule.name(*index) for index in itertools.product(*map(range, rule.grid(cfg)))]


def active_rules(cfg: Qwen3Config, fused: bool = False) -> list[NameRule]:
    """The rules of `cfg`'s params: a mixture of experts' MLP in the per-expert layout, or the
    fused one (`fused`, reading only)."""
    rules = [r for r in NAME_RULES if not (cfg.tie_word_embeddings and r.param_path == ("lm_head",))]
    if cfg.is_moe:
        rules = [r for r in rules if r.param_path[-1] not in _MLP] + list(MOE_FUSED_RULES if fused else MOE_RULES)
    return rules
