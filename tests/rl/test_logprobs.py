import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from muajax.rl import logprobs_and_entropy, token_entropy, token_logprobs

B, T, V = 3, 7, 50


def random_inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(0, 3.0, size=(B, T, V)) + 20.0).astype(dtype)  # offset: lse must not overflow
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    return logits, targets


def torch_reference(logits, targets, temperature=1.0):
    """float64 log-probs and entropies via torch.log_softmax, plus their autograd."""
    x = torch.tensor(np.asarray(logits, np.float64), requires_grad=True)
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    logp = logp_all.gather(-1, torch.tensor(targets, dtype=torch.int64)[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return x, logp, entropy


def test_token_logprobs_matches_torch_float64():
    logits, targets = random_inputs(0)
    got = token_logprobs(logits, targets)
    assert got.dtype == jnp.float32 and got.shape == (B, T)
    _, want, _ = torch_reference(logits, targets)
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_token_entropy_matches_numpy_float64():
    logits, _ = random_inputs(1)
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    got = token_entropy(logits)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_bf16_logits_give_float32_computed_in_float32():
    logits, targets = random_inputs(2)
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    logp, entropy = logprobs_and_entropy(bf16, targets)
    assert logp.dtype == jnp.float32 and entropy.dtype == jnp.float32
    # The reference sees the same bf16-rounded values; a bf16 computation would be off
    # by ~1e-2 here, far outside the tolerance.
    _, want_logp, want_ent = torch_reference(np.asarray(bf16.astype(jnp.float32)), targets)
    np.testing.assert_allclose(np.asarray(logp), want_logp.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), want_ent.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert token_logprobs(bf16, targets).dtype == jnp.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_and_gradients_match_torch(temperature):
    logits, targets = random_inputs(3)
    rng = np.random.default_rng(9)
    w_lp, w_ent = rng.normal(size=(B, T)).astype(np.float32), rng.normal(size=(B, T)).astype(np.float32)

    def objective(x):
        lp, ent = logprobs_and_entropy(x, targets, temperature)
        return jnp.sum(w_lp * lp) + jnp.sum(w_ent * ent), (lp, ent)

    (_, (lp, ent)), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(logits)
    x, want_lp, want_ent = torch_reference(logits, targets, temperature)
    (torch.sum(torch.tensor(w_lp, dtype=torch.float64) * want_lp)
     + torch.sum(torch.tensor(w_ent, dtype=torch.float64) * want_ent)).backward()
    np.testing.assert_allclose(np.asarray(lp), want_lp.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), want_ent.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=1e-4, atol=1e-6)
    if temperature == 1.0:
        np.testing.assert_array_equal(np.asarray(token_logprobs(logits, targets)), np.asarray(lp))
        np.testing.assert_array_equal(np.asarray(token_entropy(logits)), np.asarray(ent))


def test_token_logprobs_gradient_and_bf16_cotangent_dtype():
    logits, targets = random_inputs(4)
    w = np.random.default_rng(1).normal(size=(B, T)).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(w * token_logprobs(x, targets)))(logits)
    x, want, _ = torch_reference(logits, targets)
    torch.sum(torch.tensor(w, dtype=torch.float64) * want).backward()
    np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=1e-4, atol=1e-6)
    bf16_grad = jax.grad(lambda x: jnp.sum(w * token_logprobs(x, targets)))(jnp.asarray(logits, jnp.bfloat16))
    assert bf16_grad.dtype == jnp.bfloat16


def test_masked_vocabulary_entries_stay_finite():
    # Logits masked to -inf (e.g. disallowed tokens) must not turn the entropy or its
    # gradient into nan; they simply carry no probability.
    logits, targets = random_inputs(5)
    logits[..., :10] = -np.inf
    targets = np.maximum(targets, 10)
    lp, ent = logprobs_and_entropy(logits, targets)
    _, want_lp, want_ent = torch_reference(logits[..., 10:], targets - 10)
    np.testing.assert_allclose(np.asarray(ent), want_ent.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lp), want_lp.detach().numpy(), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(sum(logprobs_and_entropy(x, targets))))(logits)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[..., :10] == 0.0)


def test_at_most_one_float32_logits_sized_temporary():
    b, t, v = 2, 32, 4096
    logits = jax.ShapeDtypeStruct((b, t, v), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    f32_full = b * t * v * 4

    def temp_bytes(fn):
        return jax.jit(fn).lower(logits, targets).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(lambda x, y: logprobs_and_entropy(x, y, 0.7)) < 1.25 * f32_full
    assert temp_bytes(token_logprobs) < 1.25 * f32_full
    # The backward pass keeps no float32 copy of the logits alive from the forward.
    assert temp_bytes(jax.grad(lambda x, y: token_logprobs(x, y).sum())) < 1.25 * f32_full


def test_out_of_range_targets_are_clamped():
    # Masked positions may carry an ignore id; they must read a real logit, not NaN.
    logits, targets = random_inputs(7)
    bad = targets.copy()
    bad[0, :3] = [-100, V, V + 7]
    got = np.asarray(token_logprobs(logits, bad))
    clamped = np.asarray(token_logprobs(logits, np.clip(bad, 0, V - 1)))
    np.testing.assert_array_equal(got, clamped)
    np.testing.assert_array_equal(got[1:], np.asarray(token_logprobs(logits, targets))[1:])


def test_invalid_inputs_raise():
    logits, targets = random_inputs(6)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(logits, targets, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(logits, targets, -1.0)
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(logits[0], targets[0])
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(logits, targets[:, :-1])
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(logits, targets.astype(np.float32))
    with pytest.raises(ValueError, match="logits"):
        token_entropy(logits[0])
