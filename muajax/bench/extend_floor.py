"""The extend floor: a turn's new tokens prefilled over the conversation's cache, as plainly as
XLA runs it (`python -m muajax.bench multiturn`'s floor for a whole turn).

A kept turn does two kinds of work: it extends the conversation with the turn's message (T
new tokens, each attending over the whole history and the new tokens before it) and then
decodes. Both read the history, so both grow with it; `model_floor` is the decode's floor,
this is the extend's. The step is `model_floor.layer` on [rows, T] tokens: a dense cache per
layer ([rows, kv_heads, history, head_dim], read only, HF's layout), causal attention among
the new tokens, no paging, no masks beyond causality, no LM head (an extend only fills the
cache: the engine's drops the head too). `tests/bench/test_extend_floor.py` checks its
numbers against transformers.
"""
from __future__ import annotations

import numpy as np

from muajax.bench.model_floor import (
    ModelShape,
    head_logits,
    layer,
    random_caches,
    repeated,
    rope_at,
)


def _attend_new(q, k_new, v_new, keys, values, s: ModelShape):
    """T queries per row, q [B, T, N, H], over the cache's positions (keys, values [B, K, S, H])
    and the T new keys and values [B, T, K, H], new token t seeing new tokens <= t.
    Returns [B, T, N * H]."""
    import jax
    import jax.numpy as jnp

    b, t = q.shape[:2]
    q = q.reshape(b, t, s.kv_heads, s.heads // s.kv_heads, s.head_dim) * (s.head_dim ** -0.5)
    past = jnp.einsum("btkgh,bksh->bkgts", q, keys)
    own = jnp.einsum("btkgh,bukh->bkgtu", q, k_new)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    own = jnp.where(causal, own, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([past, own], axis=-1), axis=-1)
    split = keys.shape[2]
    out = (jnp.einsum("bkgts,bksh->btkgh", probs[..., :split], values)
           + jnp.einsum("bkgtu,bukh->btkgh", probs[..., split:], v_new))
    return out.reshape(b, t, s.heads * s.head_dim)


def extend(weights: dict, caches: list, tokens, start, s: ModelShape):
    """`tokens` [B, T] at positions start.. over `caches` (per layer (keys, values) [B, K,
    start, H]): the last layer's hidden states [B, T, D] (before the final norm) and each
    layer's new (keys, values) [B, T, K, H]."""
    import jax.numpy as jnp

    cos, sin = (x[:, None] for x in rope_at(start + jnp.arange(tokens.shape[1]), s))  # [T, 1, H]
    h, new = weights["embed"][tokens], []
    for w, (keys, values) in zip(weights["layers"], caches):
        h, kv = layer(w, h, cos, sin, lambda q, k, v: _attend_new(q, k, v, keys, values, s), s)
        new.append(kv)
    return h, new


def extend_logits(weights: dict, caches: list, tokens, start, s: ModelShape):
    """The new tokens' logits [B, T, V] (tests: the extend computes the model)."""
    h, new = extend(weights, caches, tokens, start, s)
    return head_logits(weights, h, s), new


def xla_model_extend(weights: dict, shape: ModelShape, batch: int, history: int, tokens: int):
    """A callable running one extend of `tokens` new tokens per row over `history` cached
    positions; it returns the new keys and values, all the engine's extend keeps."""
    import jax
    import jax.numpy as jnp

    put = jax.device_put
    w = {"layers": [{k: put(v) for k, v in layer_w.items()} for layer_w in weights["layers"]],
         "embed": put(weights["embed"])}
    caches = random_caches(shape._replace(keys_by_position=False), len(w["layers"]), batch, history)
    rng = np.random.RandomState(0)

    @jax.jit
    def program(w, caches, ids):
        return extend(w, caches, ids, history, shape)[1]

    ids = jnp.asarray(rng.randint(0, weights["embed"].shape[0], size=(batch, tokens)), jnp.int32)

    return repeated(program, (w, caches, ids))
