"""One SFT step of a tiny Qwen3 through `run_steps`, with jax's persistent compilation cache
in the directory given: prints the step's time/compile_s and the cache hits as JSON. Run
twice by tests/train/test_compilation.py (a resumed run is a new process)."""
import json
import sys

import jax
import numpy as np

from muajax import parallel
from muajax.models.qwen3 import init_params
from muajax.rl.optim import make_optimizer
from muajax.rl.sft import make_sft_step
from muajax.train.compilation import enable_compilation_cache
from muajax.train.loop import CallbackHook, run_steps
from tests.support.tiny_models import TINY_CONFIG

enable_compilation_cache(sys.argv[1])
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event)
                                       if event == "/jax/compilation_cache/cache_hits" else None)
cfg = TINY_CONFIG.replace(vocab_size=128, attention="chunked")
step_fn = make_sft_step(cfg, make_optimizer(1e-3), parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                        logits_chunk=32)
batch = {"tokens": np.ones((2, 96), np.int32), "loss_mask": np.ones((2, 96), np.int32)}
records = []
state = step_fn.init_state(init_params(cfg, jax.random.key(0)))
hits.clear()  # count the train step's compile only
run_steps(state, 0, 1, lambda s, i: (step_fn(s, batch)[0], {}), [CallbackHook(lambda i, s, r: records.append(r))])
print(json.dumps({"compile_s": records[0]["time/compile_s"], "step_s": records[0]["time/step_s"],
                  "cache_hits": len(hits)}))
