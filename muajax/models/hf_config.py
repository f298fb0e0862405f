"""Hugging Face `config.json` <-> `Qwen3Config`: dense Qwen3 (`Qwen3ForCausalLM`) and
Qwen3-MoE (`Qwen3MoeForCausalLM`), refusing what muajax does not compute."""
from __future__ import annotations

import json
import os

from muajax.models.qwen3_config import Qwen3Config
from muajax.models.safetensors_io import CheckpointError

_DENSE, _MOE = ("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")


def _kind(hf_config: dict, source: str) -> str:
    """"dense" or "moe" from model_type / architectures; anything else is refused."""
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if model_type == _MOE[0] or _MOE[1] in archs:
        return "moe"
    if model_type == _DENSE[0] or _DENSE[1] in archs:
        return "dense"
    raise CheckpointError(
        f"{source}: not a Qwen3 checkpoint (model_type={model_type!r}, architectures={archs}); "
        "muajax loads Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM) only"
    )


def _check_architecture(hf_config: dict, source: str) -> float:
    """The checks both kinds share; returns rope theta."""
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: no rope_theta (neither top-level nor in rope_parameters)")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r} is not Qwen3's 'silu'")
    if hf_config.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true is not Qwen3's architecture")
    if hf_config.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
    return float(theta)


def _moe_values(hf_config: dict, source: str) -> dict:
    """Qwen3-MoE's fields; every layer must be sparse (as in Qwen3-30B-A3B and 235B-A22B)."""
    if hf_config.get("mlp_only_layers"):
        raise CheckpointError(f"{source}: mlp_only_layers={hf_config['mlp_only_layers']} (dense MLP layers among "
                              "the experts' layers) is not supported: muajax needs every layer sparse")
    if int(hf_config.get("decoder_sparse_step", 1)) != 1:
        raise CheckpointError(f"{source}: decoder_sparse_step={hf_config['decoder_sparse_step']} is not supported: "
                              "muajax needs every layer sparse (decoder_sparse_step=1)")
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))  # transformers 5 writes the latter
    if experts is None:
        raise CheckpointError(f"{source}: missing required key 'num_experts'")
    return dict(num_experts=int(experts), num_experts_per_tok=int(hf_config["num_experts_per_tok"]),
                moe_intermediate_size=int(hf_config["moe_intermediate_size"]),
                norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)))


def config_from_hf(hf_config: dict, *, source: str = "config.json", **overrides) -> Qwen3Config:
    """Accepts both config formats: hub checkpoints' top-level `rope_theta` and the
    `rope_parameters` dict that transformers 5 writes."""
    kind = _kind(hf_config, source)
    theta = _check_architecture(hf_config, source)
    try:
        heads = int(hf_config["num_attention_heads"])
        hidden = int(hf_config["hidden_size"])
        values = dict(
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf_config["intermediate_size"] if kind == "dense" else
                                  hf_config.get("intermediate_size") or hf_config["moe_intermediate_size"]),
            num_layers=int(hf_config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
            head_dim=int(hf_config.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 40960)),
        )
        if kind == "moe":
            values.update(_moe_values(hf_config, source))
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing required key {exc.args[0]!r}") from None
    values.update(overrides)
    return Qwen3Config(**values)


def _moe_to_hf(cfg: Qwen3Config) -> dict:
    """Qwen3-MoE's keys as the Hub's Qwen3-30B-A3B config.json spells them."""
    return {
        "architectures": [_MOE[1]],
        "model_type": _MOE[0],
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
    }


def config_to_hf(cfg: Qwen3Config, torch_dtype: str) -> dict:
    out = {
        "architectures": [_DENSE[1]],
        "model_type": _DENSE[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        # Qwen3's special ids only make sense when the vocabulary holds them (not in tiny test models).
        "bos_token_id": 151643 if cfg.vocab_size > 151643 else None,
        "eos_token_id": 151645 if cfg.vocab_size > 151645 else None,
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
    }
    if cfg.is_moe:
        out.update(_moe_to_hf(cfg))
    return out


def load_config(hf_dir: str, **overrides) -> Qwen3Config:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not found (is {hf_dir!r} a Hugging Face model directory?)")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    return config_from_hf(data, source=path, **overrides)
