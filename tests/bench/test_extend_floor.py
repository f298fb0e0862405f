"""The extend floor computes this model's extend: transformers' logits and cache for a turn's
new tokens over the same history.

If the floor skipped any of the extend's arithmetic (causality among the new tokens, the
rotary positions after the history, a norm), its numbers would leave transformers'; then it
would be the floor of a smaller computation than the engine's extend.
"""
import numpy as np
import torch

from muajax.bench import extend_floor, model_floor
from tests.support.tiny_models import load_hf_model


def _hf_turn(hf, prompt: np.ndarray, turn: np.ndarray):
    """transformers' cache after `prompt` (per layer keys, values [B, K, S, H]), its logits
    for the `turn` tokens fed next, and its cache entries for those tokens."""
    with torch.no_grad():
        cache = hf(torch.from_numpy(prompt), use_cache=True).past_key_values
        history = [(cache.layers[i].keys.clone().numpy(), cache.layers[i].values.clone().numpy())
                   for i in range(len(hf.model.layers))]
        out = hf(torch.from_numpy(turn), past_key_values=cache, use_cache=True)
    s = prompt.shape[1]
    new = [(out.past_key_values.layers[i].keys[:, :, s:].numpy(), out.past_key_values.layers[i].values[:, :, s:].numpy())
           for i in range(len(hf.model.layers))]
    return history, out.logits.numpy(), new


def test_the_extend_floor_gives_transformers_logits_and_cache_for_a_turn(hf_checkpoint):
    hf = load_hf_model(hf_checkpoint())
    rng = np.random.RandomState(0)
    prompt = rng.randint(0, hf.config.vocab_size, size=(3, 7)).astype(np.int64)
    turn = rng.randint(0, hf.config.vocab_size, size=(3, 5)).astype(np.int64)
    history, expected, expected_new = _hf_turn(hf, prompt, turn)
    shape, weights = model_floor.model_shape(hf.config), model_floor.model_weights(hf)
    logits, new = extend_floor.extend_logits(weights, history, turn.astype(np.int32), prompt.shape[1], shape)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-4)
    for (k, v), (ek, ev) in zip(new, expected_new):  # ours [B, T, K, H], transformers' [B, K, T, H]
        np.testing.assert_allclose(np.asarray(k).transpose(0, 2, 1, 3), ek, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v).transpose(0, 2, 1, 3), ev, rtol=1e-4, atol=1e-5)


def test_the_extend_floor_program_returns_every_layers_new_keys_and_values(hf_checkpoint):
    hf = load_hf_model(hf_checkpoint())
    shape, weights = model_floor.model_shape(hf.config), model_floor.model_weights(hf)
    run = extend_floor.xla_model_extend(weights, shape, batch=2, history=9, tokens=4)
    new = run()
    assert len(new) == len(hf.model.layers)
    assert new[0][0].shape == (2, 4, shape.kv_heads, shape.head_dim)
    w, caches, ids = run.args  # the program's keys are the extend's over its own cache
    _, by_hand = extend_floor.extend(w, caches, ids, 9, shape)
    np.testing.assert_allclose(np.asarray(new[-1][1]), np.asarray(by_hand[-1][1]), rtol=1e-5, atol=1e-6)
