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


@pytest.mark.parametrize("per_layer", [False, True])
def test_keys_positions_last_gather_and_scatter_move_the_same_values(per_layer):
    """The decode's dense cache lays keys out [.., K, H, positions]: gathered, they are the
    default layout's keys transposed, and scattered back, they land in the same page slots."""
    import jax.numpy as jnp

    from muajax.engine import kv_cache
    from tests.support.tiny_models import TINY_CONFIG
    rng = np.random.RandomState(0)
    layers, pages, size, kv, dim = TINY_CONFIG.num_layers, 24, 4, TINY_CONFIG.num_kv_heads, TINY_CONFIG.head_dim
    pool = jnp.asarray(rng.randn(layers, pages, size, 2 * kv, dim), jnp.float32)
    table = jnp.asarray(np.stack([rng.permutation(pages)[:5] for _ in range(3)]), jnp.int32)
    lengths = jnp.asarray([3, 17, 20], jnp.int32)
    spec = kv_cache.PoolSpec(TINY_CONFIG, None, pages, size, 5)
    plain = kv_cache.gather_dense(spec, pool, table, lengths, 5, per_layer)
    last = kv_cache.gather_dense(spec, pool, table, lengths, 5, per_layer, keys_last=True)
    assert last.max_len == plain.max_len == 20
    for a, b in zip(plain.k if per_layer else [plain.k], last.k if per_layer else [last.k]):
        np.testing.assert_array_equal(np.swapaxes(np.asarray(a), -1, -2), np.asarray(b))
    # new values in positions 2..5 of each row, written back from each layout
    start, count = jnp.asarray([1, 2, 0], jnp.int32), jnp.asarray([3, 4, 2], jnp.int32)
    bump = lambda x: x + 1.0
    moved = [kv_cache.scatter_dense(spec, jnp.zeros_like(pool), kv_cache.KVCache(
        *(tuple(map(bump, c)) if per_layer else bump(c) for c in (cache.k, cache.v)), lengths),
        table, start, count, 4, keys_last=keys_last) for cache, keys_last in ((plain, False), (last, True))]
    np.testing.assert_array_equal(np.asarray(moved[0]), np.asarray(moved[1]))
    assert np.count_nonzero(np.asarray(moved[0])) == (3 + 4 + 2) * layers * 2 * kv * dim
