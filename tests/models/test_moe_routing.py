"""Routing in and out of the Qwen3-MoE model (muajax.models.moe_layer): the experts each token
used ([L, B, T, k]) and forced experts (routing replay) behave alike on the layer scan, the
in-place cache, the per-layer cache, chunked extends and token tiles; the load-balancing
terms count the valid tokens only."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models import moe
from muajax.models.attention import attention
from muajax.models.qwen3 import (AttentionContext, KVCache, Qwen3, forward_jit, forward_shared_prefix, init_cache,
                                 init_params, rope_tables)
from muajax.models.token_tiles import TokenTiles
from tests.support.tiny_models import MOE_CONFIG

B, T = 2, 8
shared_prefix = jax.jit(forward_shared_prefix, static_argnames=("cfg", "prefix_len", "return_routing"))


@pytest.fixture(scope="module")
def model():
    params = init_params(MOE_CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, MOE_CONFIG.vocab_size)
    return params, tokens


def _forced(cfg, seed=5):
    """Random distinct experts per token and layer [L, B, T, k]."""
    u = jax.random.uniform(jax.random.key(seed), (cfg.num_layers, B, T, cfg.num_experts))
    return jnp.argsort(u, axis=-1)[..., :cfg.num_experts_per_tok].astype(jnp.int32)


def _row_hook(q, k, v, stacked, layer, ctx):
    """A `cache_attention` hook over a stacked cache whose rows `ctx.pages` [b] the queries are
    (so token tiles can hand it a tile's rows), writing each token at its own position."""
    rows = ctx.pages
    k_cache, v_cache = stacked
    k_cache = k_cache.at[layer, rows[:, None], :, ctx.q_index].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, rows[:, None], :, ctx.q_index].set(v.astype(v_cache.dtype))
    keys, values = k_cache[layer][rows], v_cache[layer][rows]
    kv_valid = jnp.arange(keys.shape[2])[None, :] <= ctx.q_index[:, -1:]
    out = attention(q, keys, values, implementation="xla", q_index=ctx.q_index, kv_valid=kv_valid)
    return out, (k_cache, v_cache)


@jax.jit(static_argnums=1)
def _hooked(params, cfg, tokens, routing):
    """The whole prompt through the hook (with `cfg.token_tiles`: a tile at a time)."""
    cache = init_cache(cfg, B, 16)
    q_index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = rope_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.compute_dtype)
    ctx = AttentionContext(q_index, None, None, cos, sin, pages=jnp.arange(B), routing=routing)
    logits, _, out = Qwen3(cfg, cache_attention=_row_hook).apply(
        {"params": params}, tokens, ctx, (cache.k, cache.v), None, False, True, None, return_routing=True)
    return logits, out


def _run(params, cfg, tokens, routing, **kw):
    logits, _, got = forward_jit(params, cfg, tokens, routing=routing, return_routing=True, **kw)
    return logits, got


def _extends(params, cfg, tokens, routing):
    """A prefill then an extend, each with its tokens' forced experts."""
    chunks, cache = [], init_cache(cfg, B, 16)
    for lo, hi in ((0, 3), (3, T)):
        part = None if routing is None else routing[:, :, lo:hi]
        logits, cache, got = forward_jit(params, cfg, tokens[:, lo:hi], cache=cache, routing=part,
                                         return_routing=True)
        chunks.append((logits, got))
    return jnp.concatenate([c[0] for c in chunks], 1), moe.combine_routing([(c[1], 1) for c in chunks])


def _per_layer(params, cfg, tokens, routing):
    cache = init_cache(cfg, B, 16)
    return _run(params, cfg, tokens, routing, cache=KVCache(tuple(cache.k), tuple(cache.v), cache.lengths))


# every way the model runs: (params, cfg, tokens, routing) -> (logits [B, T, V], RoutingOut)
PATHS = {
    "in_place": lambda *a: _run(*a, cache=init_cache(a[1], B, 16)),
    "sliced_cache": lambda *a: _run(*a, cache=init_cache(a[1], B, 16), in_place=False),
    "per_layer": _per_layer,
    "extends": _extends,
    "hook": _hooked,
    "token_tiles": lambda params, cfg, *a: _hooked(params, cfg.replace(token_tiles=TokenTiles(tile=T)), *a),
}


def _assert_agree(got, want, name):
    (logits, routing), (logits0, routing0) = got, want
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), atol=2e-5, err_msg=name)
    assert np.array_equal(np.asarray(routing.experts), np.asarray(routing0.experts)), name
    np.testing.assert_allclose(np.asarray(routing.fraction), np.asarray(routing0.fraction), atol=1e-6, err_msg=name)
    np.testing.assert_allclose(np.asarray(routing.mean_prob), np.asarray(routing0.mean_prob), atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("path", PATHS)
def test_each_path_chooses_and_obeys_experts_as_the_layer_scan_does(model, path):
    params, tokens = model
    cfg = MOE_CONFIG
    chosen = _run(params, cfg, tokens, None)
    _assert_agree(PATHS[path](params, cfg, tokens, None), chosen, path)
    experts = np.asarray(chosen[1].experts)
    assert experts.shape == (cfg.num_layers, B, T, cfg.num_experts_per_tok)
    assert len(np.unique(experts)) > 2  # the tokens did not all go to one pair
    forced = _forced(cfg)
    scan = _run(params, cfg, tokens, forced)
    assert np.array_equal(np.asarray(scan[1].experts), np.asarray(forced))
    assert np.abs(np.asarray(scan[0]) - np.asarray(chosen[0])).max() > 1e-3  # the forced experts count
    _assert_agree(PATHS[path](params, cfg, tokens, forced), scan, path)


def test_replaying_a_forward_s_own_experts_gives_its_logits_bit_for_bit(model):
    params, tokens = model
    logits, own = _run(params, MOE_CONFIG, tokens, None)
    replayed, _ = _run(params, MOE_CONFIG, tokens, own.experts)
    assert np.array_equal(np.asarray(replayed), np.asarray(logits))


def test_the_load_balancing_terms_count_only_real_tokens(model):
    params, tokens = model
    cfg = MOE_CONFIG
    real = 5
    segment_ids = jnp.where(jnp.arange(T) < real, 1, 0)[None].repeat(B, 0)
    _, _, padded = forward_jit(params, cfg, tokens, segment_ids=segment_ids, return_routing=True)
    _, _, trimmed = forward_jit(params, cfg, tokens[:, :real], return_routing=True)
    np.testing.assert_allclose(np.asarray(padded.fraction), np.asarray(trimmed.fraction), atol=1e-6)
    np.testing.assert_allclose(np.asarray(padded.mean_prob), np.asarray(trimmed.mean_prob), atol=1e-6)
    assert np.asarray(padded.tokens).tolist() == [B * real] * cfg.num_layers
    loss = moe.load_balancing_loss(padded.fraction, padded.mean_prob)
    assert 1.0 <= float(loss) < cfg.num_experts  # 1 when perfectly balanced


def test_the_shared_prefix_forward_routes_and_replays_like_forward(model):
    params, tokens = model
    cfg = MOE_CONFIG
    tokens = tokens.at[1, :3].set(tokens[0, :3])  # a 3-token prefix the rows share
    _, _, full = forward_jit(params, cfg, tokens, return_routing=True)
    _, shared = shared_prefix(params, cfg, tokens, 3, return_routing=True)
    assert np.array_equal(np.asarray(shared.experts), np.asarray(full.experts))
    np.testing.assert_allclose(np.asarray(shared.fraction), np.asarray(full.fraction), atol=1e-6)
    forced = _forced(cfg).at[:, 1, :3].set(_forced(cfg)[:, 0, :3])
    _, replay = shared_prefix(params, cfg, tokens, 3, routing=forced, return_routing=True)
    assert np.array_equal(np.asarray(replay.experts), np.asarray(forced))
