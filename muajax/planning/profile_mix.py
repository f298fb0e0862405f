"""The rollout profile a run config implies when none is given: the shipped profile of each
τ2 domain it trains on (`configs/profiles/tau2-<domain>.json`), mixed in proportion to the
domain's training tasks, as the trainer's task stream draws them.

A mixture's distributions are estimated from draws: each domain's profile contributes draws
in proportion to its weight, and the mixture keeps their mean and percentiles
(`Distribution.of`). Scalars (system prompt, per-turn overhead, tool calls per turn) are
weighted means.
"""
from __future__ import annotations

import os

import numpy as np

from muajax.planning.rollout_profile import DISTRIBUTIONS, Distribution, ProfileError, RolloutProfile

PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "configs", "profiles")
DRAWS = 20000


def mix(weighted: list[tuple[RolloutProfile, float]], *, seed: int = 0) -> RolloutProfile:
    """One profile of several, each weighted (weights > 0, need not sum to 1)."""
    if not weighted or any(w <= 0 for _, w in weighted):
        raise ValueError("mix needs at least one profile, each with a weight > 0")
    if len(weighted) == 1:
        return weighted[0][0]
    total = sum(w for _, w in weighted)
    shares = [(p, w / total) for p, w in weighted]
    rng = np.random.default_rng(seed)
    counts = [max(1, round(DRAWS * share)) for _, share in shares]
    dists = {name: Distribution.of(np.concatenate([getattr(p, name).draw(rng, n) for (p, _), n in
                                                   zip(shares, counts)])) for name in DISTRIBUTIONS}
    mean = lambda field: sum(getattr(p, field) * share for p, share in shares)
    names = " + ".join(f"{p.name} ({share:.0%})" for p, share in shares)
    return RolloutProfile(name=names, system_tokens=round(mean("system_tokens")),
                          turn_overhead_tokens=round(mean("turn_overhead_tokens")),
                          tool_calls_per_turn=mean("tool_calls_per_turn"),
                          conversations=sum(p.conversations for p, _ in shares),
                          sources={"mixture": f"{names}, weighted by training tasks; each profile's own sources "
                                              "in its file"}, **dists)


def default_profile(domain_tasks: dict[str, int], directory: str = PROFILES) -> RolloutProfile | None:
    """The mixture of the shipped τ2 profiles of these domains (name -> training tasks), or
    None when a domain has no shipped profile (the built-in domain: plan it from a run
    directory with --rollout-profile)."""
    weighted = []
    for domain, tasks in sorted(domain_tasks.items()):
        path = os.path.join(directory, f"tau2-{domain}.json")
        if not os.path.isfile(path):
            return None
        try:
            weighted.append((RolloutProfile.load(path), float(tasks)))
        except ProfileError as error:
            raise ProfileError(f"the shipped profile of {domain}: {error}") from None
    return mix(weighted) if weighted else None

