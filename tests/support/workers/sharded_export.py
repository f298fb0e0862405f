"""The params fingerprint and the HF export of sharded params (tests/models/test_host_blocks.py).

    python tests/support/workers/sharded_export.py OUT_DIR MESH   (MESH: data,fsdp,tensor)

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8, in one process or (with
MUAJAX_COORDINATOR & co.) in two that split the devices: random params of a tiny untied
Qwen3 (seed 1) are laid out on the mesh with the trainer's shardings, then fingerprinted
(also with small blocks, so a leaf is read in many pieces) and exported in float32 and
bfloat16 to OUT_DIR/f32 and OUT_DIR/bf16 (process 0 writes). Prints one line `RESULT {json}`:
the fingerprints, whether the leaves were fully addressable, and, where they are, each
leaf's blocks read both ways (from the shards and through the collective path) compared.
"""
from __future__ import annotations

import json
import sys

import flax.linen as nn
import jax
import numpy as np

from muajax import parallel
from muajax.models import host_blocks
from muajax.models.hf import save_hf
from muajax.models.qwen3 import init_params
from muajax.models.sharding import param_shardings
from muajax.runtime.distributed import maybe_initialize_distributed
from tests.support.tiny_models import TINY_CONFIG

CONFIG = TINY_CONFIG.replace(tie_word_embeddings=False, num_layers=4)


def both_paths_agree(params) -> bool:
    """Every leaf's row blocks (small ones: many per leaf) read from the shards and through
    the jitted slice + allgather are equal."""
    for leaf in jax.tree.leaves(params):
        for starts, sizes in host_blocks.row_blocks(leaf.shape, leaf.dtype.itemsize, 2000):
            a = host_blocks._from_shards(leaf, starts, sizes)
            b = host_blocks._gathered(leaf, starts, sizes)
            if a.shape != b.shape or not np.array_equal(a, b):
                return False
    return True


def main(out_dir: str, mesh_shape: str) -> None:
    maybe_initialize_distributed()
    data, fsdp, tensor = (int(n) for n in mesh_shape.split(","))
    mesh = parallel.make_mesh(data, fsdp, tensor)
    params = nn.meta.unbox(init_params(CONFIG, jax.random.key(1)))
    params = jax.device_put(params, param_shardings(CONFIG, mesh))
    addressable = all(leaf.is_fully_addressable for leaf in jax.tree.leaves(params))
    sharded = sum(len({str(s.index) for s in leaf.addressable_shards}) > 1 for leaf in jax.tree.leaves(params))
    result = {"processes": jax.process_count(), "devices": len(jax.devices()), "fully_addressable": addressable,
              "leaves_split_here": sharded, "fingerprint": host_blocks.fingerprint(params),
              "fingerprint_small_blocks": host_blocks.fingerprint(params, block_bytes=2000)}
    if addressable:
        result["paths_agree"] = both_paths_agree(params)
    save_hf(params, CONFIG, f"{out_dir}/f32")
    save_hf(params, CONFIG, f"{out_dir}/bf16", dtype="bfloat16")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
