"""Compile the engine's decode and extend programs for a mesh on 8 fake CPU devices, at two
pool sizes and two gathered lengths, and print their collectives as JSON (one line).

Run by tests/engine/test_programs.py in a fresh process (XLA_FLAGS gives it 8 CPU devices):
    python tests/support/workers/collective_checks.py DATA,FSDP,TENSOR
"""
import json
import re
import sys

from muajax import parallel
from muajax.engine.programs import abstract_programs
from tests.support.tiny_models import TINY_CONFIG

CFG = TINY_CONFIG.replace(num_heads=8, num_kv_heads=4)
OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
INSTRUCTION = re.compile(r"^\s*%?\S+ = (.+?) (" + "|".join(OPS) + r")(-start)?\(")


def collectives(hlo: str) -> list[str]:
    """'op result-type' of every collective instruction, sorted."""
    found = []
    for line in hlo.splitlines():
        match = INSTRUCTION.match(line)
        if match:
            shapes = re.sub(r"\{[^}]*\}", "", match.group(1))  # drop layouts
            found.append(f"{match.group(2)} {shapes}")
    return sorted(found)


def main(mesh_text: str) -> None:
    data, fsdp, tensor = map(int, mesh_text.split(","))
    mesh = parallel.make_mesh(data, fsdp, tensor)
    out = {}
    for pool_tokens, dense_tokens in ((16 * 1024, 256), (32 * 1024, 256), (16 * 1024, 512)):
        calls = abstract_programs(CFG, mesh, kv_cache_tokens=pool_tokens, page_size=8, max_seqs=16, max_len=1024,
                                  extend_tile=16, max_extend_tokens=512, decode_chunk=4,
                                  dense_tokens=dense_tokens)
        for call in calls:
            hlo = call.lower().compile().as_text()
            out[f"{call.name} pool={pool_tokens} dense={dense_tokens}"] = collectives(hlo)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
