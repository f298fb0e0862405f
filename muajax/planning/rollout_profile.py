"""What a GRPO step's conversations look like, as data: the workload a step-time model plays.

A `RolloutProfile` holds, per conversation: the system prompt's tokens, the first user
message's, how many agent turns and how many of them call tools, the tokens the agent
samples per turn, the tokens of each tool result and of each user reply as fed to the
engine (chat template included), the simulated user's latency per reply and the tool calls
per turn. Each quantity is a `Distribution`: its mean and, where the producer knew them,
percentiles, enough to draw a batch's conversations and so its longest row. `sources`
says where every number came from.

Producers:
  python -m muajax.planning.rollout_profile --tau2 retail --out configs/profiles/tau2-retail.json
      measures τ2's own data (muajax/planning/tau2_profile.py: the tasks' gold actions run
      against the domain's environment, tokenized with the Qwen3 tokenizer);
  RolloutProfile.from_run(run_dir)
      a run's metrics.jsonl (the per-step means `muajax.agent.trajectory.rollout_metrics`
      logs, and the step's longest row where the run logged it), with the per-turn spread
      and the tool/user split of its own conversations (sft.jsonl) where it has them
      (muajax/planning/run_profile.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from muajax.planning.run_profile import ProfileError, run_numbers

__all__ = ["Distribution", "ProfileError", "RolloutProfile", "from_tau2", "summary_lines", "main"]
VERSION = 1
PERCENTILES = (0, 10, 25, 50, 75, 90, 95, 99, 100)
DISTRIBUTIONS = ("first_user_tokens", "agent_turns", "tool_turns", "agent_turn_tokens", "user_turn_tokens",
                 "tool_result_tokens", "user_latency_s", "sequence_tokens")


@dataclasses.dataclass(frozen=True)
class Distribution:
    """A quantity's mean and, when known, its percentiles {0..100: value}. Without
    percentiles every draw is the mean."""

    mean: float
    percentiles: dict[float, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        xs = np.asarray(list(values), np.float64)
        if xs.size == 0:
            raise ValueError("a distribution needs at least one value")
        return cls(float(xs.mean()), {float(p): float(np.percentile(xs, p)) for p in PERCENTILES})

    @classmethod
    def uniform(cls, mean: float, largest: float, draws: int) -> Distribution:
        """A uniform distribution of this mean whose largest of `draws` draws is, on average,
        `largest` (a step's longest row): [lo, hi] with hi - (hi - lo) / (draws + 1) = largest."""
        if draws < 2 or largest <= mean:
            return cls(mean)
        hi = (largest * (draws + 1) - 2 * mean) / (draws - 1)
        lo = max(2 * mean - hi, 0.0)
        return cls(mean, {0.0: lo, 100.0: 2 * mean - lo})

    def quantile(self, q: float | np.ndarray):
        """The value at quantile q in [0, 1] (linear between the percentiles)."""
        if not self.percentiles:
            return np.full(np.shape(q), self.mean) if np.ndim(q) else self.mean
        levels = sorted(self.percentiles)
        return np.interp(np.asarray(q) * 100.0, levels, [self.percentiles[p] for p in levels])

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.asarray(self.quantile(rng.random(size)), np.float64)

    def to_json(self) -> dict:
        out: dict = {"mean": round(self.mean, 6)}
        if self.percentiles:
            out["percentiles"] = {_key(p): round(v, 6) for p, v in sorted(self.percentiles.items())}
        return out

    @classmethod
    def from_json(cls, data, what: str) -> Distribution:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return cls(float(data))
        if not isinstance(data, dict) or not _number(data.get("mean")):
            raise ValueError(f"{what}: expected a number or {{'mean': number, 'percentiles': {{...}}}}, got {data!r}")
        raw = data.get("percentiles") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{what}.percentiles: expected an object of percentile: value, got {raw!r}")
        out = {}
        for key, value in raw.items():
            try:
                level = float(key)
            except ValueError:
                raise ValueError(f"{what}.percentiles: {key!r} is not a percentile") from None
            if not 0 <= level <= 100 or not _number(value):
                raise ValueError(f"{what}.percentiles: {key!r}: {value!r} (percentiles 0..100, numeric values)")
            out[level] = float(value)
        values = [out[k] for k in sorted(out)]
        if any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{what}.percentiles must not decrease: {raw}")
        return cls(float(data["mean"]), out)


def _key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class RolloutProfile:
    """Per conversation unless named otherwise. `agent_turns` counts every assistant message
    (tool-calling ones and those to the user), `tool_turns` those that call tools; each agent
    turn but the last is followed by a tool result (a share tool_turns / agent_turns of them)
    or a user reply. Token counts are as the engine is fed them: `user_turn_tokens` and
    `tool_result_tokens` with their chat template, `agent_turn_tokens` the sampled tokens
    (`<|im_end|>` included), `turn_overhead_tokens` what the host appends around every agent
    turn (the newline after `<|im_end|>` and the next generation prompt)."""

    name: str
    system_tokens: int
    first_user_tokens: Distribution
    agent_turns: Distribution
    tool_turns: Distribution
    agent_turn_tokens: Distribution
    user_turn_tokens: Distribution
    tool_result_tokens: Distribution
    user_latency_s: Distribution
    sequence_tokens: Distribution
    turn_overhead_tokens: int = 0
    tool_calls_per_turn: float = 1.0
    conversations: int = 0           # how many conversations the numbers come from
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def tool_share(self) -> float:
        """Of the agent turns, the share followed by a tool result (the rest: a user reply)."""
        return min(self.tool_turns.mean / max(self.agent_turns.mean, 1e-9), 1.0)

    def to_json(self) -> dict:
        out: dict = {"version": VERSION, "name": self.name, "conversations": self.conversations,
                     "system_tokens": self.system_tokens, "turn_overhead_tokens": self.turn_overhead_tokens,
                     "tool_calls_per_turn": round(self.tool_calls_per_turn, 6)}
        out.update({name: getattr(self, name).to_json() for name in DISTRIBUTIONS})
        out["sources"] = dict(self.sources)
        return out

    @classmethod
    def from_json(cls, data: dict) -> RolloutProfile:
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}: this muajax reads version {VERSION}")
        missing = [k for k in ("name", "system_tokens", *DISTRIBUTIONS) if k not in data]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        for key in ("system_tokens", "turn_overhead_tokens", "conversations"):
            if not isinstance(data.get(key, 0), int) or data.get(key, 0) < 0:
                raise ValueError(f"{key}: expected a whole number >= 0, got {data.get(key)!r}")
        if not _number(data.get("tool_calls_per_turn", 1.0)):
            raise ValueError(f"tool_calls_per_turn: expected a number, got {data.get('tool_calls_per_turn')!r}")
        dists = {name: Distribution.from_json(data[name], name) for name in DISTRIBUTIONS}
        if dists["agent_turns"].mean < 1:
            raise ValueError(f"agent_turns: a conversation has at least one agent turn, mean {dists['agent_turns'].mean}")
        sources = data.get("sources", {})
        if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
            raise ValueError("sources: expected an object of field: text")
        return cls(name=str(data["name"]), system_tokens=data["system_tokens"],
                   turn_overhead_tokens=data.get("turn_overhead_tokens", 0),
                   tool_calls_per_turn=float(data.get("tool_calls_per_turn", 1.0)),
                   conversations=data.get("conversations", 0), sources=dict(sources), **dists)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh, indent=1, ensure_ascii=False)
            fh.write("\n")

    @classmethod
    def load(cls, path: str) -> RolloutProfile:
        """A profile file, or a run directory (see `from_run`)."""
        if os.path.isdir(path):
            return cls.from_run(path)
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such rollout profile (a profile .json, or a run directory)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path}: not a JSON rollout profile: {exc}") from None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ProfileError(f"{path}: not a rollout profile: {exc}") from None

    @classmethod
    def from_run(cls, run_dir: str, *, skip_first: int = 0) -> RolloutProfile:
        """A run directory's profile (`muajax.planning.run_profile.run_numbers`; `skip_first`
        GRPO steps left out). Where a step's longest conversation is logged, the spread is
        uniform with the mean and, as its expected largest of the step's conversations, the
        median step's longest; without it every conversation is the mean one."""
        n = run_numbers(run_dir, skip_first=skip_first)
        agent, draws = n["agent_turns"], n["draws"]
        first = Distribution.of(n["firsts"])
        context = n["sequence_tokens"] - n["response_tokens"] - n["system"] - first.mean - agent * n["overhead"]
        per_reply = max(context / max(agent - 1.0, 1e-9), 0.0)
        per_turn = n["response_tokens"] / max(agent, 1e-9)
        tools = users = Distribution(per_reply)
        turn_tokens = Distribution(per_turn)
        if n["shapes"]:  # the spread and the tool/user split of the run's own conversations, at its means
            shape, share = n["shapes"], min(n["tool_turns"] / max(agent, 1e-9), 1.0)
            mixed = share * np.mean(shape["tool"]) + (1 - share) * np.mean(shape["user"])
            tools, users = (Distribution.of(np.asarray(shape[k]) * per_reply / mixed) for k in ("tool", "user"))
            turn_tokens = Distribution.of(np.asarray(shape["agent"]) * per_turn / np.mean(shape["agent"]))

        def spread(mean, longest):
            return Distribution(mean) if longest is None else Distribution.uniform(mean, longest, draws)

        return cls(name=n["name"], system_tokens=n["system"], first_user_tokens=first,
                   agent_turns=spread(agent, n["longest_agent_turns"]), tool_turns=Distribution(n["tool_turns"]),
                   agent_turn_tokens=turn_tokens, user_turn_tokens=users, tool_result_tokens=tools,
                   user_latency_s=Distribution(n["user_latency_s"]),
                   sequence_tokens=spread(n["sequence_tokens"], n["longest_sequence_tokens"]),
                   turn_overhead_tokens=n["overhead"], tool_calls_per_turn=1.0, conversations=draws * n["steps"],
                   sources=n["sources"])


def from_tau2(domain: str, *, split: str = "train", turns: float | None = None, user_latency_s: float = 0.0,
              tools: str = "muajax") -> RolloutProfile:
    """τ2's data measured (`muajax.planning.tau2_profile`: gold actions replayed, tokenized)."""
    from muajax.planning.tau2_profile import measure_tau2  # noqa: PLC0415 (τ2 is a heavy import)

    n, sources = measure_tau2(domain, split=split, turns=turns, tools=tools)
    results = n["tool_result_tokens"]
    return RolloutProfile(
        name=f"tau2-{domain}", system_tokens=n["system"], first_user_tokens=Distribution.of(n["first"]),
        agent_turns=Distribution.of(n["agent_turns"]), tool_turns=Distribution.of(n["tool_turns"]),
        agent_turn_tokens=Distribution.of(n["agent_turn_tokens"]),
        user_turn_tokens=Distribution.of(n["user_turn_tokens"]),
        tool_result_tokens=Distribution.of(results) if results else Distribution(0.0),
        user_latency_s=Distribution(user_latency_s), sequence_tokens=Distribution.of(n["sequence_tokens"]),
        turn_overhead_tokens=n["overhead"], tool_calls_per_turn=1.0, conversations=n["conversations"],
        sources=sources)


def summary_lines(profile: RolloutProfile) -> list[str]:
    """The profile's key numbers, one per line."""
    def d(dist: Distribution, unit: str = "") -> str:
        p = dist.percentiles
        spread = f" (p50 {p[50.0]:.0f}, p90 {p[90.0]:.0f}, max {p[100.0]:.0f})" if 50.0 in p and 90.0 in p else ""
        return f"{dist.mean:.1f}{unit}{spread}"

    return [f"profile {profile.name}: {profile.conversations} conversations",
            f"  system prompt {profile.system_tokens} tokens; first user message {d(profile.first_user_tokens)}",
            f"  agent turns {d(profile.agent_turns)}, of which tool turns {d(profile.tool_turns)}",
            f"  tokens per agent turn {d(profile.agent_turn_tokens)}, per tool result {d(profile.tool_result_tokens)}"
            f", per user reply {d(profile.user_turn_tokens)}",
            f"  sequence tokens {d(profile.sequence_tokens)}; user latency {profile.user_latency_s.mean:.3g} s per reply"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m muajax.planning.rollout_profile",
                                description="Write a rollout profile measured from τ2's data, or from a run.")
    p.add_argument("--tau2", choices=("retail", "airline", "telecom"), help="measure this τ2 domain's tasks")
    p.add_argument("--run", help="a run directory (its metrics.jsonl)")
    p.add_argument("--split", default="train", help="τ2 task split (default train: what GRPO rolls out)")
    p.add_argument("--turns", type=float, default=None,
                   help="turns per conversation (user replies + tool results); default: the MUA-RL paper's")
    p.add_argument("--user-latency-s", type=float, default=0.0, help="seconds per simulated-user reply (default 0)")
    p.add_argument("--out", help="write the profile here (default: print it)")
    args = p.parse_args(argv)
    if bool(args.tau2) == bool(args.run):
        p.error("give one of --tau2 DOMAIN or --run RUN_DIR")
    if args.tau2:
        profile = from_tau2(args.tau2, split=args.split, turns=args.turns, user_latency_s=args.user_latency_s)
    else:
        profile = RolloutProfile.from_run(args.run)
    print("\n".join(summary_lines(profile)), flush=True)
    if args.out:
        profile.save(args.out)
        print(f"wrote {args.out}")
    else:
        print(json.dumps(profile.to_json(), indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
