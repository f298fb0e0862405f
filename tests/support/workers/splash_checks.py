"""Splash attention on meshes, run by tests/models/test_attention.py in a fresh process
(4 fake CPU devices; libtpu for the TPU compiler). Prints one JSON line:

  cpu_mesh     {kv_heads: max errors of forward and q/k/v gradients against the reference}
               for splash under shard_map on a (data 1, fsdp 2, tensor 2) CPU mesh;
  tpu_compile  a tiny Qwen3's loss gradient with attention="splash" compiled by the real
               TPU compiler for v5p:2x2x1 on the same mesh shape: the Pallas custom calls.
"""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from muajax import parallel
from muajax.models.attention import attention
from muajax.models.qwen3 import abstract_params, forward
from muajax.models.sharding import param_shardings
from tests.support.tiny_models import TINY_CONFIG


def cpu_mesh() -> dict:
    mesh = parallel.make_mesh(1, 2, 2, devices=jax.devices("cpu"))
    rng = np.random.RandomState(0)
    seg = jnp.asarray([[1] * 60 + [2] * 70 + [0] * 20] * 2 + [[1] * 150] * 2, jnp.int32)
    weight = jnp.asarray(rng.randn(4, 150, 4, 64), jnp.float32) * (seg > 0)[:, :, None, None]
    out = {}
    for kv_heads in (2, 1):
        q = jnp.asarray(rng.randn(4, 150, 4, 64), jnp.float32)
        k, v = (jnp.asarray(rng.randn(4, kv_heads, 150, 64), jnp.float32) for _ in range(2))
        results = {}
        for impl in ("xla", "splash"):
            fn = lambda q, k, v: attention(q, k, v, implementation=impl, segment_ids=seg, block=128)
            with jax.set_mesh(mesh):
                results[impl] = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * weight), argnums=(0, 1, 2)))(
                    q, k, v)
        (loss, grads), (ref_loss, ref_grads) = results["splash"], results["xla"]
        errors = {"loss_rel": float(abs(loss - ref_loss) / abs(ref_loss))}
        errors.update({name: float(jnp.abs(a - b).max()) for name, a, b in zip("qkv", grads, ref_grads)})
        out[str(kv_heads)] = errors
    return out


def tpu_compile() -> dict:
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = parallel.make_mesh(1, 2, 2, devices=devices)
    cfg = TINY_CONFIG.replace(hidden_size=128, intermediate_size=256, head_dim=128, dtype="bfloat16",
                              param_dtype="bfloat16", attention="splash")
    shardings = param_shardings(cfg, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nn.meta.unbox(abstract_params(cfg)), shardings)
    rows = jax.ShapeDtypeStruct((4, 200), jnp.int32, sharding=parallel.batch_sharding(mesh))

    def loss(p, tokens, segment_ids):
        return jnp.mean(forward(p, cfg, tokens, segment_ids=segment_ids)[0].astype(jnp.float32) ** 2)

    with parallel.activation_rules(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, rows, rows).compile()
    text = compiled.as_text()
    return {"platform": devices[0].platform, "devices": len(devices),
            "tpu_custom_calls": text.count('custom_call_target="tpu_custom_call"'),
            "splash_kernel_named": "splash" in text,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


if __name__ == "__main__":
    from muajax.planning.topology import libtpu_available

    print(json.dumps({"cpu_mesh": cpu_mesh(), "tpu_compile": tpu_compile() if libtpu_available() else None}))
