"""Qwen3-MoE's pieces (muajax.models.moe): the grouped expert FFN against a dense one-hot
reference, batch invariance, routing and the load-balancing loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models import moe
from muajax.models.qwen3 import forward_jit, init_params
from tests.support.tiny_models import MOE_CONFIG


def _weights(e=8, d=64, f=32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (e, d, f)) * 0.2, jax.random.normal(ks[1], (e, d, f)) * 0.2,
            jax.random.normal(ks[2], (e, f, d)) * 0.2)


def _tokens(n, e=8, k=2, d=64, seed=1):
    """n tokens, each with k distinct experts and positive weights."""
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (n, d))
    index = jnp.argsort(jax.random.uniform(ks[1], (n, e)), axis=-1)[:, :k].astype(jnp.int32)
    return x, index, jax.random.uniform(ks[2], (n, k))


def dense_reference(x, index, weight, gate, up, down):
    """Every expert on every token, then each token's k experts picked by one-hot weights."""
    hp = jax.lax.Precision.HIGHEST
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, gate, precision=hp)) * jnp.einsum("nd,edf->enf", x, up, precision=hp)
    out = jnp.einsum("enf,efd->end", h, down, precision=hp)
    mix = jnp.sum(jax.nn.one_hot(index, gate.shape[0]) * weight[..., None], axis=1)  # [n, E]
    return jnp.einsum("ne,end->nd", mix, out, precision=hp)


@pytest.mark.parametrize("n,e,k", [(1, 4, 2), (13, 8, 2), (64, 16, 4)])
def test_grouped_experts_equal_the_dense_one_hot_reference(n, e, k):
    gate, up, down = _weights(e)
    x, index, weight = _tokens(n, e, k)
    got = jax.jit(moe.grouped_experts)(x, index, weight, gate, up, down)
    want = dense_reference(x, index, weight, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # an expert nobody chose, or a token's weights swapped between its experts, changes it
    swapped = jax.jit(moe.grouped_experts)(x, index, weight[:, ::-1], gate, up, down)
    assert np.abs(np.asarray(swapped) - np.asarray(want)).max() > 1e-3


def test_a_token_s_output_is_bitwise_the_same_alone_and_among_other_tokens():
    gate, up, down = _weights()
    x, index, weight = _tokens(48)
    run = jax.jit(moe.grouped_experts)
    together = np.asarray(run(x, index, weight, gate, up, down))
    for i in range(48):
        alone = np.asarray(run(x[i:i + 1], index[i:i + 1], weight[i:i + 1], gate, up, down))
        assert np.array_equal(alone[0], together[i]), i
    # and among other tokens in another order
    perm = np.random.default_rng(0).permutation(48)
    shuffled = np.asarray(run(x[perm], index[perm], weight[perm], gate, up, down))
    assert np.array_equal(shuffled, together[perm])


def test_route_is_hf_s_top_k_softmax_and_norm_topk_prob_renormalises():
    cfg = MOE_CONFIG
    x = jax.random.normal(jax.random.key(0), (5, cfg.hidden_size))
    router = jax.random.normal(jax.random.key(1), (cfg.hidden_size, cfg.num_experts))
    probs = jax.nn.softmax(x @ router, axis=-1)
    top = np.sort(np.asarray(probs), axis=-1)[:, ::-1][:, :cfg.num_experts_per_tok]
    plain = moe.route(x, router, cfg.replace(norm_topk_prob=False))
    normed = moe.route(x, router, cfg.replace(norm_topk_prob=True))
    np.testing.assert_allclose(np.asarray(plain.weight), top, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(normed.weight), top / top.sum(-1, keepdims=True), rtol=1e-6)
    assert np.array_equal(np.asarray(plain.index), np.asarray(normed.index))
    forced = jnp.zeros((5, cfg.num_experts_per_tok), jnp.int32).at[:, 1].set(3)
    replay = moe.route(x, router, cfg.replace(norm_topk_prob=False), forced=forced)
    assert np.array_equal(np.asarray(replay.index), np.asarray(forced))
    np.testing.assert_allclose(np.asarray(replay.weight), np.asarray(probs)[:, [0, 3]], rtol=1e-6)


def test_load_balancing_loss_is_hf_s():
    """HF's load_balancing_loss_func: counts and probabilities summed over all layers' valid
    tokens, divided by their number, E * sum(product); here written out with numpy."""
    rng = np.random.default_rng(0)
    layers, n, e, k = 3, 10, 8, 2
    probs = rng.dirichlet(np.ones(e), size=(layers, n)).astype(np.float32)
    index = np.argsort(-probs, axis=-1)[..., :k]
    valid = rng.random(n) > 0.3
    terms = [moe.load_balancing_terms(jnp.asarray(probs[i]), jnp.asarray(index[i]), jnp.asarray(valid))
             for i in range(layers)]
    fraction, mean_prob = (jnp.stack(t) for t in zip(*terms))
    counts = sum(np.bincount(index[i][valid].reshape(-1), minlength=e) for i in range(layers))
    prob_sum = sum(probs[i][valid].sum(0) for i in range(layers))
    total = layers * valid.sum()
    want = e * np.sum((counts / total) * (prob_sum / total))
    np.testing.assert_allclose(float(moe.load_balancing_loss(fraction, mean_prob)), want, rtol=1e-6)


def test_the_moe_model_initialises_and_runs_with_its_routing_out():
    cfg = MOE_CONFIG
    params = init_params(cfg, jax.random.key(0))
    layer = params["layers"]
    assert "w_gate" not in layer
    assert layer["router"].shape == (cfg.num_layers, cfg.hidden_size, cfg.num_experts)
    assert layer["expert_gate"].shape == (cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    assert layer["expert_down"].shape == (cfg.num_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    logits, _, routing = forward_jit(params, cfg, tokens, return_routing=True)
    assert logits.shape == (2, 9, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()
    assert routing.experts.shape == (cfg.num_layers, 2, 9, cfg.num_experts_per_tok)
    np.testing.assert_allclose(np.asarray(routing.fraction.sum(-1)), cfg.num_experts_per_tok, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(routing.mean_prob.sum(-1)), 1.0, rtol=1e-5)
