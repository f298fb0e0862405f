"""Expert-parallel `expert_ffn` on 8 fake CPU devices against `grouped_experts` on one
(tests/models/test_moe_dispatch.py). Run with XLA_FLAGS=--xla_force_host_platform_device_count=8.

Prints one JSON line: {mesh: {"out": max |diff|, "grads": {arg: max |diff|}, "all_to_all": bool,
"psum": bool, "expert_shard": local experts per device}}; a mesh that raised reports {"error": ...}.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("run me with XLA_FLAGS=--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from muajax import parallel  # noqa: E402
from muajax.models.moe import grouped_experts  # noqa: E402
from muajax.models.moe_dispatch import expert_ffn  # noqa: E402

N, D, E, F, K = 48, 16, 16, 8, 3
# (data, fsdp, tensor, sequence, expert): expert 2, 4 and 8 beside fsdp, tensor, data and sequence
MESHES = [(1, 4, 1, 1, 2), (1, 2, 2, 1, 2), (2, 1, 1, 2, 2), (1, 2, 1, 1, 4), (1, 1, 2, 1, 4), (1, 1, 1, 1, 8)]
AXES = {"x": ("activation_tokens", "activation_embed"), "index": ("activation_tokens", "norm"),
        "weight": ("activation_tokens", "norm"),
        "gate": ("exp", "embed", "moe_mlp"), "up": ("exp", "embed", "moe_mlp"), "down": ("exp", "moe_mlp", "embed")}


def inputs(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, E))
    if n > 8:
        logits[: n // 2, :3] += 4.0  # half the tokens crowd onto the first experts: uneven sends
    index = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    weight = rng.random((n, K)).astype(np.float32)
    return {"x": rng.standard_normal((n, D)).astype(np.float32), "index": index, "weight": weight,
            "gate": (0.3 * rng.standard_normal((E, D, F))).astype(np.float32),
            "up": (0.3 * rng.standard_normal((E, D, F))).astype(np.float32),
            "down": (0.3 * rng.standard_normal((E, F, D))).astype(np.float32)}


def value_and_grads(fn, args: dict, cot):
    def loss(x, weight, gate, up, down):
        out = fn(x, args["index"], weight, gate, up, down)
        return jnp.sum(out * cot), out

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    return lambda a: grad(a["x"], a["weight"], a["gate"], a["up"], a["down"])


def on_mesh(shape, args: dict, cot):
    mesh = parallel.make_mesh(*shape)
    shardings = {k: NamedSharding(mesh, parallel.logical_to_spec(v.shape, AXES[k], mesh)) for k, v in args.items()}
    placed = jax.device_put(args, shardings)
    fn = jax.jit(value_and_grads(expert_ffn, args, jax.device_put(cot, shardings["x"])))
    with parallel.activation_rules(mesh):
        compiled = fn.lower(placed).compile()
        grads, out = compiled(placed)
    hlo = compiled.as_text()
    local = placed["gate"].addressable_shards[0].data.shape[0]
    return out, grads, {"all_to_all": "all-to-all" in hlo, "psum": "all-reduce" in hlo, "expert_shard": local}


@functools.lru_cache(maxsize=None)
def one_device(n: int):
    args = inputs(n)
    cot = np.random.default_rng(1).standard_normal((n, D)).astype(np.float32)
    return args, cot, jax.jit(value_and_grads(grouped_experts, args, cot))(args)


def compare(shape, n: int) -> dict:
    args, cot, (want_grads, want) = one_device(n)
    out, grads, info = on_mesh(shape, args, cot)
    names = ("x", "weight", "gate", "up", "down")
    diffs = {k: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for k, a, b in zip(names, grads, want_grads)}
    return {"out": float(np.max(np.abs(np.asarray(out) - np.asarray(want)))), "grads": diffs,
            "scale": float(np.max(np.abs(np.asarray(want)))), **info}


def main():
    assert len(jax.devices()) == 8, jax.devices()
    results = {}
    # N tokens split over every mesh's token axes; 12 tokens on expert=8 are not: the local-only path
    for shape, n in [(m, N) for m in MESHES] + [((1, 1, 1, 1, 8), 12), ((1, 1, 2, 1, 4), 6)]:
        key = f"{shape} n={n}"
        try:
            results[key] = compare(shape, n)
        except Exception:
            results[key] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
