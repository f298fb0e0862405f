"""Qwen3-MoE in muajax against transformers' `Qwen3MoeForCausalLM` on tiny random checkpoints
of several shapes (experts 4-16, active 2-4, with and without `norm_topk_prob`): float32
logits within 1e-4 and the engine's greedy tokens equal to HF `generate`."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from muajax.models.hf import load_params
from muajax.models.qwen3 import forward_jit as forward
from muajax.parity import hf_greedy, muajax_greedy
from tests.support.tiny_models import load_hf_model, make_hf_moe_checkpoint

VARIANTS = {
    "e4_k2_norm": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "e8_k2_plain": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "e16_k4_norm": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, moe_intermediate_size=16),
    "e12_k3_plain_tied_3layers": dict(num_experts=12, num_experts_per_tok=3, norm_topk_prob=False,
                                      tie_word_embeddings=True, num_hidden_layers=3, num_key_value_heads=4),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_hf_moe_checkpoint(path, seed=sorted(VARIANTS).index(request.param) + 10, **VARIANTS[request.param])
    return path


def ragged_batch(seed=0, lengths=(13, 5, 9), vocab=256):
    rng = np.random.RandomState(seed)
    tokens = np.zeros((len(lengths), max(lengths)), np.int32)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.randint(0, vocab, n)
        mask[i, :n] = 1
    return tokens, mask


def test_float32_logits_match_transformers(checkpoint):
    tokens, mask = ragged_batch()
    model = load_hf_model(checkpoint)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    params, cfg = load_params(checkpoint)
    assert cfg.num_experts == model.config.num_experts and cfg.norm_topk_prob == model.config.norm_topk_prob
    ours, _ = forward(params, cfg, jnp.asarray(tokens))
    diff = np.abs(np.asarray(ours) - ref)[mask.astype(bool)]
    assert diff.max() <= 1e-4, diff.max()


def test_greedy_tokens_equal_hf_generate(checkpoint):
    """muajax's engine (muajax.parity.muajax_greedy: ragged prompts extended together, then
    the decode loop) against HF `generate`, one prompt at a time."""
    model = load_hf_model(checkpoint)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, 256, n).tolist() for n in (6, 11)]
    want = hf_greedy(model, prompts, 10)
    params, cfg = load_params(checkpoint)
    got = muajax_greedy(params, cfg, prompts, 10)
    assert np.array_equal(got, want), (got, want)
