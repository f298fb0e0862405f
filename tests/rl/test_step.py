"""The sharded GRPO train step: exactness (microbatches, meshes), skip-on-non-finite, the
no-KL path, layouts. The compiled runs happen once, in a subprocess with 8 fake CPU
devices (tests/support/workers/step_checks.py); these tests check its measurements.
Trace-only and argument checks run here."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax import parallel
from muajax.rl.optim import make_optimizer, make_schedule
from muajax.rl.grpo import GRPOConfig, make_grpo_step
from muajax.rl.step import model_abstract_params
from tests.support import step_scenarios
from tests.support.tiny_models import TINY_CONFIG


def scenario(name: str) -> dict:
    return step_scenarios.scenario("grpo", name)


def test_loss_matches_the_documented_alignment():
    r = scenario("alignment")
    m = r["metrics"]
    assert abs(m["loss"] - r["want_loss"]) < 1e-6
    assert m["kl"] > 0 and abs(m["kl"] - r["want_kl"]) < 1e-7
    assert m["num_tokens"] == r["want_num_tokens"]
    assert 0 < m["entropy"] <= r["log_vocab"] + 1e-4
    for key in ("pg_loss", "clip_frac", "clip_frac_low", "clip_frac_high", "grad_norm", "num_seqs"):
        assert np.isfinite(m[key]), key
    assert m["lr"] == pytest.approx(1e-4) and m["skipped"] == 0 and m["step"] == 1
    assert r["step"] == 1 and r["skipped"] == 0
    assert r["param_delta"] > 5e-5  # the update really moved the weights (lr 1e-4)


@pytest.mark.parametrize("k", ["2", "4"])
def test_microbatches_give_the_full_batch_update(k):
    r = scenario("microbatches")[k]
    for key, diff in r["metric_diffs"].items():
        assert diff <= (2e-6 if key == "entropy" else 5e-7), (key, diff)
    assert r["mu_diff"] <= 1e-8 and r["nu_diff"] <= 1e-11  # the gradients themselves
    assert r["param_diff"] <= 1e-5


def test_nan_in_the_batch_skips_the_update_and_counts_it():
    r = scenario("skip")
    bad = r["nan_batch"]
    assert bad["metrics"]["skipped"] == 1 and bad["metrics"]["skipped_total"] == 1
    assert np.isnan(bad["metrics"]["loss"])
    assert bad["step"] == 1 and bad["skipped"] == 1 and bad["unchanged"]
    good = r["next_good"]  # the skipped step consumed neither the update nor the schedule
    assert good["metrics"]["skipped"] == 0 and good["metrics"]["skipped_total"] == 1
    assert good["step"] == 2 and good["adam_count"] == 1 and good["param_delta"] > 5e-5


def test_nan_param_skips_the_update():
    r = scenario("skip")["nan_param"]
    assert r["metrics"]["skipped"] == 1 and r["skipped"] == 1
    assert r["still_nan"] and r["unchanged"]


def test_no_kl_step_equals_the_kl_less_loss():
    r = scenario("no_kl")
    assert abs(r["metrics"]["loss"] - r["want_loss"]) < 1e-6
    assert abs(r["metrics"]["pg_loss"] - r["want_pg_loss"]) < 1e-6
    assert r["metrics"]["kl"] == 0.0


EXPECTED_AXES = {"(8, 1, 1)x1": [], "(1, 8, 1)x1": ["fsdp"], "(2, 2, 2)x1": ["fsdp", "tensor"],
                 "(1, 2, 4)x1": ["fsdp", "tensor"], "(2, 2, 2)x4": ["fsdp", "tensor"]}


@pytest.mark.parametrize("mesh", sorted(EXPECTED_AXES))
def test_mesh_matches_one_device_and_follows_the_rules(mesh):
    out = scenario("meshes")
    assert out["base"]["skipped"] == 0 and out["base"]["kl"] > 0 and out["base_param_delta"] > 5e-5
    r = out[mesh]
    assert r["layout_problems"] == []
    assert r["sharded_axes"] == EXPECTED_AXES[mesh]
    assert r["loss_diff"] <= 1e-5 and r["kl_diff"] <= 1e-6 and r["grad_norm_diff"] <= 1e-5, r
    assert r["param_diff"] <= 1e-5, r
    assert r["mu_diff"] <= 1e-8 and r["nu_diff"] <= 1e-11, r


# ----------------------------------------------------------------------------- in-process, no compile

CFG = TINY_CONFIG.replace(vocab_size=96, hidden_size=32, intermediate_size=64, head_dim=8)


def tiny_batch(b=8, t=12):
    rng = np.random.default_rng(0)
    return dict(tokens=rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32),
                loss_mask=np.ones((b, t), np.int32), old_logprobs=np.zeros((b, t), np.float32),
                advantages=np.where(np.arange(b) % 2, 0.5, -0.5).astype(np.float32))


def count_dots(step, params, *frozen):
    state = step.abstract_state(params)
    batch = {k: jnp.asarray(v) for k, v in tiny_batch().items()}
    with parallel.activation_rules(step.mesh):
        jaxpr = jax.make_jaxpr(lambda s, b, *f: step._update(s, b, f[0] if f else None))(state, batch, *frozen)
    return str(jaxpr).count("dot_general")


def test_no_kl_path_traces_no_reference_forward():
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = model_abstract_params(CFG)  # shapes are all tracing needs
    opt = make_optimizer(1e-4)
    no_kl = make_grpo_step(CFG, opt, mesh, grpo=GRPOConfig(kl_coef=0.0))
    with_kl = make_grpo_step(CFG, opt, mesh, grpo=GRPOConfig(kl_coef=1e-3))
    n0, n1 = count_dots(no_kl, params), count_dots(with_kl, params, params)
    # The reference forward adds one forward's matmuls: 7 in the layer body, 2 in attention, the head.
    assert n1 - n0 >= 10, (n0, n1)
    assert no_kl.frozen_shardings is None
    with pytest.raises(ValueError, match="kl_coef == 0"):
        no_kl(None, tiny_batch(), params)
    with pytest.raises(ValueError, match="reference"):
        with_kl(None, tiny_batch())


def test_bad_batches_fail_before_compiling():
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    step = make_grpo_step(CFG, make_optimizer(1e-4), mesh, grpo=GRPOConfig(kl_coef=0.0), microbatches=4)
    with pytest.raises(ValueError, match="4 microbatches"):
        step(None, tiny_batch(b=6))
    ragged = tiny_batch()
    ragged["advantages"] = ragged["advantages"][:4]
    with pytest.raises(ValueError, match="same leading"):
        step(None, ragged)
    with pytest.raises(ValueError, match="microbatches must be"):
        make_grpo_step(CFG, make_optimizer(1e-4), mesh, microbatches=0)


def test_schedules():
    const = make_schedule(1e-6)
    assert float(const(0)) == pytest.approx(1e-6) and float(const(10_000)) == pytest.approx(1e-6)
    cos = make_schedule(5e-6, "warmup_cosine", warmup_steps=10, total_steps=110)
    assert float(cos(0)) == 0.0
    assert float(cos(10)) == pytest.approx(5e-6)
    assert float(cos(60)) == pytest.approx(2.5e-6, rel=1e-3)
    assert float(cos(110)) == pytest.approx(0.0, abs=1e-12)
    warm = make_schedule(1e-6, warmup_steps=4)
    assert float(warm(2)) == pytest.approx(0.5e-6) and float(warm(100)) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="total_steps"):
        make_schedule(1e-6, "warmup_cosine", warmup_steps=10)
    with pytest.raises(ValueError, match="schedule must be"):
        make_schedule(1e-6, "linear")
