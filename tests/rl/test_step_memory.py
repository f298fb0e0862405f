"""A whole GRPO step's temporaries (forward, backward, reference forward, AdamW) grow
linearly with the length under `chunked` attention and logits chunks, quadratically under
the einsum reference: what `muajax.plan` shows for a small model, from XLA's own analysis."""
import jax
import jax.numpy as jnp
import pytest

from muajax import parallel
from muajax.rl.grpo import GRPOConfig, make_grpo_step
from muajax.rl.optim import make_optimizer
from muajax.rl.step import model_abstract_params
from tests.support.tiny_models import TINY_CONFIG

CFG = TINY_CONFIG.replace(vocab_size=1024, head_dim=32, remat="full")


def step_temporaries(attention: str, length: int) -> int:
    cfg = CFG.replace(attention=attention)
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    step = make_grpo_step(cfg, make_optimizer(1e-6), mesh, grpo=GRPOConfig(logits_chunk=512))
    params = model_abstract_params(cfg)
    rows = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=parallel.batch_sharding(mesh, len(shape)))
    batch = {"tokens": rows((1, length), jnp.int32), "loss_mask": rows((1, length), jnp.int32),
             "old_logprobs": rows((1, length), jnp.float32), "advantages": rows((1,), jnp.float32)}
    reference = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params,
                             step.frozen_shardings)
    compiled = step.lower(step.abstract_state(params), batch, reference).compile()
    return compiled.memory_analysis().temp_size_in_bytes


# chunked: the bound (4.5x for 4x the positions); above 1.5 so that the measure is
# seen to depend on the length at all (params and AdamW state are a fixed part). xla: its
# [T, T] score blocks make the same measure grow ~16x, which shows what the bound catches.
@pytest.mark.parametrize("attention, low, high", [("chunked", 1.5, 4.5), ("xla", 10.0, None)])
def test_step_temporaries_from_2048_to_8192_positions(attention, low, high):
    short, long = step_temporaries(attention, 2048), step_temporaries(attention, 8192)
    growth = long / short
    assert growth >= low and (high is None or growth <= high), (short, long, growth)
