"""Expert parallelism: `moe_dispatch.expert_ffn` on 8 fake CPU devices, experts split over
expert = 2, 4 and 8 beside fsdp, tensor, data and sequence, equals `grouped_experts` on one
device in its output and in every gradient; the tokens really travel by all-to-all and each
device holds only its share of the experts. Without a mesh it is `grouped_experts`."""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from muajax.models.moe import grouped_experts
from muajax.models.moe_dispatch import expert_ffn
from tests.support import workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 2e-5  # float32, values and gradients of size ~1-10: summation order only


@functools.lru_cache(maxsize=None)
def _checks() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # LLVM opt level 0 halves compile time; both sides of every comparison share it
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, workers.path("moe_dispatch_checks.py")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mesh(key: str) -> dict:
    sizes = key.split(" n=")[0].strip("()").split(", ")
    return dict(zip(("data", "fsdp", "tensor", "sequence", "expert"), map(int, sizes)))


def test_expert_parallel_ffn_equals_one_device():
    out = _checks()
    dispatched = [k for k in out if k.endswith("n=48")]
    assert {_mesh(k)["expert"] for k in dispatched} == {2, 4, 8}
    for key, r in out.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["out"] <= TOL, (key, r)
        assert max(r["grads"].values()) <= TOL, (key, r)
        # each device holds E / expert experts: 16 of them here
        assert r["expert_shard"] == 16 // _mesh(key)["expert"], (key, r)


def test_tokens_travel_by_all_to_all_when_the_expert_axis_splits_them():
    out = _checks()
    for key, r in out.items():
        # 48 tokens split over every mesh's token axes; 12 over expert=8 and 6 over expert=4 are
        # not: every device then holds them all and runs its own experts' copies (a psum adds them)
        assert r["all_to_all"] == key.endswith("n=48"), (key, r)
        assert r["psum"], (key, r)


def test_without_a_mesh_it_is_grouped_experts():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    index = jnp.asarray([[0, 3], [2, 1], [3, 0], [1, 1 + 1], [0, 2]], jnp.int32)
    weight = jnp.asarray(rng.random((5, 2)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((4, 8, 6)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32)
    np.testing.assert_array_equal(expert_ffn(x, index, weight, gate, up, down),
                                  grouped_experts(x, index, weight, gate, up, down))


def test_an_expert_index_past_the_experts_is_no_expert():
    # the dispatch pads its buffers with index E (weight 0): grouped_experts must give 0 there
    # and leave the real rows as they are (`ragged_dot` computes nothing past the groups)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((3, 8, 6)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((3, 6, 8)), jnp.float32)
    index = jnp.asarray([[0], [3], [2], [3]], jnp.int32)
    weight = jnp.asarray([[1.0], [0.0], [1.0], [0.0]], jnp.float32)
    out = jax.jit(grouped_experts)(x, index, weight, gate, up, down)
    real = jax.jit(grouped_experts)(x[::2], index[::2], weight[::2], gate, up, down)
    np.testing.assert_array_equal(out[1::2], 0.0)
    np.testing.assert_allclose(out[::2], real, rtol=1e-6, atol=1e-6)
