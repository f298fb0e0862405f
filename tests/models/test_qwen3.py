"""Qwen3 in Flax against transformers: logits, cached extend/decode, dtype handling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from muajax.models.hf import load_config, load_params
from muajax.models.qwen3 import Qwen3Config, forward_jit as forward, init_cache
from tests.support.tiny_models import TINY_CONFIG, load_hf_model, make_hf_checkpoint

VARIANTS = {
    "untied_kv2": dict(),
    "tied": dict(tie_word_embeddings=True),
    "kv_ratio1": dict(num_attention_heads=4, num_key_value_heads=4),
    "kv_ratio4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "headdim_unlike": dict(hidden_size=48, num_attention_heads=4, head_dim=32, num_hidden_layers=3),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_hf_checkpoint(path, seed=hash(request.param) % 1000, **VARIANTS[request.param])
    return path


def ragged_batch(seed=0, lengths=(13, 5, 9), vocab=256):
    rng = np.random.RandomState(seed)
    tokens = np.zeros((len(lengths), max(lengths)), np.int32)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.randint(0, vocab, n)
        mask[i, :n] = 1
    return tokens, mask


def hf_logits(path, tokens, mask):
    model = load_hf_model(path)
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.float().numpy()


def test_float32_logits_match_transformers(checkpoint):
    tokens, mask = ragged_batch()
    ref = hf_logits(checkpoint, tokens, mask)
    params, cfg = load_params(checkpoint)
    ours, _ = forward(params, cfg, jnp.asarray(tokens))
    valid = mask.astype(bool)
    diff = np.abs(np.asarray(ours) - ref)[valid]
    assert diff.max() <= 1e-4, diff.max()


def test_left_padding_with_attention_mask_matches(checkpoint):
    tokens, mask = ragged_batch(seed=1)
    left_tokens = np.zeros_like(tokens)
    left_mask = np.zeros_like(mask)
    for i in range(len(tokens)):
        n = mask[i].sum()
        left_tokens[i, -n:] = tokens[i, :n]
        left_mask[i, -n:] = 1
    ref = hf_logits(checkpoint, tokens, mask)
    params, cfg = load_params(checkpoint)
    positions = np.maximum(np.cumsum(left_mask, axis=1) - 1, 0)
    ours, _ = forward(params, cfg, jnp.asarray(left_tokens), positions=jnp.asarray(positions),
                      attention_mask=jnp.asarray(left_mask))
    ours = np.asarray(ours)
    for i in range(len(tokens)):
        n = mask[i].sum()
        np.testing.assert_allclose(ours[i, -n:], ref[i, :n], atol=1e-4, rtol=0)


def test_cached_extend_and_decode_equal_full_forward(checkpoint):
    """Chunks of different sizes per row appended at ragged offsets, then 1-token decodes."""
    params, cfg = load_params(checkpoint)
    rng = np.random.RandomState(3)
    total = np.array([17, 11, 14])
    seqs = [rng.randint(0, cfg.vocab_size, n) for n in total]
    full = [np.asarray(forward(params, cfg, jnp.asarray(s[None]))[0])[0] for s in seqs]
    cache = init_cache(cfg, batch=3, max_len=24)
    consumed = np.zeros(3, int)
    # chunk plan per row: sizes of successive extends (0 = the row sits this call out)
    plan = [[6, 0, 5, 1, 1, 1, 1, 1, 1], [3, 4, 0, 1, 1, 1, 1, 0, 0], [7, 2, 1, 1, 1, 1, 1, 0, 0]]
    for step in range(len(plan[0])):
        sizes = np.array([plan[r][step] for r in range(3)])
        width = max(1, sizes.max())
        chunk = np.zeros((3, width), np.int32)
        for r in range(3):
            chunk[r, : sizes[r]] = seqs[r][consumed[r] : consumed[r] + sizes[r]]
        logits, cache = forward(params, cfg, jnp.asarray(chunk), cache=cache, num_new=jnp.asarray(sizes))
        logits = np.asarray(logits)
        for r in range(3):
            if sizes[r]:
                want = full[r][consumed[r] : consumed[r] + sizes[r]]
                np.testing.assert_allclose(logits[r, : sizes[r]], want, atol=1e-4, rtol=0)
        consumed += sizes
    assert list(np.asarray(cache.lengths)) == list(consumed)


def test_logits_index_picks_positions(checkpoint):
    params, cfg = load_params(checkpoint)
    tokens, _ = ragged_batch()
    full, _ = forward(params, cfg, jnp.asarray(tokens))
    index = jnp.asarray([[12], [4], [8]])
    picked, _ = forward(params, cfg, jnp.asarray(tokens), logits_index=index)
    np.testing.assert_allclose(np.asarray(picked)[:, 0], np.asarray(full)[np.arange(3), index[:, 0]], atol=1e-6)


# Measured on this checkpoint and batch: max |Δlogit| 0.0049 (about one bf16 step at the
# logits' magnitude, ~0.7) and KL 5.2e-7. The bounds leave a small margin (2x on the logits,
# 4x on the KL, which grows with the square of the error); a logit-scale bug of 5% already
# gives 0.036 and 3.3e-5, of 20% 0.14 and 5.2e-4.
BF16_MAX_LOGIT_DIFF = 0.01
BF16_MAX_KL = 2e-6


def _logit_errors(ours, ref, valid):
    p = jax.nn.log_softmax(ref[valid])
    q = jax.nn.log_softmax(ours[valid])
    return float(np.abs(ours - ref)[valid].max()), float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))


def test_bfloat16_parity_is_bounded(tmp_path):
    """bf16 params and compute against transformers in bf16: measured and bounded."""
    path = make_hf_checkpoint(str(tmp_path), seed=5, dtype=torch.bfloat16)
    tokens, mask = ragged_batch(seed=2)
    ref = hf_logits(path, tokens, mask)
    params, cfg = load_params(path, load_config(path, param_dtype="bfloat16", dtype="bfloat16"))
    assert params["embed"].dtype == jnp.bfloat16
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens))[0]).astype(np.float32)
    valid = mask.astype(bool)
    max_diff, kl = _logit_errors(ours, ref, valid)
    assert max_diff < BF16_MAX_LOGIT_DIFF, max_diff
    assert kl < BF16_MAX_KL, kl
    # the bounds catch what they are for: the same logits scaled by 5% or 20% fail both
    for scale in (1.05, 1.2, 0.8):
        wrong_diff, wrong_kl = _logit_errors(ours * scale, ref, valid)
        assert wrong_diff > BF16_MAX_LOGIT_DIFF and wrong_kl > BF16_MAX_KL, (scale, wrong_diff, wrong_kl)


def test_config_validation_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="remat"):
        Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                    head_dim=4, remat="sometimes")


def test_remat_does_not_change_gradients(tmp_path):
    path = make_hf_checkpoint(str(tmp_path), seed=9)
    params, cfg = load_params(path)
    tokens = jnp.asarray(ragged_batch()[0])

    def loss(p, c):
        return jnp.mean(forward(p, c, tokens)[0] ** 2)

    g0 = jax.grad(loss)(params, cfg)
    g1 = jax.grad(loss)(params, cfg.replace(remat="full"))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_dots_remat_keeps_the_chunked_attention_output_instead_of_rerunning_it():
    """The dots policies also save chunked attention's output and log-sum-exp (named in
    `chunked_attention`): its custom VJP needs both, and without them the backward reruns the
    attention forward. The log-sum-exp [L, B, K, G x T] is no dot's output, so it is saved
    only by name; `full` saves neither."""
    from jax._src.ad_checkpoint import saved_residuals

    from muajax.models.qwen3 import forward as plain_forward, init_params

    cfg = TINY_CONFIG.replace(vocab_size=64, hidden_size=32, intermediate_size=64, attention="chunked")
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((3, 24), jnp.int32)
    lse_shape = (2, 3, 2, 2 * 24)

    def saved_shapes(remat):
        c = cfg.replace(remat=remat)
        return [tuple(aval.shape) for aval, _ in saved_residuals(lambda p: plain_forward(p, c, tokens)[0].sum(), params)]

    for remat in ("dots", "dots_no_batch"):
        assert lse_shape in saved_shapes(remat), remat
        assert lse_shape + (16,) in saved_shapes(remat), remat  # the output, [L, B, K, G x T, H]
    assert lse_shape not in saved_shapes("full")


def test_in_place_cache_equals_per_layer_slices(checkpoint):
    """The engine's in-place cache (carried through the layer scan) and the differentiable
    per-layer form compute the same numbers, extend and decode alike."""
    params, cfg = load_params(checkpoint)
    rng = np.random.RandomState(4)
    caches = {flag: init_cache(cfg, batch=2, max_len=16) for flag in (True, False)}
    for width, num_new in ((6, [6, 4]), (1, [1, 1]), (3, [0, 3])):
        chunk = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, width)), jnp.int32)
        outs = {}
        for flag in (True, False):
            outs[flag], caches[flag] = forward(params, cfg, chunk, cache=caches[flag], num_new=jnp.asarray(num_new),
                                               in_place=flag)
        np.testing.assert_array_equal(np.asarray(outs[True]), np.asarray(outs[False]))
        for a, b in zip(caches[True], caches[False]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unrolled_per_layer_cache_equals_stacked(checkpoint):
    """The decode loop's form (`KVCache.per_layer`: layers unrolled, one cache buffer and one
    weight tree each) computes what the stacked cache computes, extend and decode alike."""
    from muajax.models.qwen3 import KVCache, split_layers

    params, cfg = load_params(checkpoint)
    rng = np.random.RandomState(5)
    stacked = init_cache(cfg, batch=2, max_len=16)
    layered = KVCache(tuple(stacked.k), tuple(stacked.v), stacked.lengths)
    weights = split_layers(params, cfg.num_layers)
    for width, num_new in ((6, [6, 4]), (1, [1, 1]), (3, [0, 3])):
        chunk = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, width)), jnp.int32)
        num_new = jnp.asarray(num_new)
        want, stacked = forward(params, cfg, chunk, cache=stacked, num_new=num_new)
        got, layered = forward(params, cfg, chunk, cache=layered, num_new=num_new,
                               layer_params=weights if width > 1 else None)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.stack(layered.k), np.asarray(stacked.k), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.stack(layered.v), np.asarray(stacked.v), atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.asarray(layered.lengths), np.asarray(stacked.lengths))


# ----------------------------------------------------------------------------- attention implementations


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """GQA 2, head_dim 64: the shapes splash and chunked see in real models, kept tiny."""
    path = str(tmp_path_factory.mktemp("attn"))
    return make_hf_checkpoint(path, seed=11, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _logits_and_grads(params, cfg, tokens, weight, **kwargs):
    def loss(p):
        logits, _ = forward(p, cfg, tokens, **kwargs)
        return jnp.sum(logits * weight), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), grads


@pytest.mark.parametrize("impl", ["chunked", "splash"])
def test_attention_implementations_give_the_reference_logits_and_gradients(small_checkpoint, impl, monkeypatch):
    """Right-padded rows through the whole model, blocks shorter than the rows (chunked: 16;
    splash pads 43 to one block of 128)."""
    from muajax.models import attention as attention_module

    monkeypatch.setattr(attention_module, "CHUNK_BLOCK", 16)
    params, cfg = load_params(small_checkpoint)
    tokens, mask = ragged_batch(seed=6, lengths=(43, 20, 31))
    # a mean over valid positions, so that gradients are O(1) and float32's rounding of them ~1e-7
    weight = np.random.RandomState(0).randn(*tokens.shape, cfg.vocab_size) * mask[:, :, None] / mask.sum()
    weight = jnp.asarray(weight, jnp.float32)
    want, want_grads = _logits_and_grads(params, cfg.replace(attention="xla"), jnp.asarray(tokens), weight)
    got, grads = _logits_and_grads(params, cfg.replace(attention=impl), jnp.asarray(tokens), weight)
    valid = mask.astype(bool)
    assert np.abs(got - want)[valid].max() <= 2e-5
    scale = max(float(np.abs(np.asarray(b)).max()) for b in jax.tree.leaves(want_grads))
    error = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    assert error <= 2e-5 and scale > 1e-2, (error, scale)


@pytest.mark.parametrize("impl", ["xla", "chunked", "splash"])
def test_packed_rows_give_the_logits_of_the_rows_unpacked(small_checkpoint, impl, monkeypatch):
    """Three sequences packed in one row with trailing padding: attention stays in each
    segment and positions restart, so each segment's logits are its own row's."""
    from muajax.models import attention as attention_module

    monkeypatch.setattr(attention_module, "CHUNK_BLOCK", 16)
    params, cfg = load_params(small_checkpoint)
    cfg = cfg.replace(attention=impl)
    rng = np.random.RandomState(7)
    seqs = [rng.randint(0, cfg.vocab_size, n) for n in (13, 21, 9)]
    packed = np.concatenate(seqs + [np.zeros(5, int)])[None].astype(np.int32)
    segment_ids = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(seqs)] + [np.zeros(5, int)])[None]
    logits, _ = forward(params, cfg, jnp.asarray(packed), segment_ids=jnp.asarray(segment_ids, jnp.int32))
    logits = np.asarray(logits)[0]
    start = 0
    for s in seqs:
        alone = np.asarray(forward(params, cfg.replace(attention="xla"), jnp.asarray(s[None], jnp.int32))[0])[0]
        np.testing.assert_allclose(logits[start:start + len(s)], alone, atol=2e-5, rtol=0)
        start += len(s)


def test_packed_rows_give_the_rl_head_the_unpacked_logprobs(small_checkpoint):
    """`sequence_logprobs(segment_ids=...)`: each segment's token logprobs are its own row's."""
    from muajax.rl.sequence import sequence_logprobs

    params, cfg = load_params(small_checkpoint)
    rng = np.random.RandomState(10)
    seqs = [rng.randint(0, cfg.vocab_size, n).astype(np.int32) for n in (11, 17)]
    packed = jnp.asarray(np.concatenate(seqs + [np.zeros(4, np.int32)])[None])
    segment_ids = jnp.asarray(np.concatenate([np.full(11, 1), np.full(17, 2), np.zeros(4, int)])[None], jnp.int32)
    targets = jnp.roll(packed, -1, axis=1)
    logp, _ = sequence_logprobs(params, cfg, packed, targets, segment_ids=segment_ids, with_entropy=False)
    start = 0
    for s in seqs:
        row = jnp.asarray(s[None])
        alone, _ = sequence_logprobs(params, cfg, row, jnp.roll(row, -1, axis=1), with_entropy=False)
        inner = len(s) - 1  # the last token's target lies in the next segment
        np.testing.assert_allclose(np.asarray(logp)[0, start:start + inner], np.asarray(alone)[0, :inner], atol=2e-5)
        start += len(s)


def test_packed_positions_restart_in_each_segment():
    from muajax.models.qwen3 import packed_positions

    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(packed_positions(seg)), [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 0, 1, 2, 3, 4, 5]])


def test_shared_prefix_forward_with_chunked_attention_equals_the_full_forward(small_checkpoint, monkeypatch):
    """The cache-style mask: a prefix in a KV cache, then rows extending it, in blocks of 16."""
    from muajax.models import attention as attention_module
    from muajax.models.qwen3 import forward_shared_prefix

    monkeypatch.setattr(attention_module, "CHUNK_BLOCK", 16)
    params, cfg = load_params(small_checkpoint)
    rng = np.random.RandomState(8)
    tokens = rng.randint(0, cfg.vocab_size, (3, 45)).astype(np.int32)
    tokens[:, :19] = tokens[0, :19]
    want, _ = forward(params, cfg.replace(attention="xla"), jnp.asarray(tokens), return_hidden=True)
    for impl in ("chunked", "splash"):  # splash has no cache form: it runs chunked here
        got = forward_shared_prefix(params, cfg.replace(attention=impl), jnp.asarray(tokens), 19)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_forward_over_a_cache_keeps_the_reference_attention(small_checkpoint, monkeypatch):
    """The engine's extend and decode run "xla" whatever cfg.attention says."""
    from muajax.models import attention as attention_module

    params, cfg = load_params(small_checkpoint)
    seen = []
    resolve = attention_module.resolve
    monkeypatch.setattr(attention_module, "resolve", lambda impl, **kw: seen.append(impl) or resolve(impl, **kw))
    forward(params, cfg.replace(attention="splash"), jnp.zeros((2, 3), jnp.int32), cache=init_cache(cfg, 2, 8))
    assert seen and set(seen) == {"xla"}


def test_packing_rejects_a_cache_or_a_mask(small_checkpoint):
    params, cfg = load_params(small_checkpoint)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        forward(params, cfg, tokens, segment_ids=jnp.ones((1, 4), jnp.int32), attention_mask=jnp.ones((1, 4)))
    with pytest.raises(ValueError, match="Qwen3Config.attention"):
        cfg.replace(attention="flash")


def test_logits_fp32_runs_the_head_in_float32(tmp_path):
    """bfloat16 weights and activations: with logits_fp32 the logits (model and RL head alike)
    are the float32 dot of the same bfloat16 hidden states and head, not bfloat16 roundings."""
    from muajax.rl.sequence import sequence_logprobs

    path = make_hf_checkpoint(str(tmp_path), seed=12, dtype=torch.bfloat16)
    params, cfg = load_params(path, load_config(path, param_dtype="bfloat16", dtype="bfloat16"))
    tokens = jnp.asarray(ragged_batch(seed=9)[0])
    hidden, _ = forward(params, cfg, tokens, return_hidden=True)
    exact = jnp.einsum("BTD,DV->BTV", hidden.astype(jnp.float32), params["lm_head"].astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    plain, _ = forward(params, cfg, tokens)
    wide, _ = forward(params, cfg.replace(logits_fp32=True), tokens)
    assert plain.dtype == jnp.bfloat16 and wide.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(wide), np.asarray(exact), atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(plain, np.float32) - np.asarray(exact)).max() > 1e-3  # bf16 rounding is visible
    targets = jnp.roll(tokens, -1, axis=1)
    logp, _ = sequence_logprobs(params, cfg.replace(logits_fp32=True), tokens, targets, with_entropy=False)
    want = jnp.take_along_axis(jax.nn.log_softmax(exact, axis=-1), targets[:, :, None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want), atol=1e-5, rtol=0)
