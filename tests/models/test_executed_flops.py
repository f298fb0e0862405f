"""What a train step executes (`executed_step_flops`), against hand counts: each remat
policy's recomputation with each attention, the chunked LM head, the reference model, a
shared prefix."""
import pytest

from muajax.models.flops import ATTENTION_WORK, executed_step_flops, executed_step_parts, matmul_params, \
    splash_row_pairs, train_step_flops
from tests.support.tiny_models import TINY_CONFIG

CFG = TINY_CONFIG.replace(vocab_size=100, hidden_size=8, intermediate_size=16, head_dim=4)
B, T = 3, 6
D, F, N, KV, HD, V, LAYERS = 8, 16, 4, 2, 4, 100, 2
PROJ = 2 * LAYERS * (D * HD * (2 * N + 2 * KV) + 3 * D * F) * B * T   # the layers' projections, one forward
RERUN_PROJ = PROJ - 2 * LAYERS * F * D * B * T  # "full" runs them again but the MLP's down projection
HEAD = 2 * V * D * B * T
CAUSAL = T * (T + 1) / 2


def one_matmul(pairs):
    """One of attention's matmuls over every (query, key) pair, all layers and heads."""
    return 2 * HD * N * LAYERS * B * pairs


SPLASH = 128 * 128  # splash pads the 6 positions to one block of 128 lanes and computes it whole
# attention -> (pairs it computes, forward matmuls, backward matmuls); platform tpu
ATTENTION = {"splash": (SPLASH, 2, 3 + 4), "xla": (T * T, 2, 4), "chunked": (CAUSAL, 2, 5)}
# the attention forward matmuls each remat policy runs again in the backward (the layers'
# projections: only under "full")
RERUN = {"none": {"splash": 0, "xla": 0, "chunked": 0},
         "full": {"splash": 2, "xla": 2, "chunked": 2},
         "dots": {"splash": 2, "xla": 0, "chunked": 0},            # splash's outputs are no dots
         "dots_no_batch": {"splash": 2, "xla": 2, "chunked": 0}}  # the einsums have batch dims


def test_by_hand_counts():
    assert 2 * (matmul_params(CFG) - V * D) * B * T == PROJ
    assert set(ATTENTION_WORK) >= set(ATTENTION)
    # splash's blocks of 512 (or the row in whole lanes), the causal ones whole: 4 blocks of
    # 512 make 1 + 2 + 3 + 4; 1000 positions pad to 2 blocks, 1 + 2
    assert splash_row_pairs(2048) == 10 * 512 * 512
    assert splash_row_pairs(1000) == 3 * 512 * 512
    assert splash_row_pairs(200) == 256 * 256


@pytest.mark.parametrize("remat", list(RERUN))
@pytest.mark.parametrize("attention", list(ATTENTION))
def test_each_remat_policy_by_hand(remat, attention):
    cfg = CFG.replace(remat=remat, attention=attention)
    pairs, fwd, bwd = ATTENTION[attention]
    attn = one_matmul(pairs)
    parts = executed_step_parts(cfg, B, T, platform="tpu")
    assert parts["forward"] == pytest.approx(PROJ + fwd * attn + HEAD)
    assert parts["backward"] == pytest.approx(2 * PROJ + bwd * attn + 2 * HEAD)
    assert parts["recompute"] == pytest.approx((RERUN_PROJ if remat == "full" else 0) + RERUN[remat][attention] * attn)
    assert parts["reference"] == 0
    total = executed_step_flops(cfg, B, T, platform="tpu")
    assert total == pytest.approx(sum(parts.values()))
    if attention != "xla":  # the einsum scores every pair, the useful count only the causal ones
        assert total >= train_step_flops(cfg, B, T)


def test_reference_and_chunked_head():
    cfg = CFG.replace(remat="full", attention="splash")
    attn = one_matmul(SPLASH)
    base = executed_step_flops(cfg, B, T)
    with_ref = executed_step_flops(cfg, B, T, reference=True)
    assert with_ref - base == pytest.approx(PROJ + 2 * attn + HEAD)  # the reference's forward, no backward
    # the head in chunks runs under jax.checkpoint: its forward again in the backward
    assert executed_step_flops(cfg, B, T, logits_chunk=2) - base == pytest.approx(HEAD)
    assert executed_step_flops(cfg, B, T, logits_chunk=T) == pytest.approx(base)  # one chunk: no checkpoint


def test_attention_as_the_platform_resolves_it():
    cfg = CFG.replace(remat="none", attention="auto")
    # auto: splash on TPU, the einsum reference on CPU at 6 keys
    assert executed_step_parts(cfg, B, T, platform="tpu")["backward"] == \
        pytest.approx(2 * PROJ + 7 * one_matmul(SPLASH) + 2 * HEAD)
    assert executed_step_parts(cfg, B, T, platform="cpu")["backward"] == \
        pytest.approx(2 * PROJ + 4 * one_matmul(T * T) + 2 * HEAD)


def test_a_shared_prefix_runs_once_per_microbatch_in_the_cache_form():
    p, k = 4, 2
    cfg = CFG.replace(remat="full", attention="splash")  # the cache form has no splash: chunked runs
    rows = executed_step_parts(cfg, B, T, shared_prefix=p, microbatches=k)
    unit = 2 * (matmul_params(CFG) - V * D)  # one token through the layers' projections
    prefix_proj, rest_proj = k * p * unit, B * (T - p) * unit
    pairs = lambda rows_, q_pairs: 2 * HD * N * LAYERS * rows_ * q_pairs
    prefix_attn = k * pairs(1, p * (p + 1) / 2)
    rest_attn = pairs(B, (T - p) * p + (T - p) * (T - p + 1) / 2)  # the rest's queries see the prefix and theirs
    assert rows["forward"] == pytest.approx(prefix_proj + rest_proj + 2 * (prefix_attn + rest_attn) + HEAD)
    assert rows["backward"] == pytest.approx(2 * (prefix_proj + rest_proj) + 5 * (prefix_attn + rest_attn) + 2 * HEAD)
    down = 2 * LAYERS * F * D * (k * p + B * (T - p))
    assert rows["recompute"] == pytest.approx(prefix_proj + rest_proj - down + 2 * (prefix_attn + rest_attn))
    with pytest.raises(ValueError, match="shared prefix"):
        executed_step_flops(cfg, B, T, shared_prefix=T)


def test_a_mixture_of_experts_runs_its_experts_downs_again_under_full_remat():
    # the routing weights' gradient reads each expert's down output: "full" recomputes it
    moe = CFG.replace(remat="full", attention="splash", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=6)
    proj = 2 * LAYERS * (D * HD * (2 * N + 2 * KV) + D * 8 + 2 * 3 * D * 6) * B * T  # router + 2 active experts
    attn = one_matmul(SPLASH)
    parts = executed_step_parts(moe, B, T, platform="tpu")
    assert parts["forward"] == pytest.approx(proj + 2 * attn + HEAD)
    assert parts["backward"] == pytest.approx(2 * proj + 7 * attn + 2 * HEAD)
    assert parts["recompute"] == pytest.approx(proj + 2 * attn)  # the whole layer, downs included
