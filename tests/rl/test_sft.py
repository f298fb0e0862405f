"""The SFT step: loss on assistant tokens only, the same sharded machinery as GRPO. The
compiled runs happen in a subprocess with 8 fake CPU devices
(tests/support/workers/step_checks.py sft)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from muajax.rl import token_logprobs
from muajax.rl.sft import sft_terms
from tests.support import step_scenarios

B, T, V = 4, 16, 96


def test_masked_targets_do_not_enter_the_loss():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(B, T, V)).astype(np.float32))
    targets = rng.integers(0, V, (B, T))
    mask = (rng.random((B, T)) < 0.5).astype(np.int32)
    changed = np.where(mask == 1, targets, (targets + 7) % V)
    loss_a, n_a, _ = sft_terms(token_logprobs(logits, jnp.asarray(targets)), mask)
    loss_b, n_b, _ = sft_terms(token_logprobs(logits, jnp.asarray(changed)), mask)
    assert float(loss_a) == float(loss_b) and float(n_a) == float(n_b) == mask.sum()
    # ...while changing an unmasked target does change it.
    flip = targets.copy()
    r, c = np.argwhere(mask == 1)[0]
    flip[r, c] = (flip[r, c] + 1) % V
    loss_c, _, _ = sft_terms(token_logprobs(logits, jnp.asarray(flip)), mask)
    assert float(loss_c) != float(loss_a)
    # A -inf logprob on a masked position (e.g. padding) gives neither inf nor nan.
    logp = token_logprobs(logits, jnp.asarray(targets)).at[np.where(mask == 0)].set(-jnp.inf)
    grad = jax.grad(lambda lp: sft_terms(lp, mask)[0])(logp)
    assert np.isfinite(float(sft_terms(logp, mask)[0])) and np.all(np.isfinite(np.asarray(grad)))


def test_context_tokens_add_their_weighted_nll_but_logs_stay_the_assistants():
    rng = np.random.default_rng(2)
    logp = jnp.asarray(-rng.random((B, T)).astype(np.float32) * 3)
    own = (rng.random((B, T)) < 0.3).astype(np.int32)
    context = 0.25 * ((rng.random((B, T)) < 0.8) & (own == 0)).astype(np.float32)
    loss, denom, sums = sft_terms(logp, own, context=jnp.asarray(context))
    lp = np.asarray(logp, np.float64)
    np.testing.assert_allclose(float(loss), -(lp * (own + context)).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(denom), own.sum() + context.sum(), rtol=1e-6)
    _, _, plain = sft_terms(logp, own)
    assert float(sums["nll_sum"]) == float(plain["nll_sum"]) and float(sums["num_tokens"]) == own.sum()
    # a context weight on an assistant position never counts twice
    _, denom_overlap, _ = sft_terms(logp, own, context=jnp.ones((B, T)))
    assert float(denom_overlap) == B * T


def test_sft_step_is_the_masked_token_mean_nll():
    r = step_scenarios.scenario("sft", "sft")
    m = r["metrics"]
    assert abs(m["loss"] - r["want_loss"]) < 1e-6 and m["nll"] == m["loss"]
    assert m["num_tokens"] == r["want_num_tokens"] and m["skipped"] == 0
    assert 0 < m["entropy"] < 10


def test_sft_tail_of_non_assistant_tokens_does_not_change_the_loss():
    r = step_scenarios.scenario("sft", "sft")
    assert r["tail_loss"] == r["metrics"]["loss"]
    assert r["hit_loss"] != r["metrics"]["loss"]  # while an assistant token does


def test_sft_sharded_microbatched_step_matches_one_device():
    r = step_scenarios.scenario("sft", "sft")["sharded_microbatched"]
    assert r["loss_diff"] < 1e-6 and r["grad_norm_diff"] < 1e-6 and r["mu_diff"] < 1e-8
    assert r["param_delta"] > 1e-3  # lr 1e-2: the step really moved the weights


def test_sft_steps_learn_the_assistant_tokens():
    r = step_scenarios.scenario("sft", "sft")
    losses = r["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.3, losses
    assert r["final_step"] == 4


def test_copy_warmup_batch_repeats_its_span_and_masks_only_the_predictable_copy():
    from muajax.rl.sft import copy_warmup_batch

    ids = [5, 9, 11, 40, 41]
    batch = copy_warmup_batch(np.random.default_rng(0), ids, 3, 11)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    assert tokens.shape == mask.shape == (3, 11) and tokens.dtype == np.int32
    assert set(np.unique(tokens)) <= set(ids)
    np.testing.assert_array_equal(tokens[:, :5], tokens[:, 5:10])
    # position t predicts t+1: the repeat's second token onwards is a copy, its first is not
    assert (mask[:, :6] == 0).all() and (mask[:, 6:] == 1).all()
    again = copy_warmup_batch(np.random.default_rng(0), ids, 3, 11)["tokens"]
    np.testing.assert_array_equal(tokens, again)
