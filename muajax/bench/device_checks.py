"""The checks of `python -m muajax.bench device` (see muajax/bench/device.py).

Each check returns a `Check`: its measured error beside its tolerance (the check passes
when error <= tolerance), what the error measures, and details. transformers runs on the
host CPU (PyTorch), muajax on jax's default backend.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muajax.models.attention import attention, xla_attention
from muajax.models.hf import load_config, load_params
from muajax.models.qwen3 import forward_jit

# Tolerances. float32: both sides are IEEE float32 (muajax's matmuls at "highest" precision,
# so TPUs and TF32 GPUs do not round to bfloat16/TF32). bfloat16: two implementations round
# differently after every matmul; KL weighs the difference by probability mass (what
# sampling and the RL loss see), as `python -m muajax.parity` judges it.
F32_LOGIT_ATOL = 1e-4
BF16_MEAN_KL = 1e-2
F32_ATTENTION = 1e-5   # max |Δ| / max |reference| over the output and the three gradients
BF16_ATTENTION = 2e-2  # the same, for kernels that take bfloat16 only (cuDNN; splash run as training runs it)
GRPO_RELATIVE = 1e-4   # |Δ| / |reference| of the step's loss and gradient norm, device against host CPU


@dataclasses.dataclass
class Check:
    name: str
    error: float
    tolerance: float
    metric: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.error) and self.error <= self.tolerance)

    def record(self) -> dict:
        return {"passed": self.passed, "error": float(self.error), "tolerance": self.tolerance,
                "metric": self.metric, **self.details}

    def line(self) -> str:
        return (f"{'PASS' if self.passed else 'FAIL'} {self.name}: {self.metric} {self.error:.3e} "
                f"(tolerance {self.tolerance:.0e})")


# ----------------------------------------------------------------------------- models


def muajax_model(hf_dir: str, dtype: str):
    """(params, cfg) of the checkpoint on the default device, params and compute in `dtype`."""
    return load_params(hf_dir, load_config(hf_dir, param_dtype=dtype, dtype=dtype))


def hf_model(hf_dir: str, dtype: str):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # the architecture config.json names: Qwen3ForCausalLM or Qwen3MoeForCausalLM
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


def pad_right(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    mask = np.zeros_like(tokens)
    for i, row in enumerate(rows):
        tokens[i, : len(row)], mask[i, : len(row)] = row, 1
    return tokens, mask


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        out = model(torch.as_tensor(tokens, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    return out.logits.float().numpy()


def precision(cfg):
    """The matmul precision muajax runs `cfg` at here: float32 as float32 ("highest": no
    bfloat16 passes on TPU, no TF32 on GPU), bfloat16 at the backend's default."""
    return jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default")


def muajax_logits(params, cfg, tokens: np.ndarray) -> np.ndarray:
    with precision(cfg):
        logits, _ = forward_jit(params, cfg, jnp.asarray(tokens))
    return np.asarray(logits.astype(jnp.float32))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- checks


def logits_check(hf_dir: str, dtype: str, rows: list[list[int]]) -> Check:
    """muajax's logits against transformers' on right-padded ragged prompts (valid positions)."""
    tokens, mask = pad_right(rows)
    ref = hf_logits(hf_model(hf_dir, dtype), tokens, mask)
    params, cfg = muajax_model(hf_dir, dtype)
    ours = muajax_logits(params, cfg, tokens)
    valid = mask.astype(bool)
    a, b = ref[valid].astype(np.float64), ours[valid].astype(np.float64)
    log_p, log_q = _log_softmax(a), _log_softmax(b)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    details = {"max_abs_logit_diff": float(np.abs(a - b).max()), "mean_kl": float(kl.mean()),
               "argmax_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))), "positions": int(valid.sum())}
    if dtype == "float32":
        return Check("logits_float32", details["max_abs_logit_diff"], F32_LOGIT_ATOL, "max |Δlogit|", details)
    return Check("logits_bfloat16", details["mean_kl"], BF16_MEAN_KL, "mean KL(transformers || muajax)", details)


def greedy_check(hf_dir: str, rows: list[list[int]], new_tokens: int) -> Check:
    """The engine's greedy tokens (float32) against transformers' `generate`, one prompt at a time."""
    import torch

    from muajax.engine.engine import Engine, SamplingParams

    model = hf_model(hf_dir, "float32")
    ref = []
    for row in rows:
        ids = torch.as_tensor([row], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                                 pad_token_id=0, temperature=None, top_p=None, top_k=None)
        ref.append(out[0, len(row):].tolist())
    params, cfg = muajax_model(hf_dir, "float32")
    with jax.default_matmul_precision("highest"):
        engine = Engine(params, cfg, num_slots=len(rows), max_len=max(map(len, rows)) + new_tokens + 1, stop_ids=())
        slots = [engine.open(row) for row in rows]
        gens = engine.generate(slots, SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
    ours = np.asarray([gens[s].tokens for s in slots])
    ref = np.asarray(ref)
    differ = int(np.sum(ours != ref))
    first = None
    if differ:
        row = int(np.argmax((ours != ref).any(axis=1)))
        step = int(np.argmax(ours[row] != ref[row]))
        first = {"prompt": row, "step": step, "transformers": int(ref[row, step]), "muajax": int(ours[row, step])}
    return Check("greedy_tokens", float(differ), 0.0, "tokens differing from HF generate",
                 {"tokens": int(ref.size), "first_mismatch": first})


def attention_impls(backend: str) -> list[tuple[str, str]]:
    """(implementation, dtype) of every training attention this backend has, beside the reference."""
    impls = [("chunked", "float32")]
    if backend == "tpu":
        impls.append(("splash", "bfloat16"))
    if backend == "gpu":
        impls.append(("cudnn", "bfloat16"))
    return impls


def _attention_inputs(shape, dtype, seed):
    batch, t, n, k, h = shape
    rng = np.random.RandomState(seed)
    q, keys, values = (jnp.asarray(rng.randn(*s), dtype) for s in ((batch, t, n, h), (batch, k, t, h), (batch, k, t, h)))
    cot = jnp.asarray(rng.randn(batch, t, n, h), jnp.float32)
    seg = np.ones((batch, t), np.int32)
    if batch > 1:  # a packed row: three conversations and padding (id 0)
        third = t // 3
        seg[1] = [1] * third + [2] * third + [3] * (t - 2 * third - 5) + [0] * 5
    return q, keys, values, cot, jnp.asarray(seg)


def attention_check(impl: str, dtype: str, shape, seed: int = 0) -> Check:
    """`impl` against the einsum reference (float32, on the same inputs rounded to `dtype`):
    the output and the gradients of <output, cotangent> over valid queries."""
    q, k, v, cot, seg = _attention_inputs(shape, dtype, seed)
    weight = cot * (seg > 0)[:, :, None, None]

    def run(fn, *args):
        out = jax.jit(fn)(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * weight), argnums=(0, 1, 2)))(*args)
        return [out, *grads]

    got = run(lambda q, k, v: attention(q, k, v, implementation=impl, segment_ids=seg), q, k, v)
    t = q.shape[1]
    q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    with jax.default_matmul_precision("highest"):
        ref = run(lambda q, k, v: xla_attention(q, k, v, q_index, segment_ids=seg),
                  *(x.astype(jnp.float32) for x in (q, k, v)))
    valid = np.asarray(seg > 0)
    errors = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name == "out":
            a, b = a[valid], b[valid]
        errors[name] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    tol = F32_ATTENTION if dtype == "float32" else BF16_ATTENTION
    return Check(f"attention_{impl}", max(errors.values()), tol, f"max |Δ|/max|ref| over out, dq, dk, dv ({dtype})",
                 {"relative_errors": errors, "shape_btnkh": list(shape), "dtype": dtype})


# ----------------------------------------------------------------------------- GRPO


def grpo_batch(vocab: int, batch: int, length: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, length), np.int32)
    mask[:, length // 4:] = 1
    return {"tokens": rng.integers(0, vocab, (batch, length)).astype(np.int32), "loss_mask": mask,
            "old_logprobs": np.zeros((batch, length), np.float32),
            "advantages": rng.normal(0, 1, batch).astype(np.float32)}


def grpo_step_on(device, params, cfg, batch: dict, *, learning_rate: float = 1e-4):
    """One GRPO update (the trainer's: `make_grpo_step`, on-policy ratios from the step's own
    forward, no KL) on a one-device mesh of `device`: (metrics, new params, step, state)."""
    from muajax import parallel
    from muajax.rl.grpo import GRPOConfig, make_grpo_step
    from muajax.rl.optim import make_optimizer

    mesh = parallel.make_mesh(1, 1, 1, devices=[device])
    step = make_grpo_step(cfg, make_optimizer(learning_rate), mesh,
                          grpo=GRPOConfig(kl_coef=0.0, recompute_old_logprobs=True), donate=False)
    state = step.init_state(jax.device_put(params, device))
    with precision(cfg):
        new_state, metrics = step(state, batch)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
    return metrics, new_state.params, step, state


def grpo_check(params, cfg, batch: dict) -> tuple[Check, Any]:
    """One GRPO step on the default device against the same step on the host CPU: loss and
    gradient norm; the update must move the params and leave them finite. Where the device
    is the host CPU there is nothing to compare it with: the error is then that of the
    update's own checks (0 when it ran, moved the params and stayed finite); the same when
    JAX_PLATFORMS leaves jax no CPU backend (`reference` null says so). Returns the
    check and (step, state, batch), which the update figure may time."""
    device = jax.devices()[0]
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names the accelerator alone: no host CPU backend
        host = device
    t0 = time.perf_counter()
    got, new, step, state = grpo_step_on(device, params, cfg, batch)
    device_s = time.perf_counter() - t0
    errors = {}
    if device != host:
        ref, _, _, _ = grpo_step_on(host, params, cfg, batch)
        errors = {k: abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-30) for k in ("loss", "grad_norm")}
    moved = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - jax.device_put(b, a.sharding).astype(jnp.float32))))
                for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)))
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new))
    ok = finite and moved > 0 and np.isfinite(got["loss"]) and not got.get("skipped")
    error = max(errors.values(), default=0.0) if ok else float("inf")
    check = Check("grpo_step", error, GRPO_RELATIVE, "|Δ|/|ref| of loss and grad_norm, device vs host CPU",
                  {"device": str(device), "reference": None if device == host else str(host),
                   "loss": got["loss"], "grad_norm": got["grad_norm"], "relative_errors": errors,
                   "max_param_change": moved, "params_finite": finite, "first_step_s_with_compile": device_s,
                   "rows_x_tokens": list(batch["tokens"].shape)})
    return check, (step, state, batch)
