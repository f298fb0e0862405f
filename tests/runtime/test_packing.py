"""SFT packing: whole conversations in fixed-length rows with segment ids, and a packed batch
gives the same loss and gradient as the same conversations one to a row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models.qwen3 import init_params
from muajax.rl.sft import sft_loss_fn
from muajax.runtime.host_batch import sft_batch
from muajax.runtime.packing import pack, packed_batch, plan_packing
from tests.support.tiny_models import TINY_CONFIG

PAD = 0


def conversations(lengths, seed=0, vocab=61):
    """(ids, assistant mask) pairs: a system/user opening, then alternating spans, like rendered chats."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, vocab, n).tolist()
        mask = np.zeros(n, np.int32)
        for start in range(5, n, 9):
            mask[start:start + 4] = 1
        out.append((ids, mask.tolist()))
    return out


def test_pack_fills_rows_first_fit_decreasing_and_places_every_conversation_once():
    lengths = [70, 20, 50, 30, 90, 10, 40]
    bins = pack(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) == 4  # 310 tokens need at least 4 rows of 100; FFD finds 4
    with pytest.raises(ValueError, match="101 tokens does not fit a packed row of 100"):
        pack([101, 5], 100)


def test_packed_batch_layout():
    examples = conversations([12, 7, 20])
    batch = packed_batch(examples, [[2], [0, 1]], PAD, 24, 3, context_weight=0.5, context_start=2)
    tokens, mask, seg = batch["tokens"], batch["loss_mask"], batch["segment_ids"]
    assert tokens.shape == mask.shape == seg.shape == (3, 24)
    assert (seg[0] == [1] * 20 + [0] * 4).all() and (seg[1] == [1] * 12 + [2] * 7 + [0] * 5).all()
    assert (seg[2] == 0).all() and (mask[2] == 0).all() and (tokens[2] == PAD).all()
    assert tokens[1, 12:19].tolist() == examples[1][0] and mask[1, 13:19].tolist() == examples[1][1][1:]
    assert mask[1, 12] == 0  # a conversation's first token is never a target of the one before
    context = batch["context_mask"]
    assert (context[1, 12:14] == 0).all() and (context[1, 14:19][mask[1, 14:19] == 0] == 0.5).all()
    assert (context[mask == 1] == 0).all() and (context[seg == 0] == 0).all()


def test_plan_packs_every_step_into_the_most_rows_any_needs():
    steps = {0: [100, 20, 20], 1: [60, 60, 60], 2: [10, 10, 10]}
    plan = plan_packing(steps.__getitem__, 3, length=128, batch_size=3, row_multiple=2, shared_prefix=0, mode="auto")
    assert plan.rows == 2 and plan.enabled  # step 1 needs 2 rows of 128; 2 x 128 < 3 x 128
    off = plan_packing(steps.__getitem__, 3, length=128, batch_size=3, row_multiple=2, shared_prefix=0, mode="off")
    assert not off.enabled and off.rows == 3
    # a long shared system prompt run once makes unpacked rows cheaper: auto keeps them
    shared = plan_packing(steps.__getitem__, 3, length=128, batch_size=3, row_multiple=2, shared_prefix=100,
                          mode="auto")
    assert not shared.enabled and shared.unpacked_tokens == 3 * 128 - 2 * 100


@pytest.mark.parametrize("attention", ["xla", "chunked"])
def test_packed_rows_give_the_loss_and_gradient_of_unpacked_ones(attention):
    cfg = TINY_CONFIG.replace(vocab_size=61, hidden_size=32, intermediate_size=64, attention=attention)
    params = init_params(cfg, jax.random.key(3))
    examples = conversations([40, 17, 33, 25, 9])
    bins = pack([len(ids) for ids, _ in examples], 64)
    packed = packed_batch(examples, bins, PAD, 64, len(bins) + 1, context_weight=0.3, context_start=3)
    unpacked = sft_batch(examples, PAD, 40, context_weight=0.3, context_start=3)
    unpacked["loss_mask"][:, 0] = 0  # (a rendered conversation's first token is never the assistant's)
    assert len(bins) < len(examples)
    loss_fn = sft_loss_fn(cfg, logits_chunk=16)

    def loss_and_grad(batch):
        def loss(p):
            total, denom, sums = loss_fn(p, None, {k: jnp.asarray(v) for k, v in batch.items()})
            return total / denom, (denom, sums["num_tokens"])
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss_p, (denom_p, n_p)), grads_p = loss_and_grad(packed)
    (loss_u, (denom_u, n_u)), grads_u = loss_and_grad(unpacked)
    assert float(n_p) == float(n_u) > 0 and float(denom_p) == pytest.approx(float(denom_u))
    np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=2e-6)
    for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)
