"""Training and full-sequence attention, one function behind one name.

    attention(q, k, v, implementation=..., segment_ids=..., q_index=..., kv_valid=...)

q [B, T, N, H]; k, v [B, K, S, H] (heads before positions, as the KV cache stores them);
N is a multiple of K (grouped-query attention). Two mask forms:
  self-attention (q_index None, S == T): key s is visible to query t when s <= t and, with
    `segment_ids` [B, T], both carry the same id. Packed rows put one id per conversation;
    padding is id 0 and only ever sees padding, so no real token sees it and no row is empty.
    Right padding needs no ids at all: it comes after every real query.
  cache (q_index [B, T], kv_valid [B, S]): each query's own index into the key axis, and
    which key slots hold tokens: visible when s <= q_index[t] and kv_valid[s]. This is a
    prefix held in a KV cache that rows extend (`forward_shared_prefix`).
A query that sees no key gets an unspecified finite value.

Implementations:
  xla      the einsum reference: [B, K, G, T, S] float32 scores per layer.
  chunked  `chunked_attention`: online softmax over key blocks, custom VJP, O(T x block)
           memory in the forward and the backward; any platform, both mask forms.
  splash   Pallas TPU splash attention (causal, segment ids, GQA) under `jax.shard_map`
           over the current mesh: batch over (data, fsdp), heads over tensor. Off TPU it
           runs in Pallas interpret mode (slow: for tests and parity only).
  cudnn    `jax.nn.dot_product_attention(implementation="cudnn")`: causal, with segments
           as a boolean mask (jax.nn exposes no cuDNN packed layout, so packed rows on GPU
           carry a [B, 1, T, T] mask). GPU only, bfloat16/float16 only.
  auto     splash on TPU; cudnn on GPU in bfloat16/float16; else chunked from
           AUTO_CHUNKED_MIN_LEN keys on, xla below.
splash and cudnn serve only self-attention; given the cache form they run chunked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from muajax import parallel
from muajax.models.chunked_attention import NEG, chunked_attention

IMPLEMENTATIONS = ("auto", "xla", "chunked", "splash", "cudnn")

# From this many keys on, `auto` (off TPU, and off cuDNN on GPU) runs `chunked`; below it
# the einsum reference. Measured on this project's 2-core CPU box (float32, one row, 16
# query heads on 8 kv heads of 128; forward+backward of the attention alone, best of 3):
#   T        128     256     512     1024    2048    4096
#   xla      8 ms    19 ms   77 ms   426 ms  1.92 s  10.9 s
#   chunked  8 ms    19 ms   75 ms   230 ms  0.72 s  2.65 s
# They tie up to 512 (one or two blocks); from 1024 on the [T, S] scores cost more than
# the blocks' loop, and the gap grows as T^2 against T. Below the threshold the reference
# keeps running where it always has (the tests' tiny models, short prompts).
AUTO_CHUNKED_MIN_LEN = 1024
# Block length of `chunked` on both axes: a [B, N, 512, 512] float32 score block is 1 MiB
# per head and row, big enough for efficient dots, small enough to stay in cache-sized tiles.
CHUNK_BLOCK = 512
# Splash's block on every axis (forward, dq, dkv), as MaxText sets it for long sequences;
# shorter sequences use one block of their length rounded up to the 128 TPU lanes.
SPLASH_BLOCK = 512
SPLASH_LANES = 128
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def current_platform() -> str:
    """The platform of the mesh in context (`jax.set_mesh`), else the default backend:
    compiling for a TPU topology on a CPU host counts as TPU."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def resolve(implementation: str, *, num_keys: int, dtype, platform: str, cache_form: bool) -> str:
    """The implementation that actually runs for `implementation` (one of IMPLEMENTATIONS)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}: expected one of {IMPLEMENTATIONS}")
    if implementation in ("splash", "cudnn") and cache_form:
        return "chunked"
    if implementation != "auto":
        return implementation
    if not cache_form and platform == "tpu":
        return "splash"
    if not cache_form and platform in ("gpu", "cuda") and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES):
        return "cudnn"
    return "chunked" if num_keys >= AUTO_CHUNKED_MIN_LEN else "xla"


def attention(q, k, v, *, implementation: str = "auto", segment_ids=None, q_index=None, kv_valid=None,
              block: int | None = None) -> jax.Array:
    """Attention output [B, T, N, H] in q's dtype (see the module docstring for the masks).
    `block` overrides the block length of chunked (CHUNK_BLOCK) or splash (SPLASH_BLOCK)."""
    b, t, n, h = q.shape
    if k.ndim != 4 or k.shape[0] != b or k.shape[3] != h or v.shape != k.shape or n % k.shape[1]:
        raise ValueError(f"attention: q {q.shape} needs k, v [B, K, S, H] with N a multiple of K; "
                         f"got k {k.shape}, v {v.shape}")
    cache_form = q_index is not None
    if cache_form and (kv_valid is None or segment_ids is not None):
        raise ValueError("attention: the cache form takes q_index with kv_valid, and no segment_ids")
    if not cache_form and (kv_valid is not None or k.shape[2] != t):
        raise ValueError(f"attention: self-attention needs S == T and no kv_valid; got T={t}, k {k.shape}")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"attention: segment_ids {segment_ids.shape} must be [B, T] = {(b, t)}")
    impl = resolve(implementation, num_keys=k.shape[2], dtype=q.dtype, platform=current_platform(),
                   cache_form=cache_form)
    if impl == "splash":
        return splash_attention(q, k, v, segment_ids, block=block or SPLASH_BLOCK)
    if impl == "cudnn":
        args, kwargs = cudnn_arguments(q, k, v, segment_ids)
        return jax.nn.dot_product_attention(*args, **kwargs, implementation="cudnn")
    if not cache_form:
        q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if impl == "chunked":
        return chunked_attention(q, k, v, q_index, q_seg=segment_ids, kv_seg=segment_ids, kv_valid=kv_valid,
                                 block=block or CHUNK_BLOCK)
    return xla_attention(q, k, v, q_index, segment_ids=segment_ids, kv_valid=kv_valid)


def xla_attention(q, k, v, q_index, *, segment_ids=None, kv_valid=None) -> jax.Array:
    """The reference: float32 scores for every (query, key) pair, masked, softmaxed."""
    b, t, n, h = q.shape
    kv = k.shape[1]
    q = q.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    allowed = jnp.arange(k.shape[2])[None, None, :] <= q_index[:, :, None]
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    if kv_valid is not None:
        allowed &= kv_valid[:, None, :]
    scores = jnp.where(allowed[:, None, None, :, :], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # the dot's natural output order: asked for [B, T, K, G, H], XLA swapped the operands into
    # a form its fast CPU dot path does not take
    out = jnp.einsum("BKGTS,BKSH->BKGTH", probs, v)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def cudnn_arguments(q, k, v, segment_ids):
    """(args, kwargs) for `jax.nn.dot_product_attention`, without `implementation`: the same
    call runs cuDNN on GPU and XLA elsewhere (how the CPU tests check it)."""
    kwargs = dict(scale=q.shape[-1] ** -0.5, is_causal=True)
    if segment_ids is not None:
        kwargs["mask"] = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return (q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)), kwargs


# ----------------------------------------------------------------------------- splash


def _splash_kernel(heads: int, length: int, block: int, interpret: bool):
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                              block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _mesh_axis(mesh, size: int, logical: str):
    """The mesh axes (or None) that the logical-axis rules give a dimension of `size`."""
    return parallel.logical_to_spec((size,), (logical,), mesh)[0]


def splash_attention(q, k, v, segment_ids=None, *, block: int = SPLASH_BLOCK) -> jax.Array:
    """Causal splash attention; q [B, T, N, H], k, v [B, K, T, H]. T is padded inside to a
    multiple of the block (padding keys come after every real query, so causality hides
    them). Splash takes no scale: q is scaled before the kernel."""
    b, t, n, h = q.shape
    lanes = lambda x: -(-x // SPLASH_LANES) * SPLASH_LANES  # every splash block is whole lanes
    block = min(lanes(block), lanes(t))
    padded = -(-t // block) * block
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, padded - t), (0, 0)])
    q = pad((q.astype(jnp.float32) * h**-0.5).astype(q.dtype).transpose(0, 2, 1, 3))
    k, v = pad(k), pad(v)
    seg = None if segment_ids is None else jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, padded - t)])
    mesh = jax.sharding.get_abstract_mesh()
    interpret = current_platform() != "tpu"

    def body(q, k, v, *seg):
        kernel = _splash_kernel(q.shape[1], padded, block, interpret)
        if not seg:
            return jax.vmap(kernel)(q, k, v)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(q, k, v, *seg)

    if mesh.empty:
        out = body(q, k, v, *([] if seg is None else [seg]))
    else:
        batch_axes = _mesh_axis(mesh, b, "activation_batch")
        head_axes = _mesh_axis(mesh, n, "activation_heads")
        if head_axes is not None and _mesh_axis(mesh, k.shape[1], "activation_heads") != head_axes:
            # kv heads the tensor axis does not divide: give each query head its own copy, so
            # every device holds the kv heads of its query heads
            k, v = (jnp.repeat(x, n // x.shape[1], axis=1) for x in (k, v))
        spec = jax.sharding.PartitionSpec(batch_axes, head_axes, None, None)
        args, specs = (q, k, v), (spec, spec, spec)
        if seg is not None:
            args, specs = args + (seg,), specs + (jax.sharding.PartitionSpec(batch_axes, None),)
        out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)(*args)
    return out[:, :, :t].transpose(0, 2, 1, 3)
