"""Every attention implementation against the einsum reference: forward and gradient in
float32, causal, ragged padding, packed segments, GQA 1/2/4, head_dim 64/128, lengths that
are not a multiple of the block; the cache-style mask; the `auto` rule; cuDNN's arguments;
and that chunked's memory grows linearly where the reference's grows quadratically."""
import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models import attention as attn
from muajax.models.qwen3 import abstract_params, forward
from muajax.planning.topology import libtpu_available
from tests.support import workers
from tests.support.tiny_models import TINY_CONFIG

NEEDS_LIBTPU = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                  'pip install -e ".[tpu]"')

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 2e-5

# name: (batch, T, q heads, kv heads, head_dim, segment rows or None). T is never a multiple
# of a block: chunked runs blocks of 16 (several per row, the last one padded), splash of
# 128 (whole TPU lanes) on rows of 150.
CASES = {
    "causal_gqa2_h64": (2, 37, 4, 2, 64, None),
    "causal_gqa1_h128": (1, 150, 2, 2, 128, None),
    "right_padding_gqa4_h64": (2, 37, 4, 1, 64, [[1] * 30 + [0] * 7, [1] * 12 + [0] * 25]),
    "packed_gqa2_h128": (2, 150, 4, 2, 128, [[1] * 50 + [2] * 61 + [3] * 30 + [0] * 9,
                                             [0] * 6 + [1] * 100 + [2] * 44]),  # row 2: left padding
    "packed_gqa4_h64": (1, 37, 8, 2, 64, [[1] * 9 + [2] * 9 + [3] * 9 + [4] * 10]),
}
BLOCKS = {"chunked": 16, "splash": 128}


def _inputs(batch, t, n, k, h, seed=0, s=None):
    rng = np.random.RandomState(seed)
    s = t if s is None else s
    q = jnp.asarray(rng.randn(batch, t, n, h), jnp.float32)
    keys = jnp.asarray(rng.randn(batch, k, s, h), jnp.float32)
    values = jnp.asarray(rng.randn(batch, k, s, h), jnp.float32)
    cotangent = jnp.asarray(rng.randn(batch, t, n, h), jnp.float32)
    return q, keys, values, cotangent


def _value_and_grads(fn, q, k, v, cotangent, valid):
    """fn's output and the gradient of <output, cotangent> over valid (non-padding) queries."""
    weight = cotangent * jnp.asarray(valid, jnp.float32)[:, :, None, None]
    out = jax.jit(fn)(q, k, v)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * weight), argnums=(0, 1, 2)))(q, k, v)
    return out, grads


def _max_errors(got, want, valid):
    (out, grads), (ref_out, ref_grads) = got, want
    errors = {"out": float(np.abs(np.asarray(out - ref_out))[np.asarray(valid)].max())}
    errors.update({name: float(np.abs(np.asarray(a - b)).max()) for name, a, b in zip("qkv", grads, ref_grads)})
    return errors


def _cudnn_call_on_xla(q, k, v, segment_ids):
    """The exact call the cudnn implementation makes, run by jax's XLA implementation."""
    args, kwargs = attn.cudnn_arguments(q, k, v, segment_ids)
    return jax.nn.dot_product_attention(*args, **kwargs, implementation="xla")


@pytest.mark.parametrize("impl", ["chunked", "splash", "cudnn"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_implementation_equals_the_einsum_reference(case, impl):
    batch, t, n, k, h, rows = CASES[case]
    q, keys, values, cotangent = _inputs(batch, t, n, k, h, seed=len(case))
    seg = None if rows is None else jnp.asarray(rows, jnp.int32)
    valid = np.ones((batch, t), bool) if rows is None else np.asarray(rows) > 0
    reference = _value_and_grads(lambda *a: attn.attention(*a, implementation="xla", segment_ids=seg),
                                 q, keys, values, cotangent, valid)
    if impl == "cudnn":
        fn = lambda *a: _cudnn_call_on_xla(*a, seg)
    else:
        fn = lambda *a: attn.attention(*a, implementation=impl, segment_ids=seg, block=BLOCKS[impl])
    errors = _max_errors(_value_and_grads(fn, q, keys, values, cotangent, valid), reference, valid)
    assert max(errors.values()) <= TOL, errors


def test_chunked_serves_the_cache_form():
    """Queries at each row's own offset into a longer, partly empty key axis (a prefix in a
    KV cache being extended), with blocks that split both axes unevenly."""
    batch, t, s, n, k, h = 2, 21, 50, 4, 2, 64
    q, keys, values, cotangent = _inputs(batch, t, n, k, h, seed=3, s=s)
    lengths = jnp.asarray([7, 29])
    q_index = lengths[:, None] + jnp.arange(t)[None, :]
    kv_valid = jnp.arange(s)[None, :] < (lengths + t)[:, None]
    valid = np.ones((batch, t), bool)
    run = lambda impl: _value_and_grads(
        lambda *a: attn.attention(*a, implementation=impl, q_index=q_index, kv_valid=kv_valid, block=16),
        q, keys, values, cotangent, valid)
    errors = _max_errors(run("chunked"), run("xla"), valid)
    assert max(errors.values()) <= TOL, errors


def test_chunk_block_keeps_the_score_block_within_its_budget():
    """The longest block whose float32 [rows, kv_heads, block, block] scores fit 2 MiB: 128 for
    the train bench's 8 rows on 4 kv heads, 256 for 2 rows, never below the smallest."""
    assert attn.chunk_block(8, 4) == 128
    assert attn.chunk_block(2, 4) == 256
    assert attn.chunk_block(1, 2) == 512
    assert attn.chunk_block(256, 8) == attn.CHUNK_BLOCKS[-1]
    for rows, heads in ((8, 4), (2, 4), (1, 2), (3, 5)):
        block = attn.chunk_block(rows, heads)
        assert rows * heads * block * block * 4 <= attn.CHUNK_SCORE_BYTES or block == attn.CHUNK_BLOCKS[-1]


def test_auto_picks_by_platform_and_length():
    pick = lambda impl="auto", n=64, dtype=jnp.float32, platform="cpu", cache=False: attn.resolve(
        impl, num_keys=n, dtype=dtype, platform=platform, cache_form=cache)
    assert pick() == "xla"
    assert pick(n=attn.AUTO_CHUNKED_MIN_LEN - 1) == "xla"
    assert pick(n=attn.AUTO_CHUNKED_MIN_LEN) == "chunked"
    assert pick(platform="tpu") == "splash"
    assert pick(platform="gpu", dtype=jnp.bfloat16) == "cudnn"
    assert pick(platform="gpu", dtype=jnp.float32) == "xla"  # cuDNN has no float32 kernel
    assert pick(platform="tpu", cache=True) == "xla"
    assert pick(platform="tpu", cache=True, n=attn.AUTO_CHUNKED_MIN_LEN) == "chunked"
    for impl in ("splash", "cudnn"):  # the cache form is not theirs to serve
        assert pick(impl, cache=True) == "chunked"
        assert pick(impl) == impl
    with pytest.raises(ValueError, match="expected one of"):
        pick("flash")


def test_cudnn_arguments_have_the_layout_jax_nn_expects():
    q, k, v, _ = _inputs(2, 12, 4, 2, 64)
    (aq, ak, av), kwargs = attn.cudnn_arguments(q, k, v, None)
    assert aq.shape == (2, 12, 4, 64) and ak.shape == av.shape == (2, 12, 2, 64)  # BTNH, BSKH
    assert kwargs == {"scale": 64 ** -0.5, "is_causal": True}
    seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 10 + [0] * 2])
    _, kwargs = attn.cudnn_arguments(q, k, v, seg)
    assert kwargs["mask"].shape == (2, 1, 12, 12) and kwargs["mask"].dtype == jnp.bool_
    assert not kwargs["mask"][0, 0, 6, 4] and kwargs["mask"][0, 0, 6, 5]


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason=f"cuDNN attention needs an NVIDIA GPU; this backend is {jax.default_backend()}")
def test_cudnn_on_gpu_matches_the_reference():
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in _inputs(2, 150, 4, 2, 128))
    seg = jnp.asarray([[1] * 70 + [2] * 80, [1] * 140 + [0] * 10], jnp.int32)
    got = attn.attention(q, k, v, implementation="cudnn", segment_ids=seg)
    want = attn.attention(q, k, v, implementation="xla", segment_ids=seg)
    valid = np.asarray(seg) > 0
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))[valid].max() < 2e-2


def test_bad_arguments_say_what_is_wrong():
    q, k, v, _ = _inputs(1, 8, 4, 2, 64)
    with pytest.raises(ValueError, match="S == T"):
        attn.attention(q, k[:, :, :6], v[:, :, :6])
    with pytest.raises(ValueError, match="kv_valid"):
        attn.attention(q, k, v, q_index=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        attn.attention(q, k, v, segment_ids=jnp.zeros((1, 7), jnp.int32))


def _attention_temporaries(impl: str, length: int) -> int:
    """Compiled (CPU) temporaries of a tiny model's forward and backward over one row."""
    cfg = TINY_CONFIG.replace(attention=impl)
    params = nn.meta.unbox(abstract_params(cfg))
    loss = lambda p, x: jnp.mean(forward(p, cfg, x, return_hidden=True)[0] ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, length), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly_and_the_reference_quadratically():
    growth = {impl: _attention_temporaries(impl, 8192) / _attention_temporaries(impl, 2048)
              for impl in ("chunked", "xla")}
    assert growth["chunked"] <= 4.5, growth  # 4x the length: linear terms 4x, block terms 1x
    assert growth["xla"] >= 12, growth       # the [T, T] scores: 16x


# ----------------------------------------------------------------------------- splash on meshes


@functools.lru_cache(maxsize=None)
def _splash_checks() -> dict:
    """tests/support/workers/splash_checks.py in a fresh process: 4 fake CPU devices, and libtpu's
    compiler for a v5p topology (ALLOW_MULTIPLE_LIBTPU_LOAD: other processes on this machine
    may hold libtpu's lock, which a compile-only process does not need)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, workers.path("splash_checks.py")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_splash_under_shard_map_equals_the_reference_on_a_cpu_mesh():
    """Batch over fsdp, heads over tensor, in interpret mode; with one kv head (which the
    tensor axis cannot split) each device gets copies of the kv heads of its query heads."""
    out = _splash_checks()["cpu_mesh"]
    for kv_heads, errors in out.items():
        assert max(errors.values()) <= TOL, (kv_heads, errors)


@NEEDS_LIBTPU
def test_splash_compiles_for_tpu_with_the_pallas_kernel():
    out = _splash_checks()["tpu_compile"]
    assert out["platform"] == "tpu" and out["devices"] == 4
    assert out["tpu_custom_calls"] >= 3, out  # forward, dq and dkv kernels
    assert out["splash_kernel_named"], out
