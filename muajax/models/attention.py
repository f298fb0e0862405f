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
           over the current mesh: batch over (data, fsdp), heads over tensor, queries over
           sequence (`muajax.models.splash_attention`). Off TPU it runs in Pallas
           interpret mode (slow: for tests and parity only).
  cudnn    `jax.nn.dot_product_attention(implementation="cudnn")`: causal, with segments
           as a boolean mask (jax.nn exposes no cuDNN packed layout, so packed rows on GPU
           carry a [B, 1, T, T] mask). GPU only, bfloat16/float16 only.
  auto     splash on TPU; cudnn on GPU in bfloat16/float16; else chunked from
           AUTO_CHUNKED_MIN_LEN keys on, xla below.
splash and cudnn serve only self-attention; given the cache form they run chunked.

On a mesh whose `sequence` axis splits the rows' positions (`muajax.parallel`), xla,
chunked and splash run context-parallel: each device's queries against the whole row's
keys and values, gathered over that axis (`muajax.models.context_parallel`); cudnn refuses.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from muajax.models.chunked_attention import NEG, chunked_attention
from muajax.models.context_parallel import context_parallel, current_platform, sequence_split
from muajax.models.splash_attention import SPLASH_BLOCK, splash_attention

IMPLEMENTATIONS = ("auto", "xla", "chunked", "splash", "cudnn")

# From this many keys on, `auto` (off TPU, and off cuDNN on GPU) runs `chunked`; below it
# the einsum reference. Measured on this project's 2-core CPU box (float32, forward+backward
# of the attention alone, median of 5; chunked at its `chunk_block`):
#   rows x T, heads/kv heads x head_dim    xla        chunked
#   1 x 256, 16/8 x 128                    13.5 ms    19.0 ms
#   1 x 512, 16/8 x 128                    76.5 ms    42.4 ms
#   1 x 1024, 16/8 x 128                   373 ms     139 ms
#   8 x 256, 8/4 x 64                      60.4 ms    42.4 ms
#   8 x 512, 8/4 x 64                      248 ms     144 ms
# From 512 on the [T, S] scores cost more than the blocks' loop, and the gap grows as T^2
# against T. Below the threshold the reference keeps running where it always has (the
# tests' tiny models, short prompts).
AUTO_CHUNKED_MIN_LEN = 512
# Block length of `chunked` on both axes; None: `chunk_block` picks it from the shapes.
CHUNK_BLOCK = None
# `chunk_block` takes the longest of these whose float32 score block [rows, kv_heads, block,
# block] fits CHUNK_SCORE_BYTES: the dots stay efficient and the softmax's passes over the
# block stay in cache. Measured on the 2-core CPU box (forward+backward of the attention
# alone, 8 query heads on 4 kv heads of 64, float32):
#   rows x T     block 512   256      128      64
#   8 x 512      217 ms     150 ms   129 ms   123 ms
#   2 x 4096     1.34 s     1.28 s   1.62 s
CHUNK_BLOCKS = (512, 256, 128, 64)
CHUNK_SCORE_BYTES = 2 << 20
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def chunk_block(rows: int, kv_heads: int) -> int:
    """`chunked`'s block length for `rows` x `kv_heads` score blocks (see CHUNK_BLOCKS)."""
    return next((b for b in CHUNK_BLOCKS if rows * kv_heads * b * b * 4 <= CHUNK_SCORE_BYTES), CHUNK_BLOCKS[-1])


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
    `block` overrides the block length of chunked (`chunk_block`) or splash (SPLASH_BLOCK)."""
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
    mesh = jax.sharding.get_abstract_mesh()
    split = not mesh.empty and sequence_split(mesh, t) > 1
    if impl == "cudnn":
        if split:
            raise ValueError("attention: cudnn does not split a row over the mesh's sequence axis; "
                             "use chunked (or a mesh with sequence=1)")
        args, kwargs = cudnn_arguments(q, k, v, segment_ids)
        return jax.nn.dot_product_attention(*args, **kwargs, implementation="cudnn")
    if impl == "chunked":
        local = lambda q, k, v, qi, qs, ks, valid: chunked_attention(
            q, k, v, qi, q_seg=qs, kv_seg=ks, kv_valid=valid,
            block=block or CHUNK_BLOCK or chunk_block(q.shape[0], k.shape[1]))
    else:
        local = lambda q, k, v, qi, qs, ks, valid: xla_attention(q, k, v, qi, segment_ids=qs, kv_segment_ids=ks,
                                                                 kv_valid=valid)
    if split:  # each device's queries against the whole row's keys (context parallelism)
        return context_parallel(local, q, k, v, segment_ids=segment_ids, q_index=q_index, kv_valid=kv_valid)
    if not cache_form:
        q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return local(q, k, v, q_index, segment_ids, segment_ids, kv_valid)


def xla_attention(q, k, v, q_index, *, segment_ids=None, kv_segment_ids=None, kv_valid=None) -> jax.Array:
    """The reference: float32 scores for every (query, key) pair, masked, softmaxed.
    `segment_ids` [B, T] are the queries' ids, `kv_segment_ids` [B, S] the keys' (default:
    the same, for self-attention)."""
    b, t, n, h = q.shape
    kv = k.shape[1]
    q = q.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    allowed = jnp.arange(k.shape[2])[None, None, :] <= q_index[:, :, None]
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        allowed &= segment_ids[:, :, None] == kv_segment_ids[:, None, :]
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
