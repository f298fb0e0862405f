"""`grpo_update --time`: one GRPO update of a tiny Qwen3 on a profile's lengths scaled down,
packed rows beside padded ones, timed on the same trajectories in the same process (the
step's wall time, compilation excluded: median of interleaved calls)."""
from __future__ import annotations

import jax
import numpy as np

from muajax import parallel
from muajax.bench.common import interleave, log, median, ratio
from muajax.models.qwen3 import Qwen3Config, init_params
from muajax.rl.grpo import GRPOConfig, make_grpo_step
from muajax.rl.optim import make_optimizer
from muajax.runtime.grpo_packing import pack_bins, packed_rows, row_buckets, rows_for
from muajax.runtime.host_batch import bucket_length

TINY = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, rope_theta=10000.0)
ROLLOUTS = 32


def scaled_batch(profile, scale: int, rng) -> tuple[dict, list[int], int, int]:
    """A padded GRPO batch of ROLLOUTS trajectories whose lengths are the profile's / scale,
    all beginning with its system prompt / scale; returns (batch, lengths, bucket, prefix)."""
    prefix = max(2, profile.system_tokens // scale)
    lengths = [max(prefix + 4, int(n) // scale) for n in profile.sequence_tokens.draw(rng, ROLLOUTS)]
    length = bucket_length(max(lengths), [64 * 2 ** i for i in range(12)])
    tokens = np.zeros((ROLLOUTS, length), np.int32)
    mask = np.zeros_like(tokens)
    tokens[:, :prefix] = rng.integers(1, TINY.vocab_size, prefix)
    for i, n in enumerate(lengths):
        tokens[i, prefix:n] = rng.integers(1, TINY.vocab_size, n - prefix)
        mask[i, prefix + 2:n] = rng.integers(0, 2, n - prefix - 2)
    old = np.where(mask > 0, -2.0, 0.0).astype(np.float32)
    batch = {"tokens": tokens, "loss_mask": mask, "old_logprobs": old,
             "advantages": rng.normal(0, 1, ROLLOUTS).astype(np.float32)}
    return batch, lengths, length, prefix


def time_update(profile, args) -> dict:
    rng = np.random.default_rng(args.seed)
    batch, lengths, length, prefix = scaled_batch(profile, args.time_scale, rng)
    shared = prefix if args.shared_prefix else 0
    bins = pack_bins(lengths, length, shared)
    packed = packed_rows(batch, lengths, bins, rows_for(len(bins), row_buckets(ROLLOUTS, 1)), shared_prefix=shared,
                         pad_id=0)
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = init_params(TINY, jax.random.key(0))
    grpo = GRPOConfig(kl_coef=0.0)
    steps, states = {}, {}
    for name, data, segments in (("padded", batch, None), ("packed", packed, ROLLOUTS + 1)):
        step = make_grpo_step(TINY, make_optimizer(1e-4), mesh, grpo=grpo, shared_prefix=shared, segments=segments,
                              donate=False)
        state = step.init_state(params)
        steps[name] = (lambda step=step, state=state, data=data: step(state, data)[1]["loss"])
    losses = {}
    times = interleave(steps, warmup=1, repeat=args.samples // 4 or 1,
                       on_warmup=lambda name, out: losses.__setitem__(name, float(out)))
    padded_s, packed_s = median(times["padded"]), median(times["packed"])
    log(f"tiny update, {ROLLOUTS} trajectories of {profile.name} lengths / {args.time_scale} (bucket {length}, "
        f"shared prefix {shared}): packed {packed_s * 1e3:.1f} ms, padded {padded_s * 1e3:.1f} ms "
        f"(packed/padded {ratio(packed_s, padded_s):.3f}); losses {losses['packed']:.6f} / {losses['padded']:.6f}")
    return {"rollouts": ROLLOUTS, "length": length, "shared_prefix": shared, "packed_rows": int(packed["tokens"].shape[0]),
            "packed_s": packed_s, "padded_s": padded_s, "packed_over_padded": ratio(packed_s, padded_s),
            "loss_packed": losses["packed"], "loss_padded": losses["padded"]}
