"""The decode floor as the whole model's step: `python -m muajax.bench generate`'s `xla_model_ms`.

`decode_floor.xla_step` times a decode step's products (the projections, the LM head and
the attention's two dots over the cache). A step of this model must also do the rest of
its arithmetic: the embedding lookup, two RMS norms a layer and the q and k norms, the
rotary embedding of q and k, the attention's softmax, SiLU, the final norm, and choosing
the token with its logprob (the GRPO loss needs it) over the whole vocabulary. On XLA:CPU
each of those is a loop XLA generates for the box's vector ISA, or a small reduction, not a
library matmul: a floor of products alone weighs the box's matmul kernels only, while the
step weighs both kinds, so the step's ratio to it moved with the box (an AVX2 box runs the
matmul library's kernels at a different speed against XLA's loops than an AVX-512 one, and
a loaded box stretches each of the step's ~200 small operations, not the floor's 60 dots).

This floor is that step written as plainly as XLA runs it: one token per row, a dense
cache per layer holding `context - 1` earlier positions ([rows, kv_heads, positions,
head_dim], read only, as HF lays it out), the new token's key and value attended beside it
and returned (so they are computed, as the engine's are written), greedy choice and its
logprob. No paging, no bucketing, no masks (every position is live), no stop conditions:
what the engine does beyond this is its own overhead. `steps` steps run in a loop inside
the program, each feeding its token to the next, and `calls` programs run one after
another, blocking between, as the engine's decode chunks do. The step's numbers are the
model's: `tests/bench/test_model_floor.py` checks its logits against transformers given
the same cache.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from muajax.bench import common


class ModelShape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    # keys cached [B, K, H, S] (positions minor) rather than HF's [B, K, S, H]: the scores'
    # dot then reads positions contiguously, which XLA:CPU runs 35-45% faster (bench model,
    # 1 and 8 rows); the engine's dense cache has HF's layout (docs/performance.md)
    keys_by_position: bool = False


def model_shape(hf_config) -> ModelShape:
    rope = getattr(hf_config, "rope_parameters", None) or {}  # transformers 5; earlier ones: top-level
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return ModelShape(hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.head_dim,
                      hf_config.rms_norm_eps, float(theta))


def model_weights(hf_model) -> dict:
    """The checkpoint's tensors as float32 numpy: per layer a dict (projections as [in, out]),
    then the embedding, the final norm and the head ([hidden, vocab])."""
    def t(p):
        return p.detach().float().numpy()

    layers = []
    for layer in hf_model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append({
            "in_norm": t(layer.input_layernorm.weight), "post_norm": t(layer.post_attention_layernorm.weight),
            "q_norm": t(a.q_norm.weight), "k_norm": t(a.k_norm.weight),
            **{n: np.ascontiguousarray(t(getattr(a, n + "_proj").weight).T) for n in "qkvo"},
            **{n: np.ascontiguousarray(t(getattr(m, n + "_proj").weight).T) for n in ("gate", "up", "down")}})
    return {"layers": layers, "embed": t(hf_model.model.embed_tokens.weight), "norm": t(hf_model.model.norm.weight),
            "head": np.ascontiguousarray(t(hf_model.lm_head.weight).T)}


def _rms(x, w, eps):
    import jax.numpy as jnp

    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def _rope(x, cos, sin):
    """HF's rotate-half rotary embedding; x [..., head_dim], cos/sin [head_dim]."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attend(q, k_new, v_new, keys, values, s: ModelShape):
    """One query per row over the cache's positions and its own key: q [B, N, H], k_new and
    v_new [B, K, H], values [B, K, S, H], keys [B, K, S, H] or, with `s.keys_by_position`,
    [B, K, H, S]; returns [B, N * H]."""
    import jax
    import jax.numpy as jnp

    b, group = q.shape[0], s.heads // s.kv_heads
    q = q.reshape(b, s.kv_heads, group, s.head_dim) * (s.head_dim ** -0.5)
    past = jnp.einsum("bkgh,bkhs->bkgs" if s.keys_by_position else "bkgh,bksh->bkgs", q, keys)
    own = jnp.einsum("bkgh,bkh->bkg", q, k_new)[..., None]
    probs = jax.nn.softmax(jnp.concatenate([past, own], axis=-1), axis=-1)
    out = jnp.einsum("bkgs,bksh->bkgh", probs[..., :-1], values) + probs[..., -1:] * v_new[:, :, None]
    return out.reshape(b, s.heads * s.head_dim)


def rope_at(positions, s: ModelShape):
    """cos and sin [..., head_dim] at `positions` (a scalar, or any array of positions)."""
    import jax.numpy as jnp

    inv = 1.0 / (s.rope_theta ** (jnp.arange(0, s.head_dim, 2, dtype=jnp.float32) / s.head_dim))
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv
    return tuple(jnp.concatenate([f(angles)] * 2, axis=-1) for f in (jnp.cos, jnp.sin))


def step_logits(weights: dict, caches: list, tokens, position, s: ModelShape):
    """The model's step for `tokens` [B] at `position` (a scalar) over `caches` (per layer
    (keys, values) [B, K, position, H]): logits [B, V] and each layer's new (key, value)."""
    cos, sin = rope_at(position, s)
    h, new = weights["embed"][tokens], []
    for w, (keys, values) in zip(weights["layers"], caches):
        h, kv = layer(w, h, cos, sin, lambda q, k, v: _attend(q, k, v, keys, values, s), s)
        new.append(kv)
    return head_logits(weights, h, s), new


def head_logits(weights: dict, h, s: ModelShape):
    """The final norm and the LM head on hidden states h [..., D]: logits [..., V]."""
    return _rms(h, weights["norm"], s.eps) @ weights["head"]


def layer(w: dict, h, cos, sin, attend, s: ModelShape):
    """One decoder layer on hidden states `h` [..., D] (any leading axes, one token each):
    the new hidden states and the layer's new (key, value) [..., K, H]. `attend(q, k, v)`
    gives the attention's output [..., N * H] from q [..., N, H] and k, v [..., K, H]."""
    import jax

    lead = h.shape[:-1]
    x = _rms(h, w["in_norm"], s.eps)
    q = _rope(_rms((x @ w["q"]).reshape(*lead, s.heads, s.head_dim), w["q_norm"], s.eps), cos, sin)
    k = _rope(_rms((x @ w["k"]).reshape(*lead, s.kv_heads, s.head_dim), w["k_norm"], s.eps), cos, sin)
    v = (x @ w["v"]).reshape(*lead, s.kv_heads, s.head_dim)
    h = h + attend(q, k, v) @ w["o"]
    x = _rms(h, w["post_norm"], s.eps)
    return h + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"], (k, v)


def _greedy(logits):
    """The first maximum and its logprob, as the engine's greedy rows report them, in the
    fewest passes over the vocabulary: the maximum, the first index holding it (XLA:CPU runs
    argmax's (value, index) reduction several times slower than a max and a min), and the
    maximum's logprob, -log(sum(exp(logits - max)))."""
    import jax.numpy as jnp

    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    token = jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)
    return token, -jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))


def random_caches(shape: ModelShape, layers: int, batch: int, positions: int) -> list:
    """Per layer, random (keys, values) on the device for `positions` cached positions:
    [batch, K, positions, H], keys [batch, K, H, positions] with `shape.keys_by_position`."""
    import jax

    rng = np.random.RandomState(0)
    values = (batch, shape.kv_heads, positions, shape.head_dim)
    keys = (batch, shape.kv_heads, shape.head_dim, positions) if shape.keys_by_position else values
    return [tuple(jax.device_put(rng.randn(*dims).astype(np.float32)) for dims in (keys, values))
            for _ in range(layers)]


def repeated(program, args: tuple, calls: int = 1):
    """A callable running jitted `program` on `args` `calls` times (each call waited for),
    with `.program` and `.args` kept for compiling it apart."""
    def run():
        out = None
        for _ in range(calls):
            out = common.block(program(*args))
        return out

    run.program, run.args = program, args
    return run


def xla_model_step(weights: dict, shape: ModelShape, batch: int, context: int, steps: int = 1, calls: int = 1):
    """A callable running `calls` programs of `steps` greedy decode steps of the whole model,
    each over `context` positions (the cache's `context - 1` and its own); divide by
    calls * steps. The weights are one device buffer each, as `Engine._layer_views` gives them."""
    import jax
    import jax.numpy as jnp

    put = jax.device_put
    w = {"layers": [{k: put(v) for k, v in layer.items()} for layer in weights["layers"]],
         **{k: put(weights[k]) for k in ("embed", "norm", "head")}}
    caches = random_caches(shape, len(w["layers"]), batch, context - 1)

    @jax.jit
    def program(w, caches, tokens):
        def body(_, carry):
            logits, new = step_logits(w, caches, carry[0], context - 1, shape)
            token, logprob = _greedy(logits)
            return token, logprob, new

        init = jax.eval_shape(lambda t: step_logits(w, caches, t, context - 1, shape)[1], tokens)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), init)
        return jax.lax.fori_loop(0, steps, body, (tokens, jnp.zeros(tokens.shape, jnp.float32), zeros))

    return repeated(program, (w, caches, jnp.zeros((batch,), jnp.int32)), calls)


def xla_stream_step(weights: dict, shape: ModelShape, batch: int, context: int, calls: int = 1):
    """A callable reading, `calls` times, the bytes a decode step must read: every weight it
    multiplies (the layers' and the head's; the embedding is one row) and `batch` rows of keys
    and values over `context` positions, each array summed once. The box's streaming rate sets
    its time, with no arithmetic worth the name: how a decode step's cost could grow with the
    history if attention read the cache as fast as memory gives it. Divide by `calls`."""
    import jax
    import jax.numpy as jnp

    arrays = [jax.device_put(a) for layer in weights["layers"] for a in layer.values()]
    arrays += [jax.device_put(weights[k]) for k in ("norm", "head")]
    arrays += [a for kv in random_caches(shape._replace(keys_by_position=False), len(weights["layers"]), batch, context)
               for a in kv]
    return repeated(jax.jit(lambda arrays: sum(jnp.sum(a) for a in arrays)), (arrays,), calls)
