"""`python -m muajax.eval --checkpoint DIR --domain D [D ...] [--protocol muajax|tau2] [options]`,
or `python -m muajax.eval --policy gold --domain D [--split S]`.

--protocol muajax (default): the policy in DIR (a muajax run/checkpoint directory or a
Hugging Face directory) on every task of a split, `--trials` times each, with a simulated
user in the loop, through the same engine and rollout loop as training, with τ2's rules
where they differ from training's (every call of a message runs, an episode not ended by
the user or agent scores 0, τ2's own tool list); see `muajax.evaluation.saved_policy`. Greedy by
default, as in the paper's evaluation; τ-bench's told-the-user check is on.

--protocol tau2: τ2-bench's official protocol. DIR is served by muajax's own server and τ2's
own runner plays it: τ2's orchestrator, agent prompt, 200-step limit, user simulator and
evaluator (see `muajax.serving.tau2_protocol`). τ2 domains only.

--policy gold: replays every task's gold actions through muajax's environment and reward
path (no model) and prints the reward histogram: the check to run on a new domain.

Both protocols print pass^1 … pass^k per domain (τ2's estimator C(c, k)/C(n, k) per task,
averaged; several domains are never pooled), and on τ2's test split also the score with
the split twins removed (`dedup`); each writes the per-task JSON with every conversation.
The last line is one JSON object: {"protocol", "split", "trials", "domains": {domain: figures}}
(gold: {"policy": "gold", "domain", "split", "n", "reward_mean", "histogram", ...}).

The user: `scripted` (built-in domain only, offline) or `openai` (any OpenAI-compatible
endpoint: --user-model, --user-base-url; the key is read from the environment variable
named by --user-api-key-env and never printed). Evaluating a muajax run, its config's
`eval.user` (else its training `user`) is used; --user-* flags override its fields.

BFCL-v3 multi-turn (`--domain bfcl`, needs the optional nvidia-bfcl install, see the
README): `--bfcl-category` base (default), miss_func, miss_param or long_context; the
split is `test`. The user is the benchmark's scripted turns, the prompt BFCL's
function-calling one, every call of a message runs as one BFCL step, and the score is
BFCL's own multi-turn checker; the episode limit defaults to 200 turns there.

ACEBench Agent (`--domain acebench --acebench-dir CHECKOUT [--language en|zh]`, docs/acebench.md):
the multi-turn and multi-step items of a checkout; the user (multi-turn only) is an
OpenAI-compatible endpoint under ACEBench's user prompt. It prints each subset's end-to-end
and process accuracy and their unweighted mean ("Overall"); the limit defaults to 20 turns
(ACEBench's 40 dialogue messages) and the final state is scored however the dialogue ended.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from muajax.settings.fields import ConfigError
from muajax.domains.acebench.scoring import format_figures
from muajax.domains.registry import TAU2_DOMAINS, DomainConfigError
from muajax.evaluation.saved_policy import EvalRequest, evaluate_checkpoint, evaluate_gold
from muajax.runtime.policy import PolicyLoadError

DOMAINS = ("builtin", "retail", "airline", "telecom", "bfcl", "mcp", "tau1-retail", "tau1-airline",
           "acebench")
BFCL_CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
SCRIPTED_DOMAINS = ("builtin", "bfcl")  # domains whose user needs no model
USER_FLAGS = {"kind": "user", "model": "user_model", "base_url": "user_base_url", "api_key_env": "user_api_key_env",
              "temperature": "user_temperature", "max_concurrency": "user_concurrency"}
FIGURES = ("tasks", "success", "partial", "turns", "confirm_rate", "calls_per_tool", "terminations",
           "failed_rollouts", "sampled_tokens", "user_model", "wall_s", "out")


def _add_user_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated user (default: the run's eval.user, else its user)")
    g.add_argument("--user", choices=("scripted", "openai"),
                   help="default: scripted for builtin and bfcl (BFCL's own turns), else openai")
    g.add_argument("--user-model")
    g.add_argument("--user-base-url")
    g.add_argument("--user-api-key-env", help="NAME of the env var holding the key (default OPENAI_API_KEY)")
    g.add_argument("--user-temperature", type=float)
    g.add_argument("--user-concurrency", type=int, help="requests in flight to the user endpoint")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m muajax.eval", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="muajax run/checkpoint directory, or a HF directory (not with --policy gold)")
    p.add_argument("--policy", choices=("checkpoint", "gold"), default="checkpoint",
                   help="gold: replay the tasks' gold actions instead of running a model")
    p.add_argument("--protocol", choices=("muajax", "tau2"), default="muajax")
    p.add_argument("--stage", choices=("sft", "grpo"), help="stage of a muajax run (default: the latest)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument("--domain", required=True, nargs="+", choices=DOMAINS, help="one or more, each reported alone")
    p.add_argument("--split", default="test")
    p.add_argument("--config", help="a run config: its env section (e.g. MCP servers) and evaluation user")
    p.add_argument("--bfcl-category", default="base", choices=BFCL_CATEGORIES + tuple(f"multi_turn_{c}" for c in
                   BFCL_CATEGORIES), help="--domain bfcl: the BFCL-v3 multi-turn category (default: base)")
    p.add_argument("--tau1-dir", help="--domain tau1-retail|tau1-airline: a checkout of sierra-research/tau-bench")
    p.add_argument("--acebench-dir", help="--domain acebench: a checkout of ACEBench (git clone "
                   "https://github.com/ACEBench/ACEBench)")
    p.add_argument("--language", choices=("en", "zh"), help="--domain acebench: its English or Chinese items (default en)")
    p.add_argument("--trials", type=int, default=4, help="rollouts per task (τ2 uses 4); pass^k for k <= trials")
    p.add_argument("--max-tasks", type=int, help="only the first N tasks of the split")
    p.add_argument("--task-ids", nargs="+", help="only these tasks of the split (one --domain)")
    p.add_argument("--temperature", type=float, default=0.0, help="the agent's sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="sampling seed (default 0; --protocol tau2: τ2's 300)")
    _add_user_args(p)
    p.add_argument("--max-turns", type=int, help="muajax: user replies + tool calls per episode (default 30; bfcl 200; acebench 20)")
    p.add_argument("--max-steps", type=int, default=200, help="tau2: τ2's step limit per simulation")
    p.add_argument("--max-errors", type=int, default=10, help="tau2: τ2's tool-error limit per simulation")
    p.add_argument("--max-new-tokens", type=int, help="per assistant turn (default: the run's, else 1024)")
    p.add_argument("--max-context", type=int, help="tokens per conversation (default: the run's, else 16384)")
    p.add_argument("--slots", type=int, help="conversations decoded side by side (default 32; tau2: simulations in "
                                            "flight, default 8)")
    p.add_argument("--terse-tools", action="store_true", default=None,
                   help="built-in domain: short tool schemas (default: as the run was trained)")
    p.add_argument("--no-communicate-info", action="store_true", help="drop the told-the-user check (as training)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="params/compute dtype (default: the model's)")
    p.add_argument("--out", help="per-task JSON (default: eval-<domain>-<split>.json here; several domains: "
                                 "<out>-<domain>.json)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("trials", "max_tasks", "max_turns", "max_new_tokens", "max_context", "slots", "user_concurrency",
                 "max_steps", "max_errors"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    if len(set(args.domain)) != len(args.domain):
        p.error("--domain lists a domain twice")
    if args.task_ids and len(args.domain) != 1:
        p.error("--task-ids picks tasks of one --domain (τ2's domains share ids)")
    if (args.policy == "gold") == (args.checkpoint is not None):
        p.error("give --checkpoint DIR, or --policy gold (which runs no model)")
    if args.policy == "gold" and (args.protocol != "muajax" or len(args.domain) != 1):
        p.error("--policy gold replays one --domain through muajax's environment (no --protocol tau2)")
    if args.protocol == "tau2" and not set(args.domain) <= set(TAU2_DOMAINS):
        p.error(f"--protocol tau2 runs τ2's own runner: --domain must be among {', '.join(TAU2_DOMAINS)}")
    if args.user == "scripted" and not set(args.domain) <= set(SCRIPTED_DOMAINS):
        p.error(f"--user scripted exists only for --domain builtin or bfcl; {' '.join(args.domain)} needs --user openai")
    if args.tau1_dir is not None and not any(d.startswith("tau1-") for d in args.domain):
        p.error("--tau1-dir applies only to --domain tau1-retail or tau1-airline")
    if "acebench" not in args.domain and (args.acebench_dir or args.language):
        p.error("--acebench-dir and --language apply only to --domain acebench")
    if "bfcl" not in args.domain and args.bfcl_category != "base":
        p.error("--bfcl-category applies only to --domain bfcl")
    if "bfcl" in args.domain and args.user == "openai":
        p.error("--domain bfcl plays BFCL's own scripted user turns; --user openai does not apply")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _build_parser()
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _user_fields(args) -> dict[str, Any]:
    return {field: getattr(args, flag) for field, flag in USER_FLAGS.items()}


def request_from_args(args) -> EvalRequest:
    category = args.bfcl_category
    return EvalRequest(checkpoint=args.checkpoint, domains=tuple(args.domain), split=args.split, stage=args.stage,
                       step=args.step, bfcl_category=category if category.startswith("multi_turn_")
                       else f"multi_turn_{category}", trials=args.trials, max_tasks=args.max_tasks,
                       task_ids=tuple(args.task_ids) if args.task_ids else None, temperature=args.temperature, top_p=args.top_p, seed=args.seed or 0, user=_user_fields(args),
                       max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_context=args.max_context,
                       slots=args.slots or 32, terse_tools=args.terse_tools, communicate_info=not args.no_communicate_info,
                       dtype=args.dtype, out=args.out, config=args.config, tau1_dir=args.tau1_dir,
                       acebench_dir=args.acebench_dir, acebench_language=args.language)


def tau2_request_from_args(args):
    # τ2's runner (and litellm behind it) loads only for this protocol
    from muajax.serving.tau2_protocol import TAU2_DEFAULT_SEED, Tau2ProtocolRequest

    return Tau2ProtocolRequest(
        checkpoint=args.checkpoint, domains=tuple(args.domain), split=args.split, trials=args.trials,
        max_tasks=args.max_tasks, task_ids=tuple(args.task_ids) if args.task_ids else None, stage=args.stage, step=args.step, dtype=args.dtype, user=_user_fields(args),
        temperature=args.temperature, max_steps=args.max_steps, max_errors=args.max_errors,
        concurrency=args.slots or 8, max_context=args.max_context,
        max_new_tokens=args.max_new_tokens, seed=TAU2_DEFAULT_SEED if args.seed is None else args.seed,
        out=args.out, config=args.config)


def print_summary(name: str, summary: dict[str, Any], trials: int) -> None:
    print(f"{name}: tasks {summary['tasks']} x trials {trials}", flush=True)
    for k in range(1, trials + 1):
        print(f"  pass^{k}: {summary[f'pass^{k}']:.4f}")
    dedup = summary.get("dedup")
    if dedup:
        print(f"  without the split twins ({', '.join(dedup['removed'])}): {dedup['tasks']} tasks, "
              + ", ".join(f"pass^{k} {dedup[f'pass^{k}']:.4f}" for k in range(1, trials + 1) if f"pass^{k}" in dedup))
    if "partial" in summary:
        print(f"  partial (TCR): {summary['partial']:.4f}   average turns: {summary['turns']:.2f}")
        calls = summary["calls_per_tool"]
        print("  calls per tool (per rollout): " + (", ".join(f"{n} {v:.2f}" for n, v in calls.items()) or "none"))
    else:
        print(f"  average reward: {summary['avg_reward']:.4f}   skipped (failed) simulations: {summary['skipped']}")
    print(f"  terminations: {summary['terminations']}", flush=True)
    for line in format_figures(summary["acebench"]) if "acebench" in summary else ():
        print(line, flush=True)
    print(f"  per-task results: {summary['out']}", flush=True)


def figures_of(summary: dict[str, Any], trials: int) -> dict[str, Any]:
    keys = [f"pass^{k}" for k in range(1, trials + 1)] + ["dedup", "bfcl_category", "avg_reward", "simulations",
                                                          "skipped", "acebench",
                                                          *FIGURES]
    return {k: summary[k] for k in keys if k in summary}


def print_gold(summary: dict[str, Any]) -> None:
    print(f"gold replay of {summary['domain']}/{summary['split']}: {summary['n']} tasks, mean reward "
          f"{summary['reward_mean']:.4f}", flush=True)
    for reward, count in summary["histogram"].items():
        print(f"  reward {reward}: {count} tasks")
    if summary["not_one"]:
        print(f"  below 1: {', '.join(summary['not_one'][:20])}" + (" ..." if len(summary["not_one"]) > 20 else ""))
    for line in format_figures(summary["acebench"]) if "acebench" in summary else ():
        print(line, flush=True)
    print(f"  per-task results: {summary['out']}", flush=True)


def run(args) -> dict[str, Any]:
    if args.policy == "gold":
        summary = evaluate_gold(request_from_args(args))
        print_gold(summary)
        return summary
    if args.protocol == "tau2":
        from muajax.serving.tau2_protocol import run_tau2_protocol  # see tau2_request_from_args

        result = run_tau2_protocol(tau2_request_from_args(args))
    else:
        result = evaluate_checkpoint(request_from_args(args))
    for name, summary in result["domains"].items():
        print_summary(name, summary, args.trials)
    return {"protocol": result["protocol"], "split": result["split"], "trials": result["trials"],
            "domains": {name: figures_of(s, args.trials) for name, s in result["domains"].items()},
            "wall_s": result["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        figures = run(args)
    except (PolicyLoadError, ConfigError, DomainConfigError, ValueError, ImportError, ConnectionError) as e:
        print(f"muajax.eval: error: {e}", file=sys.stderr, flush=True)
        print(json.dumps({"error": str(e)}), flush=True)
        return 2
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
