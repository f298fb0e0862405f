"""Attention over pages: the pure-JAX path against jax's Pallas ragged paged attention kernel
(run by the Pallas interpreter on CPU), alone and inside the engine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import literals
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ragged_paged_attention,
)

from muajax.engine.engine import Engine, SamplingParams
from muajax.engine.paged_attention import ragged_reference, resolve_attention
from muajax.models.qwen3 import init_params
from tests.support.tiny_models import ONE_LAYER_CONFIG, TINY_CONFIG


@pytest.fixture
def interpret(monkeypatch):
    """Run Pallas TPU kernels with the HLO interpreter. jax 0.10.2's interpreter indexes with
    typed integer literals that lack `.shape` in masked stores (the kernel's l/m/acc updates);
    give them the scalar shape they stand for. (Its newer TPU interpreter cannot take the
    kernel's reshaped VMEM ref.)"""
    monkeypatch.setattr(literals.TypedInt, "shape", property(lambda self: ()), raising=False)
    with pltpu.force_tpu_interpret_mode(True):
        yield


def ragged_case(seed, seqs, *, heads=8, kv_heads=2, page_size=8, pages=64, rows=None, tokens=None):
    """Random queries and pages for `seqs` = [(q_len, kv_len)] (q_len 1: decode, more: a
    prefill chunk), each sequence on its own random pages."""
    rng = np.random.RandomState(seed)
    rows = rows or len(seqs)
    width = max(-(-kv // page_size) for _, kv in seqs) + 1
    perm = rng.permutation(pages)
    page_indices = np.zeros((rows, width), np.int32)
    for i in range(len(seqs)):
        page_indices[i] = perm[i * width:(i + 1) * width]
    q_lens = [q for q, _ in seqs] + [0] * (rows - len(seqs))
    kv_lens = [kv for _, kv in seqs] + [0] * (rows - len(seqs))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = tokens or int(cu[-1]) + 3  # padding queries past the last sequence
    args = {"q": jnp.asarray(rng.randn(tokens, heads, 128), jnp.float32),
            "kv_pages": jnp.asarray(rng.randn(pages, page_size, 2 * kv_heads, 128), jnp.float32),
            "kv_lens": jnp.asarray(kv_lens, jnp.int32), "page_indices": jnp.asarray(page_indices),
            "cu_q_lens": jnp.asarray(cu), "num_seqs": jnp.asarray([len(seqs)], jnp.int32)}
    return args, int(cu[len(seqs)])


CASES = {
    "decode": [(1, 9), (1, 30), (1, 1), (1, 17)],
    "prefill": [(13, 13), (5, 21), (8, 8)],
    "mixed": [(1, 40), (7, 7), (1, 3), (12, 33), (2, 16), (1, 24)],
    "padded rows": [(3, 11), (1, 5)],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_jax_paged_attention_equals_the_pallas_kernel(name, interpret):
    seqs = CASES[name]
    args, real = ragged_case(len(name), seqs, rows=len(seqs) + (2 if name == "padded rows" else 0))
    max_q = max(q for q, _ in seqs)
    want = ragged_reference(**args, max_q_len=max_q, dense_pages=args["page_indices"].shape[1])
    width = args["page_indices"].shape[1]
    for kv_pages_per_block, queries_per_block in ((1, 8), (3, 32)):  # blocks that split and straddle sequences
        got = ragged_paged_attention(**args, sm_scale=128**-0.5, num_kv_pages_per_block=min(kv_pages_per_block, width),
                                     num_queries_per_block=queries_per_block, vmem_limit_bytes=32 * 2**20)
        np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=1e-5, rtol=0)


def test_attention_choice():
    cfg = ONE_LAYER_CONFIG.replace(hidden_size=64, head_dim=128)
    assert resolve_attention("auto", cfg) == "reference"  # a CPU test process
    assert resolve_attention("pallas", cfg) == "pallas"
    with pytest.raises(ValueError, match="head_dim % 128"):
        resolve_attention("pallas", cfg.replace(head_dim=64))
    with pytest.raises(ValueError, match="expected one of"):
        resolve_attention("flash", cfg)


@pytest.mark.parametrize("deterministic", [False, True])
def test_engine_on_the_pallas_kernel_equals_the_pure_jax_engine(interpret, deterministic):
    """Also with token tiles (the kernel then runs per tile, on the tile's rows)."""
    cfg = TINY_CONFIG.replace(vocab_size=128, intermediate_size=96, head_dim=128, rope_theta=10000.0)
    params = init_params(cfg, jax.random.key(3))
    rng = np.random.RandomState(5)
    first = [[int(t) for t in rng.randint(0, 128, n)] for n in (19, 4, 33)]
    second = [[int(t) for t in rng.randint(0, 128, n)] for n in (6, 1, 11)]
    out = {}
    for attention in ("reference", "pallas"):
        engine = Engine(params, cfg, num_slots=3, max_len=96, stop_ids=(), decode_chunk=6, page_size=8,
                        extend_widths=(16,), attention=attention, deterministic=deterministic)
        slots = [engine.open(p, seed=i) for i, p in enumerate(first)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
        gens = [engine.generate(slots, sampling)]
        for slot, turn in zip(slots, second):  # a second turn: extend behind cached pages
            engine.append(slot, turn)
        gens.append(engine.generate(slots, sampling))
        out[attention] = [(g.tokens, g.logprobs) for turn in gens for g in turn.values()]
    for (got_tokens, got_lp), (want_tokens, want_lp) in zip(out["pallas"], out["reference"]):
        assert got_tokens == want_tokens
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
