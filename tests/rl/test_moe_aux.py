"""The router's load-balancing loss in the GRPO and SFT steps of a mixture of experts
(`muajax.rl.moe_aux`): loss = policy loss + router_aux_loss_coef * aux, aux reported as
`moe/aux_loss`, the router's gradient changed by it, over the real tokens only, the same
aux for padded, packed and shared-prefix rows; a dense model has none of it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models.moe import load_balancing_loss
from muajax.models.qwen3 import forward, init_params
from muajax.rl.grpo import GRPOConfig, grpo_loss_fn
from muajax.rl.moe_aux import METRIC, real_tokens
from muajax.rl.sequence import sequence_logprobs
from muajax.rl.sft import sft_finalize, sft_loss_fn
from muajax.rl.step import shift_left
from tests.support.tiny_models import MOE_CONFIG, TINY_CONFIG

B, T, P = 4, 16, 4
_sequence = jax.jit(sequence_logprobs, static_argnames=("cfg", "shared_prefix"))
_forward = jax.jit(forward, static_argnames=("cfg", "return_routing"))


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(MOE_CONFIG, jax.random.key(0))


def _batch(seed=0, prefix=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MOE_CONFIG.vocab_size, (B, T)).astype(np.int32)
    if prefix:
        tokens[:, :P] = tokens[0, :P]
    mask = np.zeros((B, T), np.int32)
    mask[:, 6:12] = 1
    mask[1, 9:] = 0  # rows end their loss at different places; what follows is not real
    mask[3, :] = 0  # a padding row
    return dict(tokens=tokens, loss_mask=mask, old_logprobs=np.full((B, T), -3.0, np.float32),
                advantages=np.asarray([1.0, -1.0, 0.5, 0.0], np.float32))


def _loss(cfg, params, batch, shared_prefix=0):
    fn = grpo_loss_fn(cfg, GRPOConfig(kl_coef=0.0), temperature=1.0, shared_prefix=shared_prefix)

    def total(p):
        loss_sum, denom, sums = fn(p, None, {k: jnp.asarray(v) for k, v in batch.items()})
        return loss_sum / denom, sums

    return jax.jit(jax.value_and_grad(total, has_aux=True))(params)


def test_real_tokens_end_at_each_trajectory_s_last_loss_token():
    mask = jnp.asarray([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 1]])
    np.testing.assert_array_equal(real_tokens(mask), [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    packed = jnp.asarray([[0, 1, 0, 0, 1, 0]])
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0]])  # segment 1 ends at its loss token 1; 2 at 4; then padding
    np.testing.assert_array_equal(real_tokens(packed, seg), [[1, 1, 0, 1, 1, 0]])


def test_grpo_loss_adds_coef_times_the_aux_loss_and_it_moves_the_router(params):
    batch = _batch()
    (loss, sums), grads = _loss(MOE_CONFIG, params, batch)
    (loss0, sums0), grads0 = _loss(MOE_CONFIG.replace(router_aux_loss_coef=0.0), params, batch)
    aux = float(sums["moe_aux_sum"] / sums["num_tokens"])  # token-mean: the denominator is the token count
    assert MOE_CONFIG.router_aux_loss_coef > 0 and aux > 0.5  # E * sum(f * p) is ~k when balanced
    np.testing.assert_allclose(float(loss) - float(loss0), MOE_CONFIG.router_aux_loss_coef * aux, rtol=1e-4)
    router = grads["layers"]["router"] - grads0["layers"]["router"]
    assert float(jnp.max(jnp.abs(router))) > 1e-5 * float(jnp.max(jnp.abs(grads0["layers"]["router"])))
    # the last layer's experts feed no router: the aux loss gives them no gradient
    np.testing.assert_allclose(grads["layers"]["expert_up"][-1], grads0["layers"]["expert_up"][-1], atol=1e-9)


def test_the_aux_loss_is_that_of_the_real_tokens_and_leaves_the_logprobs_alone(params):
    batch = _batch()
    tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
    valid = real_tokens(mask)
    logp, _, terms = _sequence(params, MOE_CONFIG, tokens, shift_left(tokens), moe_valid=valid)
    plain, _ = _sequence(params, MOE_CONFIG, tokens, shift_left(tokens))
    reads = np.asarray(shift_left(mask)) > 0
    np.testing.assert_allclose(np.asarray(logp)[reads], np.asarray(plain)[reads], atol=1e-6)
    # the real tokens alone, row by row, as their own forward: HF's loss over them
    rows = [np.asarray(tokens[b, : int(valid[b].sum())]) for b in range(B) if valid[b].any()]
    fractions, probs, counts = [], [], []
    for row in rows:
        _, _, out = _forward(params, MOE_CONFIG, jnp.asarray(row)[None], return_routing=True)
        fractions.append(out.fraction * len(row)), probs.append(out.mean_prob * len(row)), counts.append(len(row))
    want = load_balancing_loss(sum(fractions) / sum(counts), sum(probs) / sum(counts))
    np.testing.assert_allclose(float(load_balancing_loss(*terms)), float(want), rtol=1e-5)


def test_a_shared_prefix_and_packed_rows_count_the_same_tokens(params):
    batch = _batch(1, prefix=True)
    tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
    valid = real_tokens(mask)
    full = _sequence(params, MOE_CONFIG, tokens, shift_left(tokens), moe_valid=valid)
    shared = _sequence(params, MOE_CONFIG, tokens, shift_left(tokens), moe_valid=valid, shared_prefix=P)
    reads = np.asarray(shift_left(mask)) > 0
    np.testing.assert_allclose(np.asarray(shared[0])[reads], np.asarray(full[0])[reads], atol=1e-5)
    np.testing.assert_allclose(float(load_balancing_loss(*shared[2])), float(load_balancing_loss(*full[2])),
                               rtol=1e-5)
    # rows 0 and 1 packed into one row behind the prefix: [prefix | row 0's rest | row 1's rest]
    rest = T - P
    packed_tokens = jnp.concatenate([tokens[0], tokens[1, P:]])[None]
    seg = jnp.asarray([[1] * T + [2] * rest])
    packed_mask = jnp.concatenate([mask[0], mask[1, P:]])[None]
    packed = _sequence(params, MOE_CONFIG, packed_tokens, shift_left(packed_tokens), shared_prefix=P,
                               segment_ids=seg, moe_valid=real_tokens(packed_mask, seg))
    two = _sequence(params, MOE_CONFIG, tokens[:2], shift_left(tokens[:2]), moe_valid=valid[:2])
    np.testing.assert_allclose(float(load_balancing_loss(*packed[2])), float(load_balancing_loss(*two[2])),
                               rtol=1e-5)


def test_sft_reports_the_aux_loss_and_a_dense_model_has_none(params):
    batch = {k: jnp.asarray(v) for k, v in _batch().items() if k in ("tokens", "loss_mask")}
    loss_sum, denom, sums = jax.jit(sft_loss_fn(MOE_CONFIG))(params, None, batch)
    metrics = sft_finalize(denom, sums)
    assert float(metrics[METRIC]) > 0.5
    np.testing.assert_allclose(float(loss_sum / denom), float(metrics["nll"]) + MOE_CONFIG.router_aux_loss_coef
                               * float(metrics[METRIC]), rtol=1e-5)
    dense = jax.jit(init_params, static_argnums=0)(TINY_CONFIG, jax.random.key(0))
    _, denom, sums = jax.jit(sft_loss_fn(TINY_CONFIG))(dense, None, batch)
    assert METRIC not in sft_finalize(denom, sums) and "moe_aux_sum" not in sums
    (_, sums), _ = _loss(TINY_CONFIG, dense, _batch())
    assert "moe_aux_sum" not in sums
