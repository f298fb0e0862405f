"""`sequence_logprobs` with `logits_chunk`: the LM head and log-softmax over strided chunks
of positions give the logprobs, entropies and gradients of the whole [T, V] at once, for
any length (a chunk count that divides it, or padding), and never hold [T, V] at once."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models.qwen3 import init_params
from muajax.rl.sequence import chunk_count, sequence_logprobs
from tests.support.tiny_models import ONE_LAYER_CONFIG

CFG = ONE_LAYER_CONFIG.replace(vocab_size=512, attention="xla")


def test_chunk_count_divides_the_length_when_it_can():
    assert chunk_count(4096, None) == 1 and chunk_count(512, 1024) == 1
    assert chunk_count(4096, 1024) == 4
    assert chunk_count(1536, 1024) == 2  # two chunks of 768
    assert chunk_count(1536, 1024, multiple=4) == 2 and chunk_count(96, 20, multiple=4) == 6  # 6 x 16
    assert chunk_count(37, 8) == 5  # 37 is prime: five chunks of 8, padded to 40


@pytest.mark.parametrize("t, chunk", [(48, 16), (37, 8)], ids=["divides", "padded"])
def test_chunked_logits_equal_the_whole_head(t, chunk):
    params = init_params(CFG, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, t)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    weights = jnp.asarray(rng.normal(size=(2, t)), jnp.float32)

    def loss(p, logits_chunk):
        logp, ent = sequence_logprobs(p, CFG, tokens, targets, temperature=0.7, logits_chunk=logits_chunk)
        return jnp.sum(logp * weights) + jnp.sum(ent * weights[::-1]), (logp, ent)

    (whole, (logp, ent)), grads = jax.jit(jax.value_and_grad(lambda p: loss(p, None), has_aux=True))(params)
    (chunked, (logp_c, ent_c)), grads_c = jax.jit(jax.value_and_grad(lambda p: loss(p, chunk), has_aux=True))(params)
    assert logp_c.shape == (2, t) and ent_c.shape == (2, t)
    np.testing.assert_allclose(np.asarray(logp_c), np.asarray(logp), rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(ent_c), np.asarray(ent), rtol=0, atol=2e-6)
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6 * max(1.0, float(jnp.abs(b).max())))


def test_chunks_bound_the_logits_memory():
    """The gradient's temporaries with chunks of 16 positions stay far below one [B, T, V] float32 block."""
    cfg = CFG.replace(vocab_size=32768)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def temp_bytes(logits_chunk):
        fn = lambda p, tok: jnp.sum(sequence_logprobs(p, cfg, tok, tok, logits_chunk=logits_chunk,
                                                      with_entropy=False)[0])
        return jax.jit(jax.grad(fn)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    full_block = 2 * 256 * 32768 * 4
    assert temp_bytes(None) >= full_block
    assert temp_bytes(16) < full_block / 4
