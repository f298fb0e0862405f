"""A Qwen3-MoE HF checkpoint loaded tensor by tensor onto a mesh (tests/models/test_moe_hf.py).

    python tests/support/workers/moe_sharded_load.py HF_DIR OUT_DIR MESH   (MESH: data,fsdp,tensor,expert)

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8: loads HF_DIR with the params'
shardings from their logical axes (`muajax.models.sharding.param_shardings`), then exports it
to OUT_DIR. Prints one line `RESULT {json}`: each MoE param's PartitionSpec and the one the
rules give, how many distinct blocks each is split into, the logits of a fixed batch, and
whether every leaf equals a single-device load of the same directory.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from muajax import parallel
from muajax.models.hf import load_params, save_hf
from muajax.models.qwen3 import forward_jit, logical_axes
from muajax.models.sharding import param_shardings

MOE_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")


def main(hf_dir: str, out_dir: str, mesh_shape: str) -> None:
    data, fsdp, tensor, expert = (int(n) for n in mesh_shape.split(","))
    mesh = parallel.make_mesh(data, fsdp, tensor, expert=expert)
    one, cfg = load_params(hf_dir)
    params, _ = load_params(hf_dir, cfg, shardings=param_shardings(cfg, mesh))
    axes = logical_axes(cfg)["layers"]
    specs = {name: [str(params["layers"][name].sharding.spec),
                    str(parallel.logical_to_spec(params["layers"][name].shape, axes[name], mesh)),
                    len({str(s.index) for s in params["layers"][name].addressable_shards})]
             for name in MOE_PARAMS}
    equal = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(one),
                                                                             jax.tree.leaves(params)))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 9)), jnp.int32)
    logits, _ = forward_jit(params, cfg, tokens)
    save_hf(params, cfg, out_dir)
    print("RESULT " + json.dumps({"devices": len(jax.devices()), "specs": specs, "equal_to_one_device": equal,
                                  "logits": np.asarray(logits).tolist()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
