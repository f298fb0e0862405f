"""The engine on a mixture of experts (Qwen3-MoE): greedy tokens equal the model's plain
`forward` on every decode path (the dense decode in its per-layer and layer-scan forms, the
paged decode, token tiles, fixed rows), and with `record_experts` it returns each cached
token's chosen experts: those the plain forward over the whole conversation chooses, across
turns, a shared prefix and preemption."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax import parallel
from muajax.engine.engine import Engine, SamplingParams
from muajax.models.qwen3 import forward
from muajax.planning.topology import libtpu_available
from tests.support import workers
from tests.support.tiny_models import MOE_CONFIG, engine_params, random_ids

CFG = MOE_CONFIG.replace(vocab_size=500)


@pytest.fixture(scope="module")
def params():
    return engine_params(CFG)


def prompts(*lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [random_ids(rng, n, CFG) for n in lengths]


WIDTH = 128  # the plain forward runs on rows padded to this (causal: the padding changes nothing before it)


@jax.jit
def _plain(params, row):
    logits, _, routing = forward(params, CFG, row[None], return_routing=True)
    return logits[0], routing.experts[:, 0]


def padded(tokens) -> jax.Array:
    return jnp.asarray(list(tokens) + [0] * (WIDTH - len(tokens)), jnp.int32)


def greedy_forward(params, prompt, new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new):
        logits, _ = _plain(params, padded(tokens))
        tokens.append(int(jnp.argmax(logits[len(tokens) - 1])))
    return tokens[len(prompt):]


def forward_experts(params, tokens) -> np.ndarray:
    """The experts [T, L, k] the plain forward chooses for each token of `tokens`."""
    return np.asarray(_plain(params, padded(tokens))[1]).transpose(1, 0, 2)[: len(tokens)]


PATHS = {"dense-per-layer": dict(attention="reference"), "paged": dict(attention="paged"),
         "token-tiles": dict(deterministic=True), "fixed-rows": dict(batch_rows=4),
         "dense-layer-scan": dict(attention="reference", mesh="one-device")}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_greedy_tokens_equal_the_plain_forward_on_every_decode_path(params, path):
    kwargs = dict(PATHS[path])
    if kwargs.pop("mesh", None):  # on a mesh the dense decode scans the stacked layers
        kwargs["mesh"] = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rows = prompts(21, 40, 7)
    want = [greedy_forward(params, p, 12) for p in rows]
    for count in (1, 3):  # the dense decode's tail (<= 2 rows) and its in-place form
        engine = Engine(params, CFG, num_slots=4, max_len=128, stop_ids=(), decode_chunk=5, **kwargs)
        slots = [engine.open(p) for p in rows[:count]]
        got = engine.generate(slots, SamplingParams(temperature=0.0, max_new_tokens=12))
        assert [got[s].tokens for s in slots] == want[:count]


def conversation(params, **kwargs):
    """Three conversations (one on a registered prefix), two turns each: (engine, slots, tokens)."""
    engine = Engine(params, CFG, num_slots=4, max_len=128, stop_ids=(), decode_chunk=5, page_size=16,
                    record_experts=True, **kwargs)
    rows = prompts(40, 21, 7)
    rows.append(rows[0][:35] + [1, 2, 3])
    engine.register_prefix(rows[0][:33])
    slots = [engine.open(p, seed=i) for i, p in enumerate(rows)]
    first = engine.generate(slots, SamplingParams(temperature=1.0, max_new_tokens=12))
    tokens = {s: p + first[s].tokens for s, p in zip(slots, rows)}
    for s in slots[:2]:
        engine.append(s, [5, 6, 7, 8])
    second = engine.generate(slots[:2], SamplingParams(temperature=1.0, max_new_tokens=7))
    for s in slots[:2]:
        tokens[s] += [5, 6, 7, 8] + second[s].tokens
    return engine, slots, tokens


@pytest.mark.parametrize("path", ["paged", "token-tiles", "dense-per-layer"])
def test_recorded_experts_are_the_plain_forwards_for_every_cached_token(params, path):
    engine, slots, tokens = conversation(params, **PATHS[path])
    assert engine.stats["prefix_hits"] == 2
    for slot in slots:
        got = engine.experts(slot)
        assert got.dtype == np.uint8 and engine.length(slot) == len(tokens[slot])
        assert got.shape == (len(tokens[slot]) - 1, CFG.num_layers, CFG.num_experts_per_tok)  # all but the newest
        np.testing.assert_array_equal(got, forward_experts(params, tokens[slot])[:-1])


def test_a_preempted_conversation_records_its_recomputed_experts(params):
    """A pool of 6 pages of 16 for 4 conversations of up to 60 tokens: they take each other's pages."""
    engine = Engine(params, CFG, num_slots=4, max_len=64, stop_ids=(), decode_chunk=4, page_size=16,
                    kv_cache_tokens=96, record_experts=True, attention="paged")
    rows = prompts(30, 25, 20, 28, seed=3)
    slots = [engine.open(p, seed=i) for i, p in enumerate(rows)]
    got = engine.generate(slots, SamplingParams(temperature=1.0, max_new_tokens=20))
    assert engine.stats["preemptions"] > 0
    for slot, prompt in zip(slots, rows):  # each extended again (if it was preempted) once the others left
        engine.flush([slot], keep_last=True)
        tokens = prompt + got[slot].tokens
        np.testing.assert_array_equal(engine.experts(slot), forward_experts(params, tokens)[:-1])
        engine.release(slot)


def test_experts_are_recorded_only_when_asked_and_only_for_a_mixture_of_experts(params):
    engine = Engine(params, CFG, num_slots=1, max_len=32, stop_ids=())
    slot = engine.open([1, 2, 3])
    engine.flush()
    with pytest.raises(RuntimeError, match="record_experts=True"):
        engine.experts(slot)
    with pytest.raises(ValueError, match="not a mixture of experts"):
        Engine(engine_params(CFG.replace(num_experts=0)), CFG.replace(num_experts=0), num_slots=1, max_len=32,
               record_experts=True)


@pytest.mark.parametrize("record", [False, True], ids=["plain", "recording"])
def test_warmup_compiles_every_program_a_mixture_of_experts_then_uses(params, record):
    engine = Engine(params, CFG, num_slots=4, max_len=400, stop_ids=(), decode_chunk=4, page_size=16,
                    max_extend_tokens=64, record_experts=record)
    count = engine.warmup()
    sizes = lambda: (engine._programs.decode.jitted._cache_size(), engine._programs.extend.jitted._cache_size())
    assert count == sum(sizes()) and engine.pages.pool.in_use == 0
    before = sizes()
    for lengths in ((3,), (20, 70, 5)):
        slots = [engine.open(p) for p in prompts(*lengths, seed=len(lengths))]
        engine.generate(slots, SamplingParams(temperature=1.0, max_new_tokens=20))
        for slot in slots:
            engine.release(slot)
    assert sizes() == before  # no call compiled anything new


@pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed")
def test_a_mixture_of_experts_programs_compile_on_the_pallas_path_for_a_tpu_topology():
    """The real TPU compiler (libtpu, no TPU needed) compiles a mixture of experts' decode and
    extend with the kernel on v5p:2x2x1, plain and recording experts (uint8 [rows, steps or
    width, layers, k] out), with and without token tiles."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # other processes on this host may hold libtpu
    proc = subprocess.run([sys.executable, workers.path("tpu_moe_compile_checks.py"), "v5p:2x2x1"], check=False,
                          env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 8 and all(facts["kernel"] for facts in found.values())
    for name, facts in found.items():
        experts = [shape for shape, dtype in facts["outputs"] if dtype == "uint8"]
        want = {"decode": [[32, 4, 2, 2]], "extend_64x64": [[128, 64, 2, 2]]}[name.split()[0]]
        assert experts == (want if name.endswith("record") else []), name

