"""The tiny models the tests use, in one place.

- `TINY_CONFIG` and `ONE_LAYER_CONFIG`: muajax `Qwen3Config`s. A test that needs another shape
  says what differs (`TINY_CONFIG.replace(head_dim=128)`). jax caches compiled programs per
  static config, so tests that use equal configs share their compilations within a session.
- `TINY_ARCH` and `arch_override(...)`: the inline `model.arch` of tiny runs (run configs and
  `python -m muajax.train` overrides); the vocabulary comes from the run (`model.vocab`).
- `HF_TINY` and `make_hf_checkpoint(...)`: random `Qwen3ForCausalLM` checkpoints saved with
  `transformers`, for parity, loading and engine tests; `HF_MOE_TINY` and
  `make_hf_moe_checkpoint(...)` the same for `Qwen3MoeForCausalLM` (Qwen3-MoE).

The session-scoped fixtures (one HF checkpoint per seed, the tokenizer) are in
tests/support/fixtures.py.
"""
from __future__ import annotations

import os

import yaml

from muajax.models.qwen3_config import Qwen3Config

# Two layers, width 64, grouped-query attention (4 query heads over 2 KV heads, head_dim 16),
# a 256-token vocabulary: ArchConfig's default shape with a small vocabulary.
TINY_CONFIG = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16)

# One layer, width 32, 2 query heads over 1 KV head (head_dim 16), a 64-token vocabulary: the
# smallest model that still has grouped-query attention. TINY_ARCH is this shape.
ONE_LAYER_CONFIG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                               num_kv_heads=1, head_dim=16)

# TINY_CONFIG's shape as a mixture of experts (Qwen3-MoE): 8 experts of width 32, 2 per token.
MOE_CONFIG = TINY_CONFIG.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

# The inline `model.arch` of tiny runs: ONE_LAYER_CONFIG's shape, room for 2048 positions.
TINY_ARCH = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                 max_position_embeddings=2048)


# The engine tests' model (tests/engine/test_fixed_rows.py, test_packed_extends.py): a vocabulary
# wide enough for random prompts and a wider MLP than TINY_CONFIG's.
ENGINE_CONFIG = TINY_CONFIG.replace(vocab_size=500, intermediate_size=192)


def engine_params(cfg: Qwen3Config = ENGINE_CONFIG, seed: int = 0):
    """Random params of `cfg` (the engine tests' module fixtures call this)."""
    import flax.linen as nn
    import jax

    from muajax.models.qwen3 import init_params
    return nn.meta.unbox(init_params(cfg, jax.random.key(seed)))


def random_ids(rng, n: int, cfg: Qwen3Config = ENGINE_CONFIG) -> list[int]:
    """`n` random token ids of `cfg`'s vocabulary from numpy RandomState `rng`."""
    return [int(t) for t in rng.randint(0, cfg.vocab_size, n)]


def grpo_update_setup(cfg: Qwen3Config, advantages, batch: int = 4, length: int = 16):
    """(one-device mesh, params, batch) for a GRPO update of `cfg`: random tokens, the loss on
    positions 5 on, rollout logprobs of -9 there (far below the trainer's: every ratio to them
    is large) and the given per-row `advantages`. The old-logprob and off-policy tests share it."""
    import jax
    import numpy as np

    from muajax import parallel
    from muajax.models.qwen3 import init_params
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    mask = np.zeros((batch, length), np.int32)
    mask[:, 5:] = 1
    rows = dict(tokens=rng.integers(0, cfg.vocab_size, (batch, length)).astype(np.int32), loss_mask=mask,
                old_logprobs=np.where(mask > 0, -9.0, 0.0).astype(np.float32),
                advantages=np.asarray(advantages, np.float32))
    return mesh, params, rows


def arch_override(**changes) -> str:
    """`model.arch={...}`: TINY_ARCH with `changes`, as a run-config override."""
    arch = yaml.safe_dump({**TINY_ARCH, **changes}, default_flow_style=True, sort_keys=False, width=float("inf"))
    return f"model.arch={arch.strip()}"


# `transformers.Qwen3Config` arguments of the random HF checkpoints (make_hf_checkpoint).
HF_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=10000.0,
               max_position_embeddings=512, tie_word_embeddings=False)


def make_hf_checkpoint(path: str, *, seed: int = 0, max_shard_size: str | None = None, dtype=None, **overrides) -> str:
    """Save a random `Qwen3ForCausalLM` (HF_TINY with `overrides`; float32 unless `dtype`) to
    `path`; returns the path. Tests that only read one use the `hf_checkpoint` fixture."""
    import torch
    import transformers

    kwargs = {**HF_TINY, **overrides}
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


# `transformers.Qwen3MoeConfig` arguments of the random HF mixture-of-experts checkpoints
# (make_hf_moe_checkpoint): HF_TINY's attention, 8 experts of width 32, 2 per token.
HF_MOE_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=True)


def make_hf_moe_checkpoint(path: str, *, seed: int = 0, fused: bool = False, max_shard_size: str | None = None,
                           dtype=None, **overrides) -> str:
    """Save a random `Qwen3MoeForCausalLM` (HF_MOE_TINY with `overrides`; float32 unless
    `dtype`) to `path`; returns the path. Saved per expert (`mlp.experts.{e}.gate_proj.weight`,
    the Hub's layout and `save_pretrained`'s default), or with `fused` in transformers 5's
    in-memory layout (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F])."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**HF_MOE_TINY, **overrides})).eval()
    # norms away from 1, a router wide enough that top-k has no near ties, and experts large
    # enough (HF's init, std 0.02, leaves them a small part of the residual) that the logits
    # and the greedy tokens depend on which experts a token takes and how they are weighted
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.1)
            elif ".mlp.experts." in name:
                param.normal_(0.0, 0.15)
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, save_original_format=not fused,
                          **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def load_hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
