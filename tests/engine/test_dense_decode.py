"""The pure-JAX decode's two ways of keeping a chunk's new tokens: a tail beside the gathered
cache (one or two rows) and writes into that cache (wider batches) give the same tokens,
logprobs and cached keys and values."""
import numpy as np
import pytest

from muajax.engine import dense_decode
from muajax.engine.engine import Engine, SamplingParams
from muajax.models.hf import load_params


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return load_params(hf_checkpoint(seed=5))


def converse(params, cfg, slots: int, prompt, turn, temperature):
    """One conversation in an engine of `slots` slots (the others hold decoys that decode
    beside it): two generations around a user turn, over several decode chunks each."""
    engine = Engine(params, cfg, num_slots=slots, max_len=96, stop_ids=(), decode_chunk=4, page_size=8)
    rng = np.random.RandomState(3)
    mine = engine.open(prompt, seed=42)
    others = [engine.open([int(t) for t in rng.randint(8, 256, 5 + 7 * i)], seed=i) for i in range(slots - 1)]
    sampling = SamplingParams(temperature=temperature, max_new_tokens=11)
    out = []
    for extra in (None, turn):
        if extra is not None:
            engine.append(mine, extra)
        gens = engine.generate([mine, *others], sampling)
        out.append((gens[mine].tokens, np.asarray(gens[mine].logprobs)))
    engine.flush()
    return out, engine.cached_kv(mine)


@pytest.mark.parametrize("temperature,stacked", [(0.0, False), (1.0, False), (0.0, True)])
def test_the_tail_and_in_place_writes_agree(model, temperature, stacked, monkeypatch):
    params, cfg = model
    if stacked:  # the layer scan over stacked weights and caches, as off a single CPU device
        monkeypatch.setattr(Engine, "_layer_views", lambda self: None)
    rng = np.random.RandomState(0)
    prompt, turn = ([int(t) for t in rng.randint(8, 256, n)] for n in (13, 6))
    assert dense_decode.TAIL_MAX_ROWS < 4
    tail, tail_kv = converse(params, cfg, 1, prompt, turn, temperature)
    wide, wide_kv = converse(params, cfg, 4, prompt, turn, temperature)
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(tail, wide):
        assert tokens_a == tokens_b and len(tokens_a) == 11
        np.testing.assert_allclose(logprobs_a, logprobs_b, atol=1e-5)
    assert len(tokens_a) and tail_kv[0].shape == wide_kv[0].shape == (cfg.num_layers, cfg.num_kv_heads, 13 + 11 + 6 + 11, cfg.head_dim)
    for a, b in zip(tail_kv, wide_kv):
        np.testing.assert_allclose(a, b, atol=1e-5)
