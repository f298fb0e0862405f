"""The GRPO step of a tiny mixture of experts on 8 fake CPU devices, experts split over
expert = 2, 4 and 8 beside fsdp and tensor, against the one-device step
(tests/rl/test_moe_step.py). Run with XLA_FLAGS=--xla_force_host_platform_device_count=8.

Prints one JSON line: {"base": metrics, "<mesh>x<k>": {differences from the one-device step
with as many microbatches (the aux loss is each microbatch's own), the expert weights'
layout}}; a mesh that raised reports {"error": traceback}.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("run me with XLA_FLAGS=--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from muajax import parallel  # noqa: E402
from muajax.models.qwen3 import init_params  # noqa: E402
from muajax.rl import group_advantages  # noqa: E402
from muajax.rl.grpo import GRPOConfig, make_grpo_step  # noqa: E402
from muajax.rl.moe_aux import METRIC  # noqa: E402
from muajax.rl.optim import make_optimizer  # noqa: E402
from tests.support.tiny_models import MOE_CONFIG  # noqa: E402

# 8 experts (expert = 8 holds one each), heads and expert width divisible by tensor; a
# coefficient large enough that the aux loss's gradient is not lost in float noise
CFG = MOE_CONFIG.replace(num_heads=8, num_kv_heads=4, rope_theta=10000.0, router_aux_loss_coef=0.01)
B, T = 16, 16
# (data, fsdp, tensor, sequence, expert), microbatches
MESHES = [((1, 4, 1, 1, 2), 1), ((1, 2, 2, 1, 2), 1), ((1, 2, 1, 1, 4), 1), ((1, 1, 2, 1, 4), 1),
          ((1, 1, 1, 1, 8), 1), ((1, 2, 2, 1, 2), 2)]
# as tests/support/workers/step_checks.py: Adam's first step is ~lr*sign(g), so gradients are
# compared through its mu (0.1 g) and nu (0.001 g^2)
OPT = make_optimizer(1e-4, weight_decay=0.01, grad_clip=1.0)
GRPO = GRPOConfig(kl_coef=0.05)


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.6).astype(np.int32)
    mask[:, :3] = 0  # a prompt
    mask[::5, 12:] = 0  # rows that end early: their last tokens are not real for the aux loss
    return dict(tokens=rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32), loss_mask=mask,
                old_logprobs=(-rng.random((B, T)) * 6).astype(np.float32),
                advantages=np.asarray(group_advantages(rng.integers(0, 2, B).astype(np.float32),
                                                       np.repeat(np.arange(B // 4), 4).astype(np.int32), B)))


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def adam(state):
    return state.opt_state[1][0]  # chain(clip, adamw); adamw = chain(scale_by_adam, ...)


def run(params, ref, batch, shape=(1, 1, 1, 1, 1), k=1):
    mesh = parallel.make_mesh(*shape, devices=jax.devices()[: math.prod(shape)])
    step = make_grpo_step(CFG, OPT, mesh, grpo=GRPO, microbatches=k)
    state, metrics = step(step.init_state(params), batch, jax.device_put(ref, step.frozen_shardings))
    return state, {key: float(v) for key, v in metrics.items()}


def compare(params, ref, batch, base, base_m, shape, k) -> dict:
    start = time.process_time()
    state, m = run(params, ref, batch, shape, k)
    specs = {name: str(state.params["layers"][name].sharding.spec)
             for name in ("expert_gate", "expert_up", "expert_down", "router")}
    state = host(state)
    return {"loss_diff": abs(m["loss"] - base_m["loss"]), "kl_diff": abs(m["kl"] - base_m["kl"]),
            "aux_diff": abs(m[METRIC] - base_m[METRIC]), "grad_norm_diff": abs(m["grad_norm"] - base_m["grad_norm"]),
            "param_diff": max_diff(state.params, base.params), "mu_diff": max_diff(adam(state).mu, adam(base).mu),
            "nu_diff": max_diff(adam(state).nu, adam(base).nu), "specs": specs,
            "cpu_s": round(time.process_time() - start, 2)}


def main():
    assert len(jax.devices()) == 8, jax.devices()
    init = jax.jit(init_params, static_argnums=0)
    params = init(CFG, jax.random.key(0))
    ref = jax.tree.map(lambda p, n: p + 0.05 * n, params, init(CFG, jax.random.key(1)))
    batch = make_batch()
    bases = {}
    for k in sorted({k for _, k in MESHES}):  # the aux loss is each microbatch's: compare like with like
        state, metrics = run(params, ref, batch, k=k)
        bases[k] = host(state), metrics
    out = {"base": bases[1][1], "base_param_delta": max_diff(bases[1][0].params, host(params))}
    for shape, k in MESHES:
        try:
            out[f"{shape}x{k}"] = compare(params, ref, batch, *bases[k], shape, k)
        except Exception:  # report and go on: one broken mesh should not hide the others
            out[f"{shape}x{k}"] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
