"""On-device sampling: temperature, top-k, top-p, greedy — one row's choice never
depends on another row's settings or presence.

Each sampled token's logprob is returned under the temperature-scaled softmax over the
full vocabulary: the same quantity the GRPO loss recomputes from the training forward
(`logprobs_and_entropy(logits, targets, temperature)`), so the PPO ratio starts at 1.
Top-k/top-p only restrict which tokens may be drawn. Greedy rows (temperature 0) report
the plain (temperature 1) logprob of the argmax token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside each row's top-k / nucleus; rows with k=0, p>=1 are unchanged."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # keep a token while the mass *before* it is < p, so the top token always survives
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p[:, None]
    cutoff_index = jnp.maximum(jnp.sum(keep_sorted, axis=-1) - 1, 0)
    pth = jnp.take_along_axis(sorted_desc, cutoff_index[:, None], axis=-1)
    threshold = jnp.maximum(kth, jnp.where(top_p[:, None] < 1.0, pth, NEG_INF))
    return jnp.where(scaled >= threshold, scaled, NEG_INF)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V]; keys [B] (typed PRNG keys); per-row temperature/top_p/top_k [B].

    Returns (tokens int32 [B], logprobs float32 [B]).
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    temp = jnp.where(greedy, 1.0, temperature)
    scaled = logits / temp[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    needs_filter = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~greedy)
    # The sort behind top-k/top-p costs V log V per row: skip it when no row asks for it.
    filtered = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)
    # A draw costs one random number per vocabulary entry and row, most of a decode step for
    # a small model: skip it when every row is greedy (the draws would be discarded).
    drawn = jax.lax.cond(jnp.all(greedy), lambda k, f: jnp.zeros(f.shape[:1], jnp.int32),
                         lambda k, f: jax.vmap(jax.random.categorical)(k, f).astype(jnp.int32), keys, filtered)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
