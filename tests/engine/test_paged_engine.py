"""The engine's paging: pages come back, a small pool preempts without losing anything, and a
shared prefix changes nothing but the work done."""
import jax
import numpy as np
import pytest

from muajax.engine.engine import Engine, SamplingParams
from muajax.models.hf import load_params

STOP = 7


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    params, cfg = load_params(tiny_hf_dir)
    return params, cfg


def prompts(seed, lengths):
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(8, 256, n)] for n in lengths]


def test_pages_come_back_and_are_reused(model):
    params, cfg = model
    engine = Engine(params, cfg, num_slots=3, max_len=64, stop_ids=(STOP,), decode_chunk=8, page_size=8)
    pool = engine.pages.pool
    used = []
    for round_ in range(2):
        slots = [engine.open(p) for p in prompts(round_, (9, 20, 3))]
        engine.generate(slots, SamplingParams(temperature=0.0, max_new_tokens=12))
        used.append({page for s in slots for page in engine._slots[s].seq.pages})
        assert pool.in_use == len(used[-1]) > 0
        for slot in slots:
            engine.release(slot)
        assert pool.in_use == 0
    # the second round runs on the pages the first gave back (the pool has 24)
    fewer, more = sorted(used, key=len)
    assert fewer <= more and engine.stats["peak_pages"] == len(more)
    assert engine.stats["preemptions"] == 0


def run_conversations(engine, turns):
    """Two turns per conversation (a generation, a user turn, a generation); returns every
    generation's tokens and logprobs, and the final caches."""
    slots = [engine.open(p, seed=i) for i, p in enumerate(prompts(20, (30, 11, 25, 17, 6)))]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=14)
    out = [engine.generate(slots, sampling)]
    for slot, turn in zip(slots, turns):
        engine.append(slot, turn)
    out.append(engine.generate(slots, sampling))
    engine.flush()
    caches = [engine.cached_kv(slot) for slot in slots]
    return [(g.tokens, g.logprobs) for gens in out for g in gens.values()], caches


def test_small_pool_preempts_and_completes_every_conversation_like_a_big_pool(model):
    params, cfg = model
    turns = prompts(21, (5, 9, 3, 12, 7))
    common = {"num_slots": 5, "max_len": 96, "stop_ids": (STOP,), "decode_chunk": 6, "page_size": 8,
              "extend_widths": (8, 16)}
    big = Engine(params, cfg, **common)
    want, want_caches = run_conversations(big, turns)
    assert big.stats["preemptions"] == 0
    # 12 pages hold one max_len conversation; the five need about 25
    small = Engine(params, cfg, kv_cache_tokens=96, **common)
    got, got_caches = run_conversations(small, turns)
    assert small.stats["preemptions"] > 0
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    # the pool holds only some of the conversations at the end; those it holds are exact
    resident = [(g, w) for g, w in zip(got_caches, want_caches) if g[0].shape[2]]
    assert 0 < len(resident) < len(want_caches)
    for got_kv, want_kv in resident:
        for g, w in zip(got_kv, want_kv):
            np.testing.assert_allclose(g, w, atol=2e-5)


def test_a_waiting_conversation_starts_when_pages_free_up(model):
    params, cfg = model
    engine = Engine(params, cfg, num_slots=2, max_len=40, stop_ids=(), decode_chunk=4, page_size=8,
                    kv_cache_tokens=40)
    first, second = (engine.open(p) for p in prompts(30, (30, 30)))
    engine.start(first, SamplingParams(temperature=0.0, max_new_tokens=8))
    engine.start(second, SamplingParams(temperature=0.0, max_new_tokens=8))
    engine.step()
    # five pages: the older conversation runs, the newer one has none yet
    assert engine._slots[first].seq.pages and not engine._slots[second].seq.pages
    done = {}
    while len(done) < 2:
        done.update({g.slot: g for g in engine.step()})
        if first in done and first in engine._slots:
            engine.release(first)
    assert [len(done[s].tokens) for s in (first, second)] == [8, 8]


def test_shared_prefix_gives_the_same_tokens_and_logprobs(model):
    params, cfg = model
    prefix = prompts(40, (21,))[0]  # 2 full pages of 8 shared, 5 tokens each conversation extends itself
    rests = prompts(41, (4, 9, 1))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    common = {"num_slots": 4, "max_len": 80, "stop_ids": (STOP,), "decode_chunk": 5, "page_size": 8}

    plain = Engine(params, cfg, **common)
    want = plain.generate([plain.open(prefix + r, seed=i) for i, r in enumerate(rests)], sampling)

    shared = Engine(params, cfg, **common)
    shared.register_prefix(prefix)
    slots = [shared.open(prefix + r, seed=i) for i, r in enumerate(rests)]
    got = shared.generate(slots, sampling)
    assert shared.stats["prefix_hits"] == 3 and shared.stats["prefix_prefill_tokens"] == 16
    assert shared.stats["extend_tokens"] == plain.stats["extend_tokens"] - 2 * 16
    first_pages = {tuple(shared._slots[s].seq.pages[:2]) for s in slots}
    assert len(first_pages) == 1  # every conversation reads the same two pages
    pool = shared.pages.pool
    assert [pool.refcount(0, p) for p in next(iter(first_pages))] == [4, 4]  # the prefix + 3 conversations
    for g, w in zip(got.values(), want.values()):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)

    for slot in slots:
        shared.release(slot)
    other = shared.open(prompts(42, (30,))[0])  # does not start with the prefix: shares nothing
    shared.flush()
    assert shared.stats["prefix_hits"] == 3 and pool.in_use == 2 + 4
    shared.release(other)
    shared.open(prefix + rests[0])
    shared.flush()
    assert shared.stats["prefix_prefill_tokens"] == 16  # same params: computed once
    shared.params = jax.tree.map(lambda x: x + 0, params)  # new params: the prefix is computed again
    shared.open(prefix + rests[1])
    shared.flush()
    assert shared.stats["prefix_prefill_tokens"] == 32 and shared.stats["prefix_hits"] == 5


def test_bad_pool_settings_are_refused(model):
    params, cfg = model
    with pytest.raises(ValueError, match="fewer than one max_len"):
        Engine(params, cfg, num_slots=2, max_len=64, page_size=8, kv_cache_tokens=40)
    with pytest.raises(ValueError, match="head_dim % 128"):
        Engine(params, cfg, num_slots=2, max_len=64, attention="pallas")
    engine = Engine(params, cfg, num_slots=1, max_len=64, page_size=8)
    with pytest.raises(ValueError, match="prefix needs"):
        engine.register_prefix([])
