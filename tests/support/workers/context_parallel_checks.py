"""Context parallelism on 8 fake CPU devices, run by tests/models/test_context_parallel.py in
a fresh process. Prints one JSON line:

  attention   {mesh: {impl: max errors of the output and the q/k/v gradients}} for xla,
              chunked and splash (interpret mode) on meshes whose sequence axis splits the
              rows in 2 and 4, against the einsum reference on one device: packed segments,
              GQA 2, 150 positions (not a multiple of any block);
  cache_form  chunked's cache-form mask with the queries split over sequence=2;
  split       per-device bytes of the xla attention's temporaries with the positions split
              over sequence=4 or not (rows over fsdp=2 in both), and the program's
              all-gathers: proof that each device holds a quarter of the scores;
  sft_step    {mesh: max errors} of a whole SFT step (tiny Qwen3, packed rows, chunked
              logits) against the same step on one device: loss, grad norm, new params.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np

from muajax import parallel
from muajax.models.attention import attention
from muajax.models.qwen3 import init_params
from muajax.rl.optim import make_optimizer
from muajax.rl.sft import make_sft_step
from tests.support.tiny_models import TINY_CONFIG

MESHES = {"fsdp2_seq2": (1, 2, 1, 2), "fsdp2_seq4": (1, 2, 1, 4), "tensor2_seq2": (1, 2, 2, 2)}
BLOCKS = {"xla": None, "chunked": 16, "splash": 128}


def mesh_of(shape):
    return parallel.make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])


def _inputs(b=4, t=150, n=4, k=2, h=64, seed=0):
    rng = np.random.RandomState(seed)
    seg = jnp.asarray([[1] * (t // 3) + [2] * (t // 2) + [0] * (t - t // 3 - t // 2)] * (b // 2) + [[1] * t] * (b - b // 2), jnp.int32)
    arrays = [jnp.asarray(rng.randn(*shape), jnp.float32) for shape in
              ((b, t, n, h), (b, k, t, h), (b, k, t, h), (b, t, n, h))]
    return seg, arrays


def _run(fn, args, weight, mesh):
    step = jax.jit(lambda *a: (fn(*a), jax.grad(lambda *a: jnp.sum(fn(*a) * weight), argnums=(0, 1, 2))(*a)))
    if mesh is None:
        return step(*args)
    with jax.set_mesh(mesh):
        return step(*args)


def _errors(got, want, valid):
    (out, grads), (ref, ref_grads) = got, want
    errors = {"out": float(np.abs(np.asarray(out - ref))[valid].max())}
    errors.update({name: float(jnp.abs(a - b).max()) for name, a, b in zip("qkv", grads, ref_grads)})
    return errors


def attention_checks() -> dict:
    seg, (q, k, v, cot) = _inputs()
    valid = np.asarray(seg > 0)
    weight = cot * (seg > 0)[:, :, None, None]
    call = lambda impl: lambda q, k, v: attention(q, k, v, implementation=impl, segment_ids=seg, block=BLOCKS[impl])
    ref = _run(call("xla"), (q, k, v), weight, None)
    return {name: {impl: _errors(_run(call(impl), (q, k, v), weight, mesh_of(shape)), ref, valid) for impl in BLOCKS}
            for name, shape in MESHES.items()}


def cache_form_check() -> dict:
    """Queries at offsets into a 96-slot cache, rows of different lengths, 64 new queries split in two."""
    _, (q, k, v, cot) = _inputs(b=2, t=64)
    k, v = (jnp.concatenate([x, x[:, :, :32]], axis=2) for x in (k, v))
    lengths = jnp.asarray([20, 32], jnp.int32)
    q_index = lengths[:, None] + jnp.arange(64)[None]
    kv_valid = jnp.arange(96)[None] < (lengths + 64)[:, None]
    fn = lambda impl: lambda q, k, v: attention(q, k, v, implementation=impl, q_index=q_index, kv_valid=kv_valid,
                                                block=16 if impl == "chunked" else None)
    ref = _run(fn("xla"), (q, k, v), cot, None)
    return _errors(_run(fn("chunked"), (q, k, v), cot, mesh_of((1, 2, 1, 2))), ref, np.ones((2, 64), bool))


def split_check() -> dict:
    """Rows over fsdp=2, their positions split over sequence=4 or not at all."""
    seg, (q, k, v, cot) = _inputs(b=4, t=512, n=4, k=2, h=64)
    fn = lambda q, k, v: jnp.sum(attention(q, k, v, implementation="xla", segment_ids=seg) * cot)
    out = {}
    for name, shape in {"seq4": (1, 2, 1, 4), "seq1": (1, 2, 1, 1)}.items():
        mesh = mesh_of(shape)
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(q, k, v).compile()
        out[name] = {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                     "all_gathers": compiled.as_text().count("all-gather")}
    return out


def sft_step_check() -> dict:
    cfg = TINY_CONFIG.replace(vocab_size=97, intermediate_size=96, head_dim=32, attention="chunked")
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(1)
    tokens = rng.randint(1, 97, (4, 96)).astype(np.int32)
    seg = np.asarray([[1] * 40 + [2] * 50 + [0] * 6, [1] * 96, [1] * 10 + [2] * 80 + [0] * 6, [1] * 96], np.int32)
    batch = {"tokens": tokens, "loss_mask": (seg > 0).astype(np.int32), "segment_ids": seg}
    results = {}
    for name, shape in {"one_device": (1, 1, 1, 1), **MESHES}.items():
        # eps 1: the first AdamW update is ~ lr * gradient, so the params compare the gradients
        step = make_sft_step(cfg, make_optimizer(1e-2, eps=1.0), mesh_of(shape), logits_chunk=20, donate=False)
        state, metrics = step(step.init_state(params), batch)
        results[name] = (jax.device_get(state.params), {k: float(v) for k, v in metrics.items()})
    ref_params, ref_metrics = results.pop("one_device")
    out = {}
    for name, (p, m) in results.items():
        param_err = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_params)))
        out[name] = {"loss": abs(m["loss"] - ref_metrics["loss"]), "grad_norm_rel":
                     abs(m["grad_norm"] - ref_metrics["grad_norm"]) / ref_metrics["grad_norm"], "params": param_err}
    return out


if __name__ == "__main__":
    print(json.dumps({"attention": attention_checks(), "cache_form": cache_form_check(), "split": split_check(),
                      "sft_step": sft_step_check()}))
