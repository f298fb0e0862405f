"""`python -m muajax.bench grpo_update`: the positions a GRPO update computes over the real
tokens of its trajectories, packed rows (`grpo.pack_rows`, `muajax.runtime.grpo_packing`)
beside padded ones, on a rollout profile's conversation lengths (default τ2 retail,
configs/profiles/tau2-retail.json, read by `muajax.planning.rollout_profile`).

Each sample draws a step's `--rollouts` conversation lengths from the profile's
`sequence_tokens`, takes the length bucket of the longest (`grpo.length_buckets`' default:
512 doubled up to `--max-context`), and counts what the update's rows hold: padded, every
trajectory its own row at that bucket; packed, the rows first-fit decreasing fills, rounded
up to the layout's row buckets. Real tokens are the trajectories' own. With
`--shared-prefix` (the profile's system prompt, as on a CPU where the padded rows share it)
the prefix counts once per microbatch on every side. `--time` also times one update of a
tiny model on those lengths scaled down by `--time-scale`, packed and padded.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from muajax.bench.common import log, ratio
from muajax.planning.rollout_profile import RolloutProfile
from muajax.runtime.grpo_packing import computed_positions, row_buckets
from muajax.runtime.host_batch import bucket_length, length_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PROFILE = os.path.join(ROOT, "configs", "profiles", "tau2-retail.json")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m muajax.bench grpo_update", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="a rollout profile JSON (default: τ2 retail)")
    p.add_argument("--rollouts", type=int, default=256, help="trajectories per update (the paper's 256)")
    p.add_argument("--samples", type=int, default=16, help="steps drawn from the profile")
    p.add_argument("--max-context", type=int, default=32768, help="rollout.max_context: the largest bucket")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--shared-prefix", action="store_true",
                   help="the rows share the profile's system prompt (on a CPU); default: not (splash, cuDNN)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time", action="store_true", help="also time a tiny model's update, packed and padded")
    p.add_argument("--time-scale", type=int, default=32, help="lengths divided by this for --time")
    return p.parse_args(argv)


def draw_lengths(profile: RolloutProfile, rollouts: int, rng, max_context: int) -> list[int]:
    lengths = np.round(profile.sequence_tokens.draw(rng, rollouts)).astype(int)
    return [int(n) for n in np.clip(lengths, profile.system_tokens + 2, max_context)]


def positions(args, profile: RolloutProfile) -> dict:
    rng = np.random.default_rng(args.seed)
    buckets = length_buckets(args.max_context)
    prefix = profile.system_tokens if args.shared_prefix else 0
    rows = row_buckets(args.rollouts, args.microbatches)
    samples = []
    for _ in range(args.samples):
        lengths = draw_lengths(profile, args.rollouts, rng, args.max_context)
        length = bucket_length(max(lengths), buckets)
        counts = computed_positions(lengths, length, shared_prefix=prefix, row_buckets_=rows,
                                    microbatches=args.microbatches)
        samples.append({"length": length, **counts})
    total = {k: float(sum(s[k] for s in samples)) for k in ("real", "packed", "padded")}
    packed, padded = total["packed"] / total["real"], total["padded"] / total["real"]
    log(f"grpo update on {profile.name} lengths ({args.rollouts} trajectories, {args.samples} steps, shared prefix "
        f"{prefix}): computed over real tokens packed {packed:.3f}, padded {padded:.3f} "
        f"(packed/padded {ratio(packed, padded):.3f})")
    return {"profile": profile.name, "rollouts": args.rollouts, "samples": args.samples,
            "shared_prefix": prefix, "microbatches": args.microbatches,
            "mean_real_tokens": total["real"] / args.samples,
            "packed_computed_over_real": packed, "padded_computed_over_real": padded,
            "packed_over_padded": ratio(packed, padded),
            "mean_packed_rows": float(np.mean([s["rows"] for s in samples])),
            "lengths_bucket": sorted({s["length"] for s in samples})}


def run(argv=None) -> dict:
    args = parse(argv)
    profile = RolloutProfile.load(args.profile)
    out = positions(args, profile)
    if args.time:
        from muajax.bench.grpo_update_timing import time_update  # jax: only when asked
        out["time"] = time_update(profile, args)
    return out
