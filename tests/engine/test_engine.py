"""The engine against transformers and against one full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from muajax.engine import batching
from muajax.engine.engine import Engine, SamplingParams
from muajax.engine.sampling import sample_tokens
from muajax.models.hf import load_params
from muajax.models.qwen3 import forward_jit
from tests.support.tiny_models import load_hf_model

STOP = 7


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    params, cfg = load_params(tiny_hf_dir)
    return tiny_hf_dir, params, cfg


def prompts(seed, lengths):
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(8, 256, n)] for n in lengths]


def test_greedy_equals_transformers_generate(model):
    path, params, cfg = model
    hf = load_hf_model(path)
    engine = Engine(params, cfg, num_slots=4, max_len=80, stop_ids=(STOP,), decode_chunk=8, extend_widths=(8, 32))
    batch = prompts(0, (5, 19, 3, 40))  # 40 > the widest extend bucket: split into several extends
    slots = [engine.open(p) for p in batch]
    gens = engine.generate(slots, SamplingParams(temperature=0.0, max_new_tokens=24))
    for prompt, slot in zip(batch, slots):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=STOP,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert gens[slot].tokens == want
        assert gens[slot].finish_reason == ("stop" if want[-1] == STOP else "length")


def full_logprobs(params, cfg, sequence, temperature):
    logits, _ = forward_jit(params, cfg, jnp.asarray([sequence]))
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float64) / temperature, axis=-1)
    return np.asarray([logp[i - 1, sequence[i]] for i in range(1, len(sequence))])



def test_stacked_decode_equals_per_layer_views(model):
    """Without per-layer weight views (a mesh, an accelerator) decode scans the stacked
    layers: same tokens and logprobs as the unrolled CPU form."""
    _, params, cfg = model
    out = {}
    for views in (True, False):
        engine = Engine(params, cfg, num_slots=2, max_len=64, stop_ids=(STOP,), decode_chunk=8)
        if not views:
            engine._layer_views = lambda: None
        slots = [engine.open(p, seed=i) for i, p in enumerate(prompts(8, (6, 13)))]
        out[views] = engine.generate(slots, SamplingParams(temperature=1.0, max_new_tokens=20))
    for slot in out[True]:
        assert out[False][slot].tokens == out[True][slot].tokens
        np.testing.assert_allclose(out[False][slot].logprobs, out[True][slot].logprobs, atol=1e-5)

def test_sampled_logprobs_equal_full_forward(model):
    _, params, cfg = model
    engine = Engine(params, cfg, num_slots=3, max_len=96, stop_ids=(STOP,), decode_chunk=5)
    batch = prompts(1, (6, 13, 9))
    slots = [engine.open(p, seed=i) for i, p in enumerate(batch)]
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=30), SamplingParams(temperature=0.7, max_new_tokens=30),
                SamplingParams(temperature=1.3, top_p=0.9, top_k=50, max_new_tokens=30)]
    gens = engine.generate(slots, sampling)
    for prompt, slot, sp in zip(batch, slots, sampling):
        g = gens[slot]
        want = full_logprobs(params, cfg, prompt + g.tokens, sp.temperature)[len(prompt) - 1:]
        np.testing.assert_allclose(g.logprobs, want, atol=1e-4, rtol=0)


def test_multiturn_cache_equals_one_full_forward_and_reuse_is_clean(model):
    _, params, cfg = model
    engine = Engine(params, cfg, num_slots=2, max_len=128, stop_ids=(STOP,), decode_chunk=4, extend_widths=(16,))
    other = engine.open(prompts(9, (30,))[0], seed=5)  # a neighbour that must not interfere
    sequence = prompts(2, (10,))[0]
    slot = engine.open(sequence, seed=3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    for turn in (None, prompts(3, (7,))[0], prompts(4, (21,))[0]):  # tool turn, then user turn
        if turn is not None:
            engine.append(slot, turn)
            sequence = sequence + turn
        sequence = sequence + engine.generate([slot, other], sp)[slot].tokens
    engine.flush()
    assert engine.length(slot) == len(sequence)

    reference = Engine(params, cfg, num_slots=1, max_len=128, extend_widths=(128,))
    ref_slot = reference.open(sequence)
    reference.flush()
    n = len(sequence)
    for got, want in zip(engine.cached_kv(slot), reference.cached_kv(ref_slot)):
        assert got.shape[2] == want.shape[2] == n
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)

    # A reused slot must behave exactly like a fresh engine.
    engine.release(slot)
    fresh_prompt = prompts(6, (9,))[0]
    reused = engine.open(fresh_prompt, seed=42)
    assert reused == slot
    got = engine.generate([reused], SamplingParams(temperature=1.0, max_new_tokens=15))[reused]
    clean = Engine(params, cfg, num_slots=2, max_len=128, stop_ids=(STOP,), decode_chunk=4)
    clean_slot = clean.open(fresh_prompt, seed=42)
    want = clean.generate([clean_slot], SamplingParams(temperature=1.0, max_new_tokens=15))[clean_slot]
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_sampling_reproducible_whatever_other_slots_do(model):
    _, params, cfg = model
    prompt = prompts(7, (8,))[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=20)

    alone = Engine(params, cfg, num_slots=4, max_len=64, stop_ids=(STOP,), decode_chunk=6)
    want = alone.generate([alone.open(prompt, seed=99)], sp)

    busy = Engine(params, cfg, num_slots=4, max_len=64, stop_ids=(STOP,), decode_chunk=3)
    neighbours = [busy.open(p, seed=i) for i, p in enumerate(prompts(8, (3, 17)))]
    busy.start(neighbours[0], SamplingParams(temperature=0.5, top_k=5, max_new_tokens=9))
    busy.step()  # the neighbour is mid-generation when ours joins
    slot = busy.open(prompt, seed=99)
    busy.start(neighbours[1], SamplingParams(temperature=1.0, max_new_tokens=30))
    got = busy.generate([slot], sp)[slot]
    only = next(iter(want.values()))
    assert got.tokens == only.tokens
    np.testing.assert_allclose(got.logprobs, only.logprobs, atol=1e-5)
    other_seed = Engine(params, cfg, num_slots=1, max_len=64, stop_ids=(STOP,))
    differs = other_seed.generate([other_seed.open(prompt, seed=100)], sp)
    assert next(iter(differs.values())).tokens != only.tokens


def test_waiting_slots_cost_no_decode_work(model):
    _, params, cfg = model
    engine = Engine(params, cfg, num_slots=8, max_len=64, stop_ids=(STOP,), decode_chunk=4)
    slots = [engine.open(p) for p in prompts(10, (4,) * 8)]
    engine.generate(slots[:1], SamplingParams(temperature=0.0, max_new_tokens=8))
    # one running conversation out of eight: the decode batch is the 1-row bucket
    assert engine.stats["decode_tokens"] == 8
    assert batching.bucket(1, engine.batch_buckets) == 1 and batching.bucket(3, engine.batch_buckets) == 4


def test_sampler_filters():
    logits = jnp.asarray([[0.0, 3.0, 2.9, -1.0], [1.0, 0.5, 0.2, 0.1]])
    keys = jax.vmap(jax.random.key)(jnp.arange(2))
    for _ in range(3):
        tok, lp = sample_tokens(logits, keys, jnp.asarray([1.0, 1.0]), jnp.asarray([1.0, 1.0]), jnp.asarray([1, 1]))
        assert tok.tolist() == [1, 0]  # top-k=1 is greedy
        tok, _ = sample_tokens(logits, keys, jnp.asarray([1.0, 1.0]), jnp.asarray([0.01, 0.01]), jnp.asarray([0, 0]))
        assert tok.tolist() == [1, 0]  # a tiny nucleus keeps only the top token
        keys = jax.vmap(jax.random.fold_in)(keys, jnp.arange(2))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[jnp.arange(2), tok], atol=1e-6)


def test_errors(model):
    _, params, cfg = model
    engine = Engine(params, cfg, num_slots=1, max_len=16, stop_ids=(STOP,))
    slot = engine.open([1, 2, 3])
    with pytest.raises(RuntimeError, match="slots are in use"):
        engine.open([1])
    with pytest.raises(ValueError, match="exceed max_len"):
        engine.append(slot, list(range(20)))
    engine.start(slot, SamplingParams(max_new_tokens=50))
    with pytest.raises(RuntimeError, match="generating"):
        engine.append(slot, [1])
    while not (finished := engine.step()):
        pass
    # the context fills up: the cache holds 16 tokens, the newest sampled one is queued
    assert finished[0].finish_reason == "context"
    assert engine.cached_kv(slot)[0].shape[2] == 16 and engine.length(slot) == 17
    with pytest.raises(ValueError, match="context"):
        engine.start(slot, SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
