import pytest

from muajax.models.flops import (
    attention_pairs,
    down_projection_flops,
    expert_params,
    experts_touched,
    forward_flops,
    matmul_params,
    train_step_flops,
)
from tests.support.tiny_models import TINY_CONFIG

CFG = TINY_CONFIG.replace(vocab_size=100, hidden_size=8, intermediate_size=16, head_dim=4)


def test_attention_pairs():
    assert attention_pairs(4) == 4 + 3 + 2 + 1            # causal: each query sees itself and the keys before
    assert attention_pairs(4, causal=False) == 16
    assert attention_pairs(1, keys=10) == 10              # one decode step over 9 cached keys and itself
    assert attention_pairs(2, keys=10) == 2 * 8 + 1 + 2


def test_forward_flops_by_hand():
    d, f, n, k, h, v, layers = 8, 16, 4, 2, 4, 100, 2
    weights = layers * (d * h * (2 * n + 2 * k) + 3 * d * f) + d * v   # untied head is a matmul, the embedding not
    assert matmul_params(CFG) == weights
    tied = CFG.replace(tie_word_embeddings=True)
    assert matmul_params(tied) == weights  # the tied head is the embedding table, used once as a matmul
    t, b = 6, 3
    attn = 4 * layers * n * h * (t * (t + 1) / 2)
    assert forward_flops(CFG, b, t) == pytest.approx(b * (2 * matmul_params(CFG) * t + attn))
    assert train_step_flops(CFG, b, t, reference=True) == pytest.approx(4 * forward_flops(CFG, b, t))
    assert train_step_flops(CFG, b, t) == pytest.approx(3 * forward_flops(CFG, b, t))


def test_a_shared_prefix_runs_once_per_microbatch():
    b, t, p = 3, 10, 4
    # one row: the prefix then the rest over all the keys is the whole causal forward
    assert forward_flops(CFG, 1, t, shared_prefix=p) == pytest.approx(forward_flops(CFG, 1, t))
    # b rows: b - 1 prefixes fewer through the layers (the head still runs on every position)
    saved = (b - 1) * (forward_flops(CFG, 1, p) - 2 * CFG.vocab_size * CFG.hidden_size * p)
    assert forward_flops(CFG, b, t, shared_prefix=p) == pytest.approx(forward_flops(CFG, b, t) - saved)
    once = forward_flops(CFG, b, t, shared_prefix=p)
    twice = forward_flops(CFG, b, t, shared_prefix=p, prefix_runs=2)
    assert twice - once == pytest.approx(forward_flops(CFG, 1, p) - 2 * CFG.vocab_size * CFG.hidden_size * p)
    assert train_step_flops(CFG, b, t, shared_prefix=p, microbatches=2, reference=True) == pytest.approx(4 * twice)
    with pytest.raises(ValueError, match="shared prefix"):
        forward_flops(CFG, b, t, shared_prefix=t)


MOE = CFG.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=6)


def test_a_mixture_of_experts_counts_the_router_and_the_active_experts_only():
    d, fe, e, active, n, k, h, v, layers = 8, 6, 8, 2, 4, 2, 4, 100, 2
    attn_weights = d * h * (2 * n + 2 * k)
    per_token = layers * (attn_weights + d * e + active * 3 * d * fe) + d * v  # router + 2 experts, not 8
    assert matmul_params(MOE) == per_token
    assert expert_params(MOE) == layers * e * 3 * d * fe
    t, b = 6, 3
    attn = 4 * layers * n * h * (t * (t + 1) / 2)  # attention as the dense model's
    assert forward_flops(MOE, b, t) == pytest.approx(b * (2 * per_token * t + attn))
    # more experts at the same active count: the same FLOPs, more weights
    wider = MOE.replace(num_experts=64)
    assert forward_flops(wider, b, t) - forward_flops(MOE, b, t) == pytest.approx(b * t * 2 * layers * d * (64 - 8))
    assert expert_params(wider) == 8 * expert_params(MOE)
    assert train_step_flops(MOE, b, t) == pytest.approx(3 * forward_flops(MOE, b, t))


def test_experts_touched_by_a_call():
    assert experts_touched(CFG, 1) == 1.0                      # dense: the whole MLP every call
    assert experts_touched(MOE, 1) == pytest.approx(2 / 8)     # one token reads its 2 of 8 experts
    assert experts_touched(MOE, 2) == pytest.approx(1 - (6 / 8) ** 2)
    assert experts_touched(MOE, 10_000) == pytest.approx(1.0)  # a big call reads them all
    assert down_projection_flops(MOE) == 2 * 8 * 6 * 2 * 2
    assert down_projection_flops(CFG) == 2 * 8 * 16 * 2
