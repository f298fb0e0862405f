"""The compile-heavy train-step checks (group "grpo" for tests/rl/test_step.py, "sft" for
tests/rl/test_sft.py), each group run in one subprocess.

Why a subprocess: the 8 fake CPU devices need XLA_FLAGS set before jax starts, which a
pytest process that already imported jax cannot do; and every distinct step is an XLA
compile of several CPU-seconds, so all of them share one process (and LLVM opt level 0,
set by the caller, which halves compile time and is the same for every compared run).

Prints one JSON line: {scenario: measurements}; a scenario that raised reports
{"error": traceback}. The pass/fail thresholds live in the test.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("run me with XLA_FLAGS=--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from muajax import parallel  # noqa: E402
from muajax.models.qwen3 import forward, init_params, logical_axes  # noqa: E402
from muajax.rl import group_advantages, policy_loss, token_logprobs  # noqa: E402
from muajax.rl.optim import make_optimizer  # noqa: E402
from muajax.rl.sft import make_sft_step  # noqa: E402
from muajax.rl.grpo import GRPOConfig, make_grpo_step  # noqa: E402
from tests.support.tiny_models import TINY_CONFIG  # noqa: E402

# Every sharded dimension divides by 8 (fsdp) and 4 (tensor), so each rule really bites.
CFG = TINY_CONFIG.replace(num_heads=8, num_kv_heads=4, rope_theta=10000.0)
B, T = 16, 16
KL = GRPOConfig(kl_coef=0.05)
NO_KL = GRPOConfig(kl_coef=0.0)
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
# lr 1e-4: Adam's first step is ~lr*sign(g), so a gradient that is 0 up to float noise
# (~1e-9 here) moves by O(lr) differently under another summation order; gradients
# themselves are compared through Adam's mu (0.1 g) and nu (0.001 g^2).
OPT = make_optimizer(1e-4, weight_decay=0.01, grad_clip=1.0)


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.6).astype(np.int32)
    mask[:, :3] = 0  # a prompt
    return dict(tokens=rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32), loss_mask=mask,
                old_logprobs=(-rng.random((B, T)) * 6).astype(np.float32),
                # each row's group advantage, as the host batch gives it (runtime.host_batch.with_advantages)
                advantages=np.asarray(group_advantages(rng.integers(0, 2, B).astype(np.float32),
                                                       np.repeat(np.arange(B // 4), 4).astype(np.int32), B)))


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def flat(tree, is_leaf=None):
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {jax.tree_util.keystr(p): leaf for p, leaf in pairs}


def adam(state):
    return state.opt_state[1][0]  # chain(clip, adamw); adamw = chain(scale_by_adam, ...)


def floats(metrics):
    return {k: float(v) for k, v in metrics.items()}


_STEPS: dict = {}


def get_step(mesh_shape=(1, 1, 1), k=1, options=KL):
    key = (mesh_shape, k, options)
    if key not in _STEPS:
        mesh = parallel.make_mesh(*mesh_shape, devices=jax.devices()[: math.prod(mesh_shape)])
        _STEPS[key] = make_grpo_step(CFG, OPT, mesh, grpo=options, microbatches=k)
    return _STEPS[key]


def run(params, ref, batch, mesh_shape=(1, 1, 1), k=1, options=KL):
    step = get_step(mesh_shape, k, options)
    args = (batch,) if ref is None else (batch, jax.device_put(ref, step.frozen_shardings))
    return step(step.init_state(params), *args)


@jax.jit
def manual_loss(params, ref, batch):
    """(loss, metrics) with the KL (coef 0.05) and without it.

    The documented alignment written out: position t predicts token t+1.
    """
    tokens = batch["tokens"]
    targets = tokens[:, 1:]
    logp = token_logprobs(forward(params, CFG, tokens)[0][:, :-1], targets)
    ref_logp = token_logprobs(forward(ref, CFG, tokens)[0][:, :-1], targets)
    adv = batch["advantages"]
    with_kl = policy_loss(logp, batch["old_logprobs"][:, 1:], ref_logp, adv, batch["loss_mask"][:, 1:],
                          kl_coef=0.05)
    without = policy_loss(logp, batch["old_logprobs"][:, 1:], None, adv, batch["loss_mask"][:, 1:], kl_coef=0.0)
    return with_kl, without


# ----------------------------------------------------------------------------- scenarios

def alignment(params, ref):
    batch = make_batch(0)
    new, m = run(params, ref, batch)
    (want, want_m), _ = manual_loss(params, ref, {k: jnp.asarray(v) for k, v in batch.items()})
    return {"metrics": floats(m), "want_loss": float(want), "want_kl": float(want_m["kl"]),
            "want_num_tokens": int(batch["loss_mask"][:, 1:].sum()), "step": int(new.step),
            "skipped": int(new.skipped), "param_delta": max_diff(host(new.params), host(params)),
            "log_vocab": math.log(CFG.vocab_size)}


def microbatches(params, ref):
    batch = make_batch(1)
    full, m1 = run(params, ref, batch)
    full = host(full)
    out = {}
    # k=4 on a sharded mesh: the same compile the mesh scenario uses, one less in total.
    for mesh_shape, k in (((1, 1, 1), 2), ((2, 2, 2), 4)):
        split, mk = run(params, ref, batch, mesh_shape, k=k)
        split = host(split)
        out[str(k)] = {
            "metric_diffs": {key: abs(float(m1[key]) - float(mk[key]))
                             for key in ("loss", "kl", "pg_loss", "entropy", "clip_frac", "num_tokens", "grad_norm")},
            "param_diff": max_diff(full.params, split.params),
            "mu_diff": max_diff(adam(full).mu, adam(split).mu), "nu_diff": max_diff(adam(full).nu, adam(split).nu)}
    return out


def skip(params, ref):
    step = get_step()
    bad = make_batch(2)
    r, c = np.nonzero(bad["loss_mask"][:, 1:])
    bad["old_logprobs"][r[0], c[0] + 1] = np.nan  # on a loss token: the loss turns NaN
    refd = jax.device_put(ref, step.frozen_shardings)
    state = step.init_state(params)
    before = host((state.params, state.opt_state))
    state, m = step(state, bad, refd)
    after = host((state.params, state.opt_state))
    out = {"nan_batch": {"metrics": floats(m), "step": int(state.step), "skipped": int(state.skipped),
                         "unchanged": all(np.array_equal(a, b) for a, b in
                                          zip(jax.tree.leaves(before), jax.tree.leaves(after)))}}
    # A good batch next: the skipped step must not have consumed an optimizer step.
    state, m = step(state, make_batch(2), refd)
    out["next_good"] = {"metrics": floats(m), "step": int(state.step), "adam_count": int(adam(state).count),
                        "param_delta": max_diff(host(state.params), before[0])}
    poisoned = jax.tree.map(np.array, host(params))
    poisoned["layers"]["w_up"][0, 0, 0] = np.nan  # a NaN weight: the whole forward is NaN
    state, m = step(step.init_state(poisoned), make_batch(2), refd)
    p = host(state.params)
    out["nan_param"] = {"metrics": floats(m), "skipped": int(state.skipped),
                        "still_nan": bool(np.isnan(p["layers"]["w_up"][0, 0, 0])),
                        "unchanged": all(np.array_equal(a, b, equal_nan=True)
                                         for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(poisoned)))}
    return out


def no_kl(params, ref):
    batch = make_batch(3)
    _, m = run(params, None, batch, options=NO_KL)
    _, (want, want_m) = manual_loss(params, ref, {k: jnp.asarray(v) for k, v in batch.items()})
    return {"metrics": floats(m), "want_loss": float(want), "want_pg_loss": float(want_m["pg_loss"])}


def layout_report(state, mesh):
    """Every param / mu / nu leaf's spec and real per-device shard shape versus the rules."""
    axes = flat(logical_axes(CFG), is_leaf=lambda x: isinstance(x, tuple))
    params = flat(state.params)
    problems, sharded_axes = [], set()
    for name, tree in (("params", state.params), ("mu", adam(state).mu), ("nu", adam(state).nu)):
        for path, leaf in flat(tree).items():
            expect = parallel.logical_to_spec(params[path].shape, axes[path], mesh)
            entries = tuple(expect) + (None,) * (leaf.ndim - len(expect))
            want_shard = tuple(d // math.prod(mesh.shape[a] for a in ((s,) if isinstance(s, str) else (s or ())))
                               for d, s in zip(leaf.shape, entries))
            shard = leaf.addressable_shards[0].data.shape
            if str(leaf.sharding.spec) != str(expect) or shard != want_shard:
                problems.append(f"{name}{path}: spec {leaf.sharding.spec} shard {shard}, "
                                f"want {expect} shard {want_shard}")
            for s in entries:
                sharded_axes.update((s,) if isinstance(s, str) else (s or ()))
    scalars = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 0] + [state.step, state.skipped]
    problems += [f"scalar not replicated: {x.sharding.spec}" for x in scalars if tuple(x.sharding.spec)]
    return problems, sorted(sharded_axes)


def meshes(params, ref):
    batch = make_batch(4)
    base, base_m = run(params, ref, batch)
    base = host(base)
    out = {"base": floats(base_m), "base_param_delta": max_diff(base.params, host(params))}
    for mesh_shape, k in [(m, 1) for m in MESHES] + [((2, 2, 2), 4)]:
        state, m = run(params, ref, batch, mesh_shape, k)
        problems, axes = layout_report(state, get_step(mesh_shape, k).mesh)
        state = host(state)
        out[f"{mesh_shape}x{k}"] = {
            "loss_diff": abs(float(m["loss"]) - float(base_m["loss"])),
            "kl_diff": abs(float(m["kl"]) - float(base_m["kl"])),
            "grad_norm_diff": abs(float(m["grad_norm"]) - float(base_m["grad_norm"])),
            "param_diff": max_diff(state.params, base.params),
            "mu_diff": max_diff(adam(state).mu, adam(base).mu), "nu_diff": max_diff(adam(state).nu, adam(base).nu),
            "layout_problems": problems, "sharded_axes": axes}
    return out


# ----------------------------------------------------------------------------- SFT

def chat_batch(seed=0):
    """Rows shaped like a chat: prompt, assistant turn, user turn, assistant turn, then a
    non-assistant tail (a trailing user/tool turn and padding) from position 11 on."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.int32)
    mask[:, 3:6] = 1
    mask[:, 8:11] = 1
    mask[::3, 8:11] = 0  # uneven token counts across rows and microbatches
    return dict(tokens=rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32), loss_mask=mask)


@jax.jit
def manual_nll(params, tokens, mask):
    """Position t predicts token t+1, weighted by mask[t+1]; mean over weighted tokens."""
    logp = token_logprobs(forward(params, CFG, tokens)[0][:, :-1], tokens[:, 1:])
    m = mask[:, 1:]
    return -(logp * m).sum() / m.sum()


def sft(params, _ref):
    opt = make_optimizer(1e-2, weight_decay=0.0)
    steps = {}
    for mesh_shape, k in (((1, 1, 1), 1), ((2, 2, 2), 2)):
        mesh = parallel.make_mesh(*mesh_shape, devices=jax.devices()[: math.prod(mesh_shape)])
        steps[k] = make_sft_step(CFG, opt, mesh, microbatches=k)
    step = steps[1]
    batch = chat_batch()
    out = {"want_loss": float(manual_nll(params, jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"]))),
           "want_num_tokens": int(batch["loss_mask"][:, 1:].sum())}
    full, m = step(step.init_state(params), batch)
    out["metrics"] = floats(m)
    # Tokens after the last assistant token are only masked targets or context for masked
    # targets: rewriting them (a different trailing user turn) must change nothing.
    tail = dict(batch, tokens=batch["tokens"].copy())
    tail["tokens"][:, 11:] = (tail["tokens"][:, 11:] + 5) % CFG.vocab_size
    out["tail_loss"] = float(step(step.init_state(params), tail)[1]["loss"])
    hit = dict(batch, tokens=batch["tokens"].copy())  # an assistant token is a target
    hit["tokens"][1, 9] = (hit["tokens"][1, 9] + 1) % CFG.vocab_size
    out["hit_loss"] = float(step(step.init_state(params), hit)[1]["loss"])

    split, m2 = steps[2](steps[2].init_state(params), batch)
    full, split = host(full), host(split)
    out["sharded_microbatched"] = {"loss_diff": abs(float(m["loss"]) - float(m2["loss"])),
                                   "grad_norm_diff": abs(float(m["grad_norm"]) - float(m2["grad_norm"])),
                                   "mu_diff": max_diff(adam(full).mu, adam(split).mu),
                                   "param_delta": max_diff(full.params, host(params))}
    state, losses = step.init_state(params), []
    for _ in range(4):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    out["losses"], out["final_step"] = losses, int(state.step)
    return out


GROUPS = {"grpo": (alignment, microbatches, skip, no_kl, meshes), "sft": (sft,)}


def main(group):
    assert len(jax.devices()) == 8, jax.devices()
    init = jax.jit(init_params, static_argnums=0)  # eager init runs the layer scan op by op: slow
    params = init(CFG, jax.random.key(0))
    ref = jax.tree.map(lambda p, n: p + 0.05 * n, params, init(CFG, jax.random.key(1)))
    results = {}
    for fn in GROUPS[group]:
        start = time.process_time()
        try:
            results[fn.__name__] = fn(params, ref)
        except Exception:  # report and go on: one broken scenario should not hide the others
            results[fn.__name__] = {"error": traceback.format_exc()}
        results[fn.__name__]["cpu_s"] = round(time.process_time() - start, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in GROUPS:
        sys.exit(f"usage: step_checks.py {{{','.join(GROUPS)}}}")
    main(sys.argv[1])
