"""Packed extends and token tiles (`Engine(deterministic=True)`): a conversation gives the same
bits alone and beside others, whatever the buckets of its calls; extends compute the tiles
they fill, not rows x the widest width; the in-place paged attention agrees with the model's."""
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.engine import kv_cache
from muajax.engine.engine import Engine, SamplingParams
from muajax.engine.paged_reference import attend_pages
from muajax.models.attention import attention
from tests.support.tiny_models import (
    ENGINE_CONFIG,
    MOE_CONFIG,
    TINY_CONFIG,
    engine_params,
    random_ids,
)

CFG = ENGINE_CONFIG
ids = random_ids


@pytest.fixture(scope="module")
def params():
    return engine_params()


def conversation_with(params, mates, cfg=CFG, **engine_kwargs):
    """Two sampled turns of one conversation while `mates` (prompt lengths) extend and decode
    beside it: more tiles than one call holds when there are many."""
    rng = np.random.RandomState(1)
    engine = Engine(params, cfg, num_slots=64, max_len=1024, stop_ids=(), decode_chunk=6, page_size=16,
                    max_extend_tokens=512, **engine_kwargs)
    ours = engine.open(ids(rng, 21), seed=5)
    turn = ids(rng, 13)
    others = [engine.open(ids(rng, int(n)), seed=10 + i) for i, n in enumerate(mates)]
    for i, slot in enumerate(others):
        engine.append(slot, ids(rng, 3 + 7 * i % 50))
        engine.start(slot, SamplingParams(temperature=1.0, max_new_tokens=4 + 9 * i % 40))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=25)
    first = engine.generate([ours], sampling)[ours]
    engine.append(ours, turn)
    for slot in others:  # the mates' next turns are extended beside ours
        if not engine.is_generating(slot):
            engine.append(slot, ids(rng, 40))
            engine.start(slot, SamplingParams(temperature=1.0, max_new_tokens=11))
    second = engine.generate([ours], sampling)[ours]
    engine.ours = ours
    return first.tokens + second.tokens, np.asarray(first.logprobs + second.logprobs), engine


MATES = {1: [5], 7: list(np.random.RandomState(7).randint(1, 700, 7)),
         63: list(np.random.RandomState(8).randint(1, 300, 63))}


ALONE = {}


@pytest.mark.parametrize("attention_path", ["reference", "paged"])
@pytest.mark.parametrize("count", sorted(MATES))
def test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others(params, attention_path, count):
    if attention_path not in ALONE:
        ALONE[attention_path] = conversation_with(params, [], deterministic=True, attention=attention_path)
    alone_tokens, alone_logprobs, alone = ALONE[attention_path]
    tokens, logprobs, engine = conversation_with(params, MATES[count], deterministic=True, attention=attention_path)
    assert tokens == alone_tokens
    np.testing.assert_array_equal(logprobs, alone_logprobs)
    # the mates changed how the calls were cut, and their buckets
    assert engine.stats["extend_positions"] > alone.stats["extend_positions"]
    # beside 7 or 63 others its decode calls held more tiles (one mate shares its tile of 2)
    assert engine.stats["decode_positions"] > alone.stats["decode_positions"] or count == 1


MOE = MOE_CONFIG.replace(vocab_size=ENGINE_CONFIG.vocab_size)


@pytest.mark.parametrize("attention_path", ["reference", "paged"])
def test_with_token_tiles_a_mixture_of_experts_conversation_is_bitwise_the_same_beside_63_others(attention_path):
    """The same for a mixture of experts, and its recorded experts too (its experts' FFN
    groups the call's tokens by expert: a tile's tokens are grouped among themselves)."""
    weights = engine_params(MOE)
    kwargs = dict(cfg=MOE, deterministic=True, attention=attention_path, record_experts=True)
    alone_tokens, alone_logprobs, alone = conversation_with(weights, [], **kwargs)
    tokens, logprobs, engine = conversation_with(weights, MATES[63], **kwargs)
    assert tokens == alone_tokens
    np.testing.assert_array_equal(logprobs, alone_logprobs)
    np.testing.assert_array_equal(engine.experts(engine.ours), alone.experts(alone.ours))
    assert engine.stats["extend_positions"] > alone.stats["extend_positions"]


def test_without_token_tiles_the_bits_follow_the_call(params):
    """Why token tiles exist: packed calls with each dot over the whole call round a row
    differently beside others (XLA:CPU's dots and row reductions change with the row count).
    If this starts failing, the test above proves less."""
    _, alone, _ = conversation_with(params, [])
    _, beside, _ = conversation_with(params, MATES[63])
    assert not np.array_equal(alone, beside)
    np.testing.assert_allclose(alone, beside, atol=1e-5)


def test_packed_extends_compute_the_tiles_they_fill_and_match_fixed_rows(params):
    rng = np.random.RandomState(2)
    prompts = [ids(rng, n) for n in (50, 300, 7)]
    engines = {name: Engine(params, CFG, num_slots=4, max_len=512, stop_ids=(), page_size=16, **kw)
               for name, kw in (("packed", dict(deterministic=True)), ("fixed", dict(batch_rows=4)))}
    for engine in engines.values():
        slots = [engine.open(p) for p in prompts]
        engine.flush()
    packed, fixed = engines["packed"].stats, engines["fixed"].stats
    assert packed["extend_tokens"] == fixed["extend_tokens"] == 357
    assert packed["extend_positions"] == 16 * (4 + 19 + 1)  # each prompt's own tiles of 16
    assert fixed["extend_positions"] >= 4 * 512  # 4 rows at the widest width a prompt needs
    for slot in slots:
        for got, want in zip(engines["packed"].cached_kv(slot), engines["fixed"].cached_kv(slot)):
            np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_attention_agrees_with_the_models_attention_over_a_dense_copy(dtype):
    """The decode path on GPU and every extend off TPU read pages in place, block by block;
    the reference gathers each row's pages into a dense cache and runs the model's attention."""
    rng = np.random.RandomState(0)
    layers, pages, size, kv, heads, dim, rows, width = 2, 40, 8, 2, 4, 16, 5, 3
    pool = jnp.asarray(rng.randn(layers, pages, size, 2 * kv, dim), dtype)
    table = jnp.asarray(np.stack([rng.permutation(pages)[:12] for _ in range(rows)]), jnp.int32)
    kv_lens = jnp.asarray([1, 9, 40, 96, 57], jnp.int32)  # up to the page table's 12 pages
    q_index = kv_lens[:, None] - width + jnp.arange(width)[None, :]
    q = jnp.asarray(rng.randn(rows, width, heads, dim), dtype)
    got = attend_pages(q, pool, 1, table, jnp.maximum(q_index, 0), kv_lens, pages_per_block=4)
    spec = kv_cache.PoolSpec(CFG, None, pages, size, 12)
    dense = kv_cache.gather_dense(spec, pool[1:2], table, kv_lens, 12)
    valid = jnp.arange(12 * size)[None, :] < kv_lens[:, None]
    want = attention(q, dense.k[0], dense.v[0], implementation="xla", q_index=jnp.maximum(q_index, 0),
                     kv_valid=valid)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_a_conversation_alone_in_a_one_tile_call_rounds_as_beside_others():
    """The embedded default's shape (hidden 128, head_dim 32, tied head in float32): XLA
    compiled a one-tile call's loop differently, and a conversation alone (its decode in one
    tile) drew other logprob bits than beside 4 others (several tiles), which made two
    concurrent runs of `python -m muajax.train` end with different params. Calls now have at
    least `batching.MIN_TILES` tiles."""
    cfg = TINY_CONFIG.replace(vocab_size=512, hidden_size=128, intermediate_size=384, head_dim=32,
                              tie_word_embeddings=True, logits_fp32=True)
    weights = engine_params(cfg)

    def ours_beside(mates: int):
        engine = Engine(weights, cfg, num_slots=8, max_len=512, stop_ids=(), decode_chunk=16, page_size=16,
                        deterministic=True)
        others = [engine.open([int(t) for t in np.random.RandomState(10 + i).randint(0, 512, 300)], seed=20 + i)
                  for i in range(mates)]
        ours = engine.open([int(t) for t in np.random.RandomState(1).randint(0, 512, 230)], seed=5)
        for slot in others:
            engine.start(slot, SamplingParams(temperature=1.0, max_new_tokens=100))
        got = engine.generate([ours], SamplingParams(temperature=1.0, max_new_tokens=40))[ours]
        return got.tokens, np.asarray(got.logprobs)

    alone_tokens, alone_logprobs = ours_beside(0)
    tokens, logprobs = ours_beside(4)
    assert tokens == alone_tokens
    np.testing.assert_array_equal(logprobs, alone_logprobs)
