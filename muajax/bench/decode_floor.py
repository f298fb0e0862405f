"""The arithmetic floor of one decode step, for `python -m muajax.bench generate`.

A decode step's unavoidable work is its matrix products: per layer the q, k, v, o, gate,
up and down projections of `batch` single-token rows, then the LM head, and the
attention's two products over each row's cache (scores against the keys, the weighted
sum of the values), which must read every cached key and value once. The norms and the
sampling are small beside them, and everything else is overhead. This times exactly those
products, on the same weights, once with torch (what transformers' step is built from)
and once jitted in XLA (what muajax's step is built from), and the time to stream every
weight from memory once (a torch sum: the bound for any float32 kernel at a small batch).

The XLA floor is timed twice: with the attention over a cache of the generation's mean
context (`Attention`; the bytes a step must read on average), and without it (the
matmuls alone, `xla_matmul_ms`). At the generate benchmark's size (8 rows, 128 + 128
tokens, 8 layers of 4 kv heads) the caches a step reads are about 15% of the weights'
bytes, so the attention is not small: measured, it adds 15-20% to the matmul floor. The
engine's decode is judged against the floor with it (`muajax_step_over_xla_floor`); its
ratio to the matmuls alone is reported beside (`muajax_step_over_matmul_floor`).

`transformers step / faster matmul floor` bounds the decode ratio of any engine built on
these matmul libraries; `transformers step / stream` bounds even a hand-written kernel.
`1 - torch floor / transformers step` is the share of transformers' step that is per-step
overhead.
"""
from __future__ import annotations

import numpy as np

from typing import NamedTuple

from muajax.bench import common


class Attention(NamedTuple):
    """The attention the floor's step computes per layer: `heads` query heads in groups over
    `kv_heads`, `head_dim` wide, over a cache of `context` positions per row."""

    heads: int
    kv_heads: int
    head_dim: int
    context: int

_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _weights(hf_model) -> list[np.ndarray]:
    """Every decode-step matrix as [in, out] float32 arrays: the layers' projections, then the head."""
    mats = []
    for layer in hf_model.model.layers:
        for block, name in _PROJECTIONS:
            mats.append(getattr(getattr(layer, block), name).weight.detach().numpy().T)
    mats.append(hf_model.lm_head.weight.detach().numpy().T)
    return mats


def torch_step(weights: list[np.ndarray], batch: int, threads: int):
    """The step's products as torch matmuls on `batch` rows, with `threads` intra-op threads
    (inputs of the right width; the values do not change the cost)."""
    import torch

    mats = [torch.from_numpy(np.ascontiguousarray(m.T)) for m in weights]  # [out, in], like nn.Linear
    inputs = {m.shape[1]: torch.ones(batch, m.shape[1]) for m in mats}

    def step():
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for m in mats:
                torch.nn.functional.linear(inputs[m.shape[1]], m)

    return step


def stream_step(weights: list[np.ndarray], threads: int):
    """Reads every weight once (a sum per matrix): what memory bandwidth alone allows."""
    import torch

    mats = [torch.from_numpy(np.ascontiguousarray(m)) for m in weights]

    def step():
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for m in mats:
                m.sum()

    return step


def xla_step(weights: list[np.ndarray], batch: int, steps: int = 1, calls: int = 1,
             attention: Attention | None = None):
    """The same products in jitted XLA, shaped as the engine's decode runs them; returns a
    callable that runs `calls` programs of `steps` decode steps each (divide by calls * steps).

    Within a step, each layer's q, k and v read the layer's input, o reads the attention's
    output (with `attention`: softmax(q K^T / sqrt(d)) V over the layer's cache of
    `context` positions, keys and values [batch, kv_heads, context, head_dim] as the
    engine's dense decode cache lays them out, two batched dots per layer; without: q
    stands in for it), gate and up read the residual, down reads
    their product, and the LM head reads the last residual: one product's output feeds the
    next, as in the step, so no two products overlap on the thread pool where the engine's
    cannot. Every product is a plain dot (`optimization_barrier` keeps any consumer out of
    its fusion), so XLA hands it to the kernel library it gives the engine's dots (YNNPACK
    on CPU in jax 0.10). Steps run in a loop inside the program, each fed the last one's
    (normalised) residual, and programs are called one after another, blocking between,
    as the engine runs `decode_chunk` steps a call: a floor timed over one short step
    saw less of the box's load than the engine's decode timed over all of its steps.

    The floor before this summed each product of one step into a scalar: XLA fused each dot
    with its sum into one loop it generates itself, a different kernel from the engine's,
    whose speed against the library's depends on the box (docs/performance.md)."""
    import jax
    import jax.numpy as jnp

    mats = [jax.device_put(m) for m in weights]  # each weight its own buffer, as `Engine._layer_views` gives them
    width = len(_PROJECTIONS)
    if (len(mats) - 1) % width:
        raise common.BenchError(f"expected {width} projections per layer and a head, got {len(mats)} matrices")
    barrier = jax.lax.optimization_barrier
    caches = _caches(len(mats) // width, batch, attention)

    def one_step(mats, caches, x):
        h, side = x, []
        for layer, i in enumerate(range(0, len(mats) - 1, width)):
            wq, wk, wv, wo, wg, wu, wd = mats[i:i + width]
            q, k, v = (barrier(h @ w) for w in (wq, wk, wv))
            side += [k, v]  # the cache's new entries: carried, so that they are computed
            a = q if attention is None else _attend(q, *caches[layer], attention)
            h = h + barrier(a @ wo)
            gate, up = (barrier(h @ w) for w in (wg, wu))
            h = h + barrier((gate * up) @ wd)
        return h, barrier(h @ mats[-1]), side

    @jax.jit
    def program(mats, caches, x):
        def body(_, carry):
            h, logits, side = one_step(mats, caches, carry[0])
            return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6), logits, side

        init = jax.eval_shape(lambda x: one_step(mats, caches, x), x)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), init)
        return jax.lax.fori_loop(0, steps, body, (x, zeros[1], zeros[2]))

    x0 = jnp.ones((batch, weights[0].shape[0]), jnp.float32)

    def run():
        out = None
        for _ in range(calls):
            out = common.block(program(mats, caches, x0))
        return out

    run.program, run.args = program, (mats, caches, x0)  # for inspecting what XLA made of it
    return run


def _caches(layers: int, batch: int, attention: Attention | None) -> list:
    """Per layer, keys and values [batch, kv_heads, context, head_dim] (random: the values do
    not change the cost); none without attention."""
    import jax

    if attention is None:
        return []
    shape = (batch, attention.kv_heads, attention.context, attention.head_dim)
    rng = np.random.RandomState(0)
    return [tuple(jax.device_put(rng.randn(*shape).astype(np.float32)) for _ in range(2)) for _ in range(layers)]


def _attend(q, keys, values, attention: Attention):
    """softmax(q K^T / sqrt(d)) V for one new token per row, query heads grouped over the
    kv heads, each product a plain batched dot; returns [batch, heads * head_dim]."""
    import jax
    import jax.numpy as jnp

    a, barrier = attention, jax.lax.optimization_barrier
    q = q.reshape(q.shape[0], a.kv_heads, a.heads // a.kv_heads, a.head_dim)
    scores = barrier(jnp.einsum("bkgh,bksh->bkgs", q, keys)) * (a.head_dim ** -0.5)
    out = barrier(jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(scores, axis=-1), values))
    return out.reshape(q.shape[0], a.heads * a.head_dim)


WARMUP = 2


def measure(hf_model, batch: int, hf_step_ms: float | None, muajax_step_ms: float, *, torch_threads=(1,),
            repeat: int = 20, muajax_decode=None, steps: int = 1, calls: int = 1,
            attention: Attention | None = None, whole_step: bool = False) -> dict:
    """The floors beside the measured steps (torch's: the fastest of `torch_threads`); logs a summary.
    The XLA floor runs `calls` programs of `steps` steps a round (the engine's decode chunks),
    with `attention` (`xla_floor_ms`) and without (`xla_matmul_ms`, the torch floors' work).
    `hf_step_ms` None (no transformers run): the XLA floors alone, no torch ones.
    `whole_step` (with `attention`): the floor the step is judged against (`xla_floor_ms`) is
    the model's whole step over the mean context (`muajax.bench.model_floor`), and the
    products alone are reported beside it (`xla_products_ms`).

    `muajax_decode`, optional: runs one muajax generation and returns its decode ms/step. It
    then takes its turn in every round beside the floors, and muajax's ratio to the XLA floor
    is of the two medians measured together: the box's speed drifts by tens of percent
    between runs, and a floor timed after muajax's rounds carried that drift into the ratio."""
    weights = _weights(hf_model)
    candidates = {}
    if hf_step_ms is not None:
        candidates = {f"torch_{n}": torch_step(weights, batch, n) for n in sorted(set(torch_threads))}
        candidates["stream"] = stream_step(weights, max(torch_threads))
    candidates["xla"] = xla_step(weights, batch, steps, calls)
    if attention is not None:
        candidates["xla_attention"] = xla_step(weights, batch, steps, calls, attention)
    if whole_step:  # in the engine's cache layout, and with the keys laid out by position (faster on XLA:CPU)
        from muajax.bench import model_floor

        shape, model_weights = model_floor.model_shape(hf_model.config), model_floor.model_weights(hf_model)
        for name, by_position in (("xla_model", False), ("xla_model_by_position", True)):
            candidates[name] = model_floor.xla_model_step(model_weights, shape._replace(keys_by_position=by_position),
                                                          batch, attention.context, steps, calls)
    decode_ms: list[float] = []
    if muajax_decode is not None:
        candidates["muajax"] = lambda: decode_ms.append(muajax_decode())
    seconds = {k: 1e3 * common.median(v)
               for k, v in common.interleave(candidates, warmup=WARMUP, repeat=repeat).items()}
    if muajax_decode is not None:
        seconds.pop("muajax")
        muajax_step_ms = common.median(decode_ms[WARMUP:])  # the timed rounds, after the warm-up calls
    xla_ms = seconds.pop("xla") / (steps * calls)
    products_ms = seconds.pop("xla_attention") / (steps * calls) if attention is not None else xla_ms
    floor_ms = seconds.pop("xla_model") / (steps * calls) if whole_step else products_ms
    fastest_ms = min(floor_ms, seconds.pop("xla_model_by_position") / (steps * calls)) if whole_step else floor_ms
    out = {"xla_matmul_ms": xla_ms, "xla_products_ms": products_ms, "xla_floor_ms": floor_ms,
           "xla_floor_kind": "model_step" if whole_step else ("products" if attention is not None else "matmuls"),
           "xla_floor_steps": steps * calls, "xla_floor_attention": attention._asdict() if attention is not None else None,
           "muajax_step_over_xla_floor": common.ratio(muajax_step_ms, floor_ms),
           # the same step with its cached keys [K, H, positions]: what a change of the engine's
           # cache layout could reach (docs/performance.md)
           "xla_floor_fastest_ms": fastest_ms, "muajax_step_over_fastest_floor": common.ratio(muajax_step_ms, fastest_ms),
           "muajax_step_over_products_floor": common.ratio(muajax_step_ms, products_ms),
           "muajax_step_over_matmul_floor": common.ratio(muajax_step_ms, xla_ms),
           "muajax_decode_ms": muajax_step_ms, "muajax_interleaved": muajax_decode is not None}
    _log_floors(out, batch, attention)
    if hf_step_ms is not None:
        out.update(_torch_figures(seconds, xla_ms, hf_step_ms))
    return out


def _log_floors(out: dict, batch: int, attention: Attention | None) -> None:
    what = {"model_step": "the model's whole step", "products": "the step's matmuls and attention",
            "matmuls": "the step's matmuls alone"}[out["xla_floor_kind"]]
    over = f" over {attention.context} cached positions" if attention is not None else ""
    common.log(f"decode floor ({what}{over}, batch {batch}, {out['xla_floor_steps']} steps): XLA "
               f"{out['xla_floor_ms']:.2f} ms (products alone {out['xla_products_ms']:.2f}, matmuls alone "
               f"{out['xla_matmul_ms']:.2f}); muajax's step {out['muajax_decode_ms']:.2f} ms is "
               f"x{out['muajax_step_over_xla_floor']:.2f} its XLA floor (x{out['muajax_step_over_fastest_floor']:.2f} the "
               f"floor's with keys by position, x{out['muajax_step_over_products_floor']:.2f} the products', "
               f"x{out['muajax_step_over_matmul_floor']:.2f} the matmuls')"
               + (" (timed in the same rounds)" if out["muajax_interleaved"] else ""))


def _torch_figures(seconds: dict, xla_ms: float, hf_step_ms: float) -> dict:
    """torch's floor and the weight stream against transformers' step (`seconds`: medians, ms)."""
    stream_ms = seconds.pop("stream")
    torch_ms = min(seconds.values())
    floor = min(torch_ms, xla_ms)
    out = {"torch_matmul_ms": torch_ms, "weight_stream_ms": stream_ms,
           "transformers_overhead_share": 1.0 - torch_ms / hf_step_ms,
           "decode_ratio_ceiling": common.ratio(hf_step_ms, floor),
           "decode_ratio_bandwidth_ceiling": common.ratio(hf_step_ms, stream_ms)}
    common.log(f"torch floor {torch_ms:.2f} ms; reading every weight once {stream_ms:.2f} ms; transformers' step "
               f"{hf_step_ms:.2f} ms is {100 * out['transformers_overhead_share']:.0f}% overhead")
    common.log(f"an engine on these matmul libraries can beat transformers' decode by at most "
               f"x{out['decode_ratio_ceiling']:.2f} here; a kernel at memory speed by x{out['decode_ratio_bandwidth_ceiling']:.2f}")
    return out
