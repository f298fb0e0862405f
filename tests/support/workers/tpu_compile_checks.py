"""Compile the engine's programs on the Pallas path for a TPU topology with the real TPU
compiler (libtpu), from this CPU host, at two pool sizes, and print per-program facts as
JSON (one line).

Run by tests/engine/test_programs.py in a fresh process: python tests/support/workers/tpu_compile_checks.py v5p:2x2x1
"""
import json
import sys

import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

from muajax import parallel
from muajax.engine.programs import abstract_programs
from tests.support.tiny_models import TINY_CONFIG
from tests.support.workers.collective_checks import collectives

CFG = TINY_CONFIG.replace(vocab_size=1024, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4,
                          head_dim=128, dtype="bfloat16")


def main(topology: str) -> None:
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    # two data-parallel shards of pages, kv heads split over tensor=2
    mesh = Mesh(np.array(devices).reshape(1, len(devices) // 2, 2, 1, 1), parallel.MESH_AXES,
                axis_types=(AxisType.Auto,) * len(parallel.MESH_AXES))
    out = {}
    for pool_tokens, tiled in ((64 * 1024, False), (128 * 1024, False), (64 * 1024, True)):
        calls = abstract_programs(CFG, mesh, kv_cache_tokens=pool_tokens, page_size=64, max_seqs=32, max_len=4096,
                                  extend_tile=64, max_extend_tokens=4096, decode_chunk=4,
                                  attention="pallas", deterministic=tiled)
        for call in calls:
            compiled = call.lower().compile()
            hlo = compiled.as_text()
            mem = compiled.memory_analysis()
            out[f"{call.name}{' tiled' if tiled else ''} pool={pool_tokens}"] = {
                "device_kind": devices[0].device_kind, "kernel": "ragged_paged_attention" in hlo,
                "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
                "collectives": collectives(hlo)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
