"""Packed GRPO rows (`muajax.runtime.grpo_packing`) give the padded step's loss and gradient:
the same trajectories, one per padded row or several per packed row with segment ids, in
float32, with and without a shared prefix, with the KL reference, per-token masks, old
logprobs and advantages, under every aggregation and GSPO's sequence-level ratio."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax import parallel
from muajax.models.qwen3 import init_params
from muajax.rl.grpo import GRPOConfig, grpo_loss_fn, make_grpo_step
from muajax.rl.optim import make_optimizer
from muajax.runtime.grpo_packing import pack_bins, packed_rows
from tests.support.tiny_models import ONE_LAYER_CONFIG

CFG = ONE_LAYER_CONFIG.replace(rope_theta=10000.0)
LENGTH = 48
PREFIX = 12
LENGTHS = (20, 31, 17, 44, 25, 16, 38, 22)  # several pack into one row of 48


def padded_batch(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = len(LENGTHS)
    prefix = rng.integers(1, CFG.vocab_size, PREFIX)
    tokens = np.zeros((n, LENGTH), np.int32)
    mask = np.zeros((n, LENGTH), np.int32)
    for i, length in enumerate(LENGTHS):
        tokens[i, :PREFIX] = prefix
        tokens[i, PREFIX:length] = rng.integers(1, CFG.vocab_size, length - PREFIX)
        turn = rng.integers(PREFIX + 2, length - 1)  # an agent turn after a user turn
        mask[i, turn:length] = 1
        mask[i, turn + 1: turn + 3] = 0  # and a tool result inside it
    old = np.where(mask > 0, rng.normal(-2.0, 0.5, mask.shape), 0.0).astype(np.float32)
    advantages = rng.normal(0, 1, n).astype(np.float32)
    return {"tokens": tokens, "loss_mask": mask, "old_logprobs": old, "advantages": advantages}


def packed_batch(batch: dict, shared_prefix: int, rows: int) -> dict:
    bins = pack_bins(LENGTHS, LENGTH, shared_prefix)
    assert len(bins) < len(LENGTHS)  # the rows do pack
    return packed_rows(batch, LENGTHS, bins, rows, shared_prefix=shared_prefix, pad_id=0)


def loss_and_grads(params, ref, batch, grpo, shared_prefix, segments=None):
    fn = grpo_loss_fn(CFG, grpo, temperature=0.9, shared_prefix=shared_prefix, segments=segments)

    def loss(p):
        total, denom, _ = fn(p, ref, {k: jnp.asarray(v) for k, v in batch.items()})
        return total / jnp.maximum(denom, 1.0)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.key(0))
    ref = jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    return params, ref


def assert_close(a, b, atol=2e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=atol)


@pytest.mark.parametrize("shared_prefix", [0, PREFIX])
@pytest.mark.parametrize("options", [dict(), dict(agg="seq-mean-token-mean"), dict(agg="seq-mean-token-sum-norm"),
                                     dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4)])
def test_packed_rows_give_the_padded_loss_and_gradient(model, shared_prefix, options):
    params, ref = model
    grpo = GRPOConfig(kl_coef=0.01, **options)
    batch = padded_batch()
    rows = len(pack_bins(LENGTHS, LENGTH, shared_prefix))
    packed = packed_batch(batch, shared_prefix, rows + 1)  # and a row of padding
    want_loss, want_grads = loss_and_grads(params, ref, batch, grpo, shared_prefix)
    loss, grads = loss_and_grads(params, ref, packed, grpo, shared_prefix, segments=len(LENGTHS) + 1)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-6)
    assert_close(grads, want_grads)
    assert packed["tokens"].size < batch["tokens"].size


def test_the_packed_step_updates_as_the_padded_one_in_microbatches(model):
    """The whole step (two microbatches, AdamW, metrics) on packed rows and on padded ones."""
    params, ref = model
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    grpo = GRPOConfig(kl_coef=0.01, agg="seq-mean-token-mean")
    batch = padded_batch(1)
    rows = len(pack_bins(LENGTHS, LENGTH, PREFIX))
    packed = packed_batch(batch, PREFIX, rows + rows % 2)
    out = []
    for data, segments in ((batch, None), (packed, len(LENGTHS) + 1)):
        step = make_grpo_step(CFG, make_optimizer(1e-3), mesh, grpo=grpo, shared_prefix=PREFIX, microbatches=2,
                              segments=segments, donate=False)
        out.append(step(step.init_state(params), data, ref))
    (padded_state, padded_metrics), (state, metrics) = out
    for key in ("loss", "grad_norm", "kl", "num_tokens", "num_seqs", "ratio_mean", "entropy"):
        np.testing.assert_allclose(float(metrics[key]), float(padded_metrics[key]), rtol=2e-5, err_msg=key)
    assert float(metrics["num_seqs"]) == len(LENGTHS)
    # AdamW moves every weight by about its learning rate whatever the gradient's size: the
    # gradients' float32 differences show up to ~1e-3 of one such move
    assert_close(state.params, padded_state.params, atol=1e-3 * 1e-3)


def test_a_loss_token_right_after_the_prefix_is_refused():
    batch = padded_batch()
    batch["loss_mask"][0, PREFIX] = 1
    with pytest.raises(ValueError, match="first after the shared prefix"):
        packed_batch(batch, PREFIX, len(LENGTHS))
