"""`python -m muajax.eval --checkpoint DIR --domain retail|airline|telecom|builtin|bfcl|mcp [options]`.

Runs the policy in DIR (a muajax run/checkpoint directory or a Hugging Face directory) on
every task of a split, `--trials` times each, with a simulated user in the loop, through
the same engine and rollout loop as training. The agent runs greedy (temperature 0) by
default, as in the paper's evaluation; τ-bench's check that required facts were told to
the user is on (it is off only in training).

Prints pass^1 … pass^k (τ2's estimator C(c, k)/C(n, k) per task, averaged), the partial
score (TCR), average turns and calls per tool; writes the per-task JSON with every
conversation to --out; the last line is one JSON object of the figures.

The user: `scripted` (built-in domain only, offline) or `openai` (any OpenAI-compatible
endpoint: --user-model, --user-base-url; the key is read from the environment variable
named by --user-api-key-env and never printed).

`--domain mcp` evaluates on the MCP servers and scenarios of the run's config (`env.mcp`).

BFCL-v3 multi-turn (`--domain bfcl`, needs the optional nvidia-bfcl install, see the
README): `--bfcl-category` base (default), miss_func, miss_param or long_context; the
split is `test` (every task of the category; BFCL has no train split). The user is the
benchmark's scripted turns and the score is BFCL's own multi-turn checker (see
`muajax.domains.bfcl.environment`); the episode limit defaults to 200 turns there, since BFCL itself
allows 20 steps per user turn.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from muajax.config.fields import ConfigError
from muajax.domains.registry import DomainConfigError
from muajax.train.evaluate import EvalRequest, evaluate_checkpoint
from muajax.train.policy_loading import PolicyLoadError

DOMAINS = ("builtin", "retail", "airline", "telecom", "bfcl", "mcp")  # mcp: the run config's env.mcp
BFCL_CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
SCRIPTED_DOMAINS = ("builtin", "bfcl")  # domains whose user needs no model


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.eval", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="muajax run/checkpoint directory, or a HF directory")
    p.add_argument("--stage", choices=("sft", "grpo"), help="stage of a muajax run (default: the latest)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument("--domain", required=True, choices=DOMAINS)
    p.add_argument("--split", default="test")
    p.add_argument("--bfcl-category", default="base", choices=BFCL_CATEGORIES + tuple(f"multi_turn_{c}" for c in
                   BFCL_CATEGORIES), help="--domain bfcl: the BFCL-v3 multi-turn category (default: base)")
    p.add_argument("--trials", type=int, default=4, help="rollouts per task (τ2 uses 4); pass^k for k <= trials")
    p.add_argument("--max-tasks", type=int, help="only the first N tasks of the split")
    p.add_argument("--temperature", type=float, default=0.0, help="the agent's sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--user", choices=("scripted", "openai"),
                   help="default: scripted for builtin and bfcl (BFCL's own turns), else openai")
    p.add_argument("--user-model")
    p.add_argument("--user-base-url")
    p.add_argument("--user-api-key-env", default="OPENAI_API_KEY", help="NAME of the env var holding the key")
    p.add_argument("--user-temperature", type=float, default=0.0)
    p.add_argument("--user-concurrency", type=int, default=16, help="requests in flight to the user endpoint")
    p.add_argument("--max-turns", type=int, help="user replies + tool calls per episode (default 30; bfcl 200)")
    p.add_argument("--max-new-tokens", type=int, help="per assistant turn (default: the run's, else 1024)")
    p.add_argument("--max-context", type=int, help="tokens per conversation (default: the run's, else 16384)")
    p.add_argument("--slots", type=int, default=32, help="conversations decoded side by side")
    p.add_argument("--terse-tools", action="store_true", default=None,
                   help="built-in domain: short tool schemas (default: as the run was trained)")
    p.add_argument("--no-communicate-info", action="store_true", help="drop the told-the-user check (as training)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="params/compute dtype (default: the model's)")
    p.add_argument("--out", help="per-task JSON (default: eval-<domain>-<split>.json in the current directory)")
    args = p.parse_args(argv)
    for name in ("trials", "max_tasks", "max_turns", "max_new_tokens", "max_context", "slots", "user_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    args.user = args.user or ("scripted" if args.domain in SCRIPTED_DOMAINS else "openai")
    if args.user == "scripted" and args.domain not in SCRIPTED_DOMAINS:
        p.error(f"--user scripted exists only for --domain builtin or bfcl; {args.domain} needs --user openai")
    if args.domain != "bfcl" and args.bfcl_category != "base":
        p.error("--bfcl-category applies only to --domain bfcl")
    if args.domain == "bfcl" and args.user != "scripted":
        p.error("--domain bfcl plays BFCL's own scripted user turns; --user openai does not apply")
    if args.max_turns is None:
        # a BFCL task has up to 8 user turns of up to 20 steps each (BFCL's own per-turn limit)
        args.max_turns = 200 if args.domain == "bfcl" else 30
    if args.user == "openai" and not args.user_model:
        p.error("--user openai needs --user-model (and usually --user-base-url)")
    return args


def print_summary(summary: dict[str, Any], trials: int) -> None:
    print(f"tasks {summary['tasks']} x trials {trials}", flush=True)
    for k in range(1, trials + 1):
        print(f"  pass^{k}: {summary[f'pass^{k}']:.4f}")
    print(f"  partial (TCR): {summary['partial']:.4f}   average turns: {summary['turns']:.2f}")
    calls = summary["calls_per_tool"]
    print("  calls per tool (per rollout): " + (", ".join(f"{n} {v:.2f}" for n, v in calls.items()) or "none"))
    print(f"  terminations: {summary['terminations']}", flush=True)


def request_from_args(args) -> EvalRequest:
    category = args.bfcl_category
    user = {"kind": args.user, "model": args.user_model, "base_url": args.user_base_url,
            "api_key_env": args.user_api_key_env, "temperature": args.user_temperature,
            "max_concurrency": args.user_concurrency}
    return EvalRequest(checkpoint=args.checkpoint, domain=args.domain, split=args.split, stage=args.stage,
                       step=args.step, bfcl_category=category if category.startswith("multi_turn_")
                       else f"multi_turn_{category}", trials=args.trials, max_tasks=args.max_tasks,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed, user=user,
                       max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_context=args.max_context,
                       slots=args.slots, terse_tools=args.terse_tools, communicate_info=not args.no_communicate_info,
                       dtype=args.dtype, out=args.out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        summary = evaluate_checkpoint(request_from_args(args))
    except (PolicyLoadError, ConfigError, DomainConfigError, ValueError, ImportError) as e:
        print(f"muajax.eval: error: {e}", file=sys.stderr, flush=True)
        print(json.dumps({"error": str(e)}), flush=True)
        return 2
    print_summary(summary, args.trials)
    print(f"per-task results: {summary['out']}", flush=True)
    keys = [f"pass^{k}" for k in range(1, args.trials + 1)]
    figures = {k: summary[k] for k in ("domain", "split", "tasks", "trials")}
    if "bfcl_category" in summary:
        figures["bfcl_category"] = summary["bfcl_category"]
    figures.update({k: summary[k] for k in keys})
    figures.update({k: summary[k] for k in ("success", "partial", "turns", "confirm_rate", "calls_per_tool",
                                            "terminations", "failed_rollouts", "sampled_tokens", "wall_s", "out")})
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
