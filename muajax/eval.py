"""`python -m muajax.eval --checkpoint DIR --domain retail|airline|telecom|builtin|bfcl [options]`.

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

BFCL-v3 multi-turn (`--domain bfcl`, needs the optional nvidia-bfcl install, see the
README): `--bfcl-category` base (default), miss_func, miss_param or long_context; the
split is `test` (every task of the category; BFCL has no train split). The user is the
benchmark's scripted turns and the score is BFCL's own multi-turn checker (see
`muajax.envs.bfcl`); the episode limit defaults to 200 turns there, since BFCL itself
allows 20 steps per user turn.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from math import comb
from typing import Any

DOMAINS = ("builtin", "retail", "airline", "telecom", "bfcl")
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


def run_config(args, policy):
    """The TrainConfig that builds the environment and user: the run's own env settings
    when it trained on this domain (its prompt format, e.g. terse tools), else defaults."""
    from muajax.config import EnvConfig, TrainConfig, UserConfig, from_dict

    base = policy.config
    env = base.env if base is not None and base.env.domain == args.domain else EnvConfig(domain=args.domain)
    if args.domain == "bfcl":
        category = args.bfcl_category
        env = dataclasses.replace(env, bfcl_category=category if category.startswith("multi_turn_")
                                  else f"multi_turn_{category}")
    if args.terse_tools is not None:
        env = dataclasses.replace(env, builtin_terse_tools=args.terse_tools)
    user = from_dict(UserConfig, {
        "kind": args.user, "model": args.user_model, "base_url": args.user_base_url,
        "api_key_env": args.user_api_key_env, "temperature": args.user_temperature,
        "max_concurrency": args.user_concurrency}, "user")
    return TrainConfig(env=env, user=user)


def rollout_limits(args, policy) -> tuple[int, int]:
    """(max_context, max_new_tokens): flags, then the run's settings, then defaults, capped
    by what the model's positions allow."""
    run = policy.config.rollout if policy.config is not None else None
    context = args.max_context or (run.max_context if run else 16384)
    context = min(context, policy.model_cfg.max_position_embeddings)
    new = args.max_new_tokens or (run.max_new_tokens_per_turn if run else 1024)
    return context, min(new, context - 1)


def task_records(trajectories, trials: int) -> list[dict[str, Any]]:
    by_task: dict[str, list] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(t)
    records = []
    for task_id, ts in by_task.items():
        ts.sort(key=lambda t: t.rollout_index)
        c = sum(t.reward >= 1.0 for t in ts)
        records.append({
            "task_id": task_id, "successes": c, "trials": len(ts),
            "pass_hat": {str(k): comb(c, k) / comb(len(ts), k) for k in range(1, min(trials, len(ts)) + 1)},
            "mean_partial": sum(t.partial for t in ts) / len(ts),
            "rollouts": [{
                "rollout_index": t.rollout_index, "reward": t.reward, "partial": t.partial,
                "termination": t.termination, "error": t.error, "turns": t.turns,
                "assistant_turns": t.assistant_turns, "truncated_turns": t.truncated_turns,
                "malformed_calls": t.malformed_calls, "tool_calls": dict(t.tool_calls), "details": t.details,
                "sampled_tokens": t.num_sampled, "wall_s": round(t.wall_s, 3), "messages": t.messages,
            } for t in ts],
        })
    return records


def print_summary(summary: dict[str, Any], trials: int) -> None:
    print(f"tasks {summary['tasks']} x trials {trials}", flush=True)
    for k in range(1, trials + 1):
        print(f"  pass^{k}: {summary[f'pass^{k}']:.4f}")
    print(f"  partial (TCR): {summary['partial']:.4f}   average turns: {summary['turns']:.2f}")
    calls = summary["calls_per_tool"]
    print("  calls per tool (per rollout): " + (", ".join(f"{n} {v:.2f}" for n, v in calls.items()) or "none"))
    print(f"  terminations: {summary['terminations']}", flush=True)


def evaluate(args) -> dict[str, Any]:
    from muajax import runtime
    from muajax.evaluation import summarize
    from muajax.policy_loading import load_policy, make_engine
    from muajax.rollout import RolloutOptions, run_rollouts_sync

    start = time.time()
    policy = load_policy(args.checkpoint, stage=args.stage, step=args.step, dtype=args.dtype)
    print(f"loaded {policy.describe()}", flush=True)
    cfg = run_config(args, policy)
    env = runtime.make_environment(cfg)
    user = runtime.make_user(cfg, env)
    tasks = env.tasks(args.split)
    if args.max_tasks:
        tasks = tasks[: args.max_tasks]
    if not tasks:
        raise ValueError(f"{args.domain} split {args.split!r} has no tasks")
    context, new_tokens = rollout_limits(args, policy)
    slots = min(args.slots, len(tasks) * args.trials)
    engine = make_engine(policy, num_slots=slots, max_len=context)
    end_on_malformed = policy.config.rollout.end_on_malformed_call if policy.config is not None else False
    if args.domain == "bfcl" and cfg.env.bfcl_category == "multi_turn_miss_func":
        # a function added mid-conversation is not in the tool list the rollout checks calls against
        end_on_malformed = False
    options = RolloutOptions(n=args.trials, max_turns=args.max_turns, max_new_tokens_per_turn=new_tokens,
                             max_context=context, temperature=args.temperature, top_p=args.top_p,
                             communicate_info=not args.no_communicate_info, end_on_malformed_call=end_on_malformed)
    print(f"evaluating on {args.domain}/{args.split}: {len(tasks)} tasks x {args.trials} trials, user {args.user}, "
          f"temperature {args.temperature:g}, {slots} slots, context {context}", flush=True)
    batch = run_rollouts_sync(engine, policy.tokenizer, env, user, tasks, options=options, seed=args.seed)
    trajectories = list(batch)
    summary = summarize(trajectories, args.trials)
    summary.update(domain=args.domain, split=args.split, user=args.user, temperature=args.temperature,
                   checkpoint=policy.path, stage=policy.stage, step=policy.step,
                   failed_rollouts=sum(t.failed for t in trajectories),
                   sampled_tokens=sum(t.num_sampled for t in trajectories), wall_s=round(time.time() - start, 2))
    if args.domain == "bfcl":
        summary["bfcl_category"] = cfg.env.bfcl_category
    name = f"bfcl-{cfg.env.bfcl_category}" if args.domain == "bfcl" else args.domain
    out = args.out or f"eval-{name}-{args.split}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"summary": summary, "options": dataclasses.asdict(options),
                   "tasks": task_records(trajectories, args.trials)}, f, indent=1, default=str)
    os.replace(tmp, out)
    summary["out"] = os.path.abspath(out)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from muajax.config import ConfigError
    from muajax.policy_loading import PolicyLoadError

    try:
        summary = evaluate(args)
    except (PolicyLoadError, ConfigError, ValueError, ImportError) as e:
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
