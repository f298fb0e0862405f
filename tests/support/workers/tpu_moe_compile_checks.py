"""Compile a mixture of experts' engine programs on the Pallas path for a TPU topology with the
real TPU compiler (libtpu), from this CPU host: with and without recording each token's
experts (`record_experts`), with and without token tiles; print per-program facts as JSON
(one line).

Run by tests/engine/test_moe_engine.py in a fresh process: python tests/support/workers/tpu_moe_compile_checks.py v5p:2x2x1
"""
import json
import sys

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

from muajax import parallel
from muajax.engine.programs import abstract_programs
from tests.support.workers.tpu_compile_checks import CFG

MOE = CFG.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)


def main(topology: str) -> None:
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = Mesh(np.array(devices).reshape(1, len(devices) // 2, 2, 1, 1), parallel.MESH_AXES,
                axis_types=(AxisType.Auto,) * len(parallel.MESH_AXES))
    out = {}
    for tiled in (False, True):
        for record in (False, True):
            calls = abstract_programs(MOE, mesh, kv_cache_tokens=64 * 1024, page_size=64, max_seqs=32, max_len=4096,
                                      extend_tile=64, max_extend_tokens=4096, decode_chunk=4, attention="pallas",
                                      deterministic=tiled, record_experts=record)
            for call in calls:
                compiled = call.lower().compile()
                outputs = [(list(x.shape), str(x.dtype)) for x in jax.tree.leaves(compiled.out_info)]
                out[f"{call.name}{' tiled' if tiled else ''}{' record' if record else ''}"] = {
                    "kernel": "ragged_paged_attention" in compiled.as_text(), "outputs": outputs,
                    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
