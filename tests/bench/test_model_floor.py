"""The model-step floor computes this model's decode step: transformers' logits, given the same cache.

If the floor skipped any of the step's arithmetic (a norm, the rotary embedding, the
attention's own key), its logits would leave transformers'; then it would not be a floor
for the engine's step but for a smaller one.
"""
import numpy as np
import torch

from muajax.bench import model_floor
from tests.support.tiny_models import load_hf_model


def _hf_step(hf, prompt: np.ndarray, token: np.ndarray):
    """transformers' cache after `prompt`, and its logits for `token` [B] next."""
    with torch.no_grad():
        out = hf(torch.from_numpy(prompt), use_cache=True)
        cache = out.past_key_values
        step = hf(torch.from_numpy(token[:, None]), past_key_values=cache, use_cache=True)
    layers = [(cache.layers[i].keys[:, :, :-1].numpy(), cache.layers[i].values[:, :, :-1].numpy())
              for i in range(len(hf.model.layers))]
    return layers, step.logits[:, -1].numpy()


def test_the_floor_step_gives_transformers_logits_over_the_same_cache(hf_checkpoint):
    hf = load_hf_model(hf_checkpoint())
    rng = np.random.RandomState(0)
    prompt = rng.randint(0, hf.config.vocab_size, size=(3, 7)).astype(np.int64)
    token = rng.randint(0, hf.config.vocab_size, size=(3,)).astype(np.int64)
    caches, expected = _hf_step(hf, prompt, token)
    shape = model_floor.model_shape(hf.config)
    weights = model_floor.model_weights(hf)
    logits, new = model_floor.step_logits(weights, caches, token.astype(np.int32), prompt.shape[1], shape)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-4)
    by_position = [(k.transpose(0, 1, 3, 2), v) for k, v in caches]  # keys [B, K, H, S]
    logits_t, _ = model_floor.step_logits(weights, by_position, token.astype(np.int32), prompt.shape[1],
                                          shape._replace(keys_by_position=True))
    np.testing.assert_allclose(np.asarray(logits_t), expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the new key and value are the ones transformers caches
        full = hf(torch.from_numpy(np.concatenate([prompt, token[:, None]], 1)), use_cache=True).past_key_values
    np.testing.assert_allclose(np.asarray(new[0][0]), full.layers[0].keys[:, :, -1].numpy(), rtol=1e-4, atol=1e-5)


def test_the_floor_program_runs_greedy_steps_and_returns_logprobs(hf_checkpoint):
    hf = load_hf_model(hf_checkpoint())
    shape = model_floor.model_shape(hf.config)
    run = model_floor.xla_model_step(model_floor.model_weights(hf), shape, batch=2, context=5, steps=3, calls=2)
    token, logprob, new = run()
    assert token.shape == (2,) and token.dtype == np.int32
    assert np.all(np.asarray(logprob) <= 0) and np.all(np.isfinite(np.asarray(logprob)))
    assert len(new) == len(hf.model.layers) and new[0][0].shape == (2, shape.kv_heads, shape.head_dim)
    # the loop's steps feed each token to the next: three greedy steps from token 0 by hand
    w, caches, tokens = run.args
    for _ in range(3):
        logits, _ = model_floor.step_logits(w, caches, tokens, 4, shape)
        tokens = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(token), tokens)


def test_the_stream_floor_reads_every_byte_a_decode_step_reads_and_sums_them(hf_checkpoint):
    """Every weight the step multiplies (not the embedding, of which a step reads one row)
    and each layer's keys and values over the context: a missing array would make the floor
    of a step's growth a floor for a lighter step."""
    hf = load_hf_model(hf_checkpoint())
    shape, weights = model_floor.model_shape(hf.config), model_floor.model_weights(hf)
    batch, context = 2, 9
    run = model_floor.xla_stream_step(weights, shape, batch, context)
    (arrays,) = run.args
    layer_bytes = sum(a.nbytes for layer in weights["layers"] for a in layer.values())
    cache_bytes = 2 * len(weights["layers"]) * batch * shape.kv_heads * context * shape.head_dim * 4
    assert sum(a.nbytes for a in arrays) == layer_bytes + weights["norm"].nbytes + weights["head"].nbytes + cache_bytes
    np.testing.assert_allclose(float(run()), sum(float(np.sum(np.asarray(a, np.float64))) for a in arrays), rtol=1e-4)
