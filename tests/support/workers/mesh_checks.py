"""Run the engine on meshes of 8 fake CPU devices and on one device, and print what each
generated as JSON (one line): the sharded pool must change nothing but where pages live.

Run by tests/engine/test_programs.py in a fresh process (XLA_FLAGS gives it 8 CPU devices):
    python tests/support/workers/mesh_checks.py
"""
import json

import jax
import numpy as np

from muajax import parallel
from muajax.engine.engine import Engine, SamplingParams
from muajax.models.qwen3 import init_params
from muajax.models.sharding import param_shardings
from tests.support.tiny_models import TINY_CONFIG

CFG = TINY_CONFIG.replace(vocab_size=128, intermediate_size=96, rope_theta=10000.0)
MESHES = {"one device": None, "data=2,fsdp=2,tensor=2": (2, 2, 2), "fsdp=8": (1, 8, 1), "fsdp=2,tensor=4": (1, 2, 4),
          # a training mesh split over sequence: the resident engine runs on the run's mesh
          "fsdp=2,sequence=4": (1, 2, 1, 4)}


def conversations(engine: Engine) -> list:
    """Two turns of five conversations on a shared prefix, in a pool that must preempt."""
    rng = np.random.RandomState(0)
    prefix = [int(t) for t in rng.randint(0, 128, 19)]
    engine.register_prefix(prefix)
    firsts = [prefix + [int(t) for t in rng.randint(0, 128, n)] for n in (3, 14, 1, 8, 5)]
    slots = [engine.open(p, seed=i) for i, p in enumerate(firsts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    gens = [engine.generate(slots, sampling)]
    for slot, n in zip(slots, (4, 1, 9, 2, 6)):
        engine.append(slot, [int(t) for t in rng.randint(0, 128, n)])
    gens.append(engine.generate(slots, sampling))
    return [[g.tokens, g.logprobs] for turn in gens for g in turn.values()]


def main() -> None:
    params = init_params(CFG, jax.random.key(0))
    out = {}
    for name, shape in MESHES.items():
        mesh = None if shape is None else parallel.make_mesh(*shape)
        placed = params if mesh is None else jax.device_put(params, param_shardings(CFG, mesh))
        shards = 1 if mesh is None else parallel.batch_divisor(mesh)
        # per shard: room for one 64-token conversation and a bit; five conversations need more
        engine = Engine(placed, CFG, num_slots=5, max_len=64, mesh=mesh, stop_ids=(), decode_chunk=4, page_size=8,
                        extend_widths=(8, 16), kv_cache_tokens=shards * 80)
        out[name] = {"generations": conversations(engine), "stats": {k: engine.stats[k] for k in (
            "preemptions", "prefix_hits", "prefix_prefill_tokens")}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
