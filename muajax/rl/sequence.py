"""The log-probabilities of target tokens under the model: the forward, then the LM head and
log-softmax, in chunks of positions so that the [T, V] logits never exist at once.

At T = 32768 and Qwen3's V = 151936 one row's float32 logits are 20 GB. With `logits_chunk`
the head and the log-softmax run over chunks of positions under remat: one [B, chunk, V]
block is alive at a time, in the forward and in the backward.

Chunks are strided: chunk j holds positions j, j + n, j + 2n, ... of every row (n chunks).
Reshaping [B, T] to [B, T / n, n] keeps each contiguous share of the positions on its
device when a mesh's `sequence` axis splits the rows, so the loop over the n chunks runs on
every device's own positions and moves no data. (Which positions share a chunk does not
matter: the head and the log-softmax are per position.)
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from muajax.models.context_parallel import sequence_split
from muajax.models.qwen3 import Qwen3Config, forward, forward_shared_prefix, lm_head
from muajax.rl.logprobs import logprobs_and_entropy, token_logprobs
from muajax.rl.moe_aux import forward_with_routing
from muajax.rl.packed_prefix import forward_packed_prefix


def _head(params, cfg: Qwen3Config):
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def chunk_count(length: int, logits_chunk: int | None, multiple: int = 1) -> int:
    """How many strided chunks `length` positions are cut into for a requested chunk of at
    most `logits_chunk` positions: the fewest that divide `length` into parts that are a
    multiple of `multiple` (the sequence shards) and no longer than the request. Padded
    lengths are multiples of 128 or 512, so such a count exists; if none does up to twice
    the minimum, the caller pads to `count * ceil(length / count)`."""
    if logits_chunk is None or logits_chunk >= length:
        return 1
    least = math.ceil(length / logits_chunk)
    for n in range(least, 2 * least + 1):
        if length % n == 0 and (length // n) % multiple == 0:
            return n
    return least


def _strided(x, n: int):
    """[B, T, ...] -> [n, B, T / n, ...]: chunk j holds positions j, j + n, ..."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // n, n, *x.shape[2:]), 2, 0)


def _unstrided(x):
    """Inverse of `_strided` for [n, B, T / n] -> [B, T]."""
    n, b, size = x.shape
    return jnp.moveaxis(x, 0, 2).reshape(b, size * n)


def sequence_logprobs(params, cfg: Qwen3Config, tokens, targets, *, temperature: float = 1.0,
                      logits_chunk: int | None = None, shared_prefix: int = 0, with_entropy: bool = True,
                      segment_ids=None, moe_valid=None, routing=None):
    """(logprobs, entropy) f32 [B, T] of `targets` under the model run on `tokens`.

    `with_entropy=False` returns (logprobs, None) and saves two [B, T, V] passes (the
    entropy's, and its zero cotangent's in the backward).

    With `logits_chunk`, the LM head and log-softmax run over chunks of about that many
    positions (any T: the count is chosen to divide it, or T is padded), never all of
    [B, T, V] at once; on a mesh in context whose sequence axis splits the rows, chunks keep
    to each device's positions.
    With `shared_prefix` = P > 0 every row must begin with the same P tokens (the system
    prompt): they run once, not once per row (`forward_shared_prefix`).
    `segment_ids` [B, T] runs packed rows (see `forward`): attention stays in each segment
    and positions restart in each. With both, the rows' first P columns are the common
    prefix, run once, and every segment after it continues it (`forward_packed_prefix`).
    `moe_valid` [B, T] bool (a mixture of experts' real tokens, `moe_aux.real_tokens`): the
    same forward with the load-balancing terms over those tokens, returned as a third item
    (fraction [L, E], mean_prob [L, E]).
    `routing` [B, T, L, k] (routing replay, `grpo.routing_replay`): the experts each token
    of a mixture of experts uses in each layer, instead of its routers' top k.
    """
    forced = replay_routing(routing)
    if moe_valid is not None:
        hidden, terms = forward_with_routing(params, cfg, tokens, valid=moe_valid, shared_prefix=shared_prefix,
                                             segment_ids=segment_ids, routing=forced)
        return (*_logprobs_of(hidden, params, cfg, tokens, targets, temperature, logits_chunk, with_entropy), terms)
    if shared_prefix and segment_ids is not None:
        hidden = forward_packed_prefix(params, cfg, tokens, segment_ids, shared_prefix, routing=forced)
    elif shared_prefix:
        hidden = forward_shared_prefix(params, cfg, tokens, shared_prefix, routing=forced)
    else:
        hidden, _ = forward(params, cfg, tokens, return_hidden=True, segment_ids=segment_ids, routing=forced)
    return _logprobs_of(hidden, params, cfg, tokens, targets, temperature, logits_chunk, with_entropy)


def replay_routing(routing):
    """A batch's stored experts [B, T, L, k] (any integer dtype) as the model's forced routing
    [L, B, T, k] int32 (`AttentionContext.routing`); None stays None."""
    return None if routing is None else jnp.moveaxis(routing, 2, 0).astype(jnp.int32)


def _logprobs_of(hidden, params, cfg: Qwen3Config, tokens, targets, temperature, logits_chunk, with_entropy):
    """(logprobs, entropy) of `targets` from the final hidden states (see `sequence_logprobs`)."""
    head = _head(params, cfg)

    def block(h, tgt):
        # Rows flattened to one [B*T] axis of tokens (sharded like batch and length): with B
        # and T as separate dims XLA:CPU transposes the [B, T, V] logits cotangent for the
        # head's weight gradient, measured ~20% slower per step's head.
        rows = h.shape[0] * h.shape[1]
        logits = lm_head(h.reshape(rows, h.shape[2]), head, cfg)  # float32 with cfg.logits_fp32
        logits = nn.with_logical_constraint(logits, ("activation_tokens", "activation_vocab"))[None]
        tgt = tgt.reshape(1, rows)
        if with_entropy:
            logp, ent = logprobs_and_entropy(logits, tgt, temperature)
            return logp.reshape(h.shape[:2]), ent.reshape(h.shape[:2])
        if temperature != 1.0:
            logits = logits.astype(jnp.float32) / jnp.float32(temperature)
        return token_logprobs(logits, tgt).reshape(h.shape[:2]), None

    t = tokens.shape[1]
    mesh = jax.sharding.get_abstract_mesh()
    n = chunk_count(t, logits_chunk, 1 if mesh.empty else sequence_split(mesh, t))
    if n == 1:
        return block(hidden, targets)
    padded = n * math.ceil(t / n)
    if padded != t:  # padding positions predict token 0 and are cut off below
        hidden = jnp.pad(hidden, [(0, 0), (0, padded - t), (0, 0)])
        targets = jnp.pad(targets, [(0, 0), (0, padded - t)])
    logp, ent = jax.lax.map(lambda xs: jax.checkpoint(block)(*xs), (_strided(hidden, n), _strided(targets, n)))
    cut = lambda x: None if x is None else _unstrided(x)[:, :t]
    return cut(logp), cut(ent)
