"""Tiny random Qwen3 checkpoints built with `transformers` and saved, for parity tests."""
from __future__ import annotations

import os

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=False)


def make_hf_checkpoint(path: str, *, seed: int = 0, max_shard_size: str | None = None, dtype=None, **overrides) -> str:
    """Save a random `Qwen3ForCausalLM` (float32 unless `dtype`) to `path`; returns the path."""
    import torch
    import transformers

    kwargs = {**TINY, **overrides}
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs)).eval()
    with torch.no_grad():  # HF inits norms to exactly 1; randomise them so the tests see them
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def load_hf_model(path: str):
    import transformers

    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype="auto").eval()
