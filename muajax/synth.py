"""Cold-start SFT data: run an agent against a domain with its simulated user and keep the
conversations that earn reward 1; or import conversations in the OpenAI format.

  python -m muajax.synth --out data/sft.jsonl                    # built-in domain, scripted expert
  python -m muajax.synth --out data/sft.jsonl --domain retail --agent openai \\
      --agent-model M --agent-base-url URL --user openai --user-model U --user-base-url URL2
  python -m muajax.synth --out data/sft.jsonl --config RUN.yaml --agent openai --agent-model M ...
  python -m muajax.synth --import released.jsonl --out data/sft.jsonl

The domain and user are those of training: `--config` takes a run config's `env` and
`user` sections (τ2, the built-in domain, MCP servers and scenarios), and the `--domain`,
`--mcp-scenario` and `--user*` flags set or override them. `expert` is the built-in
domain's scripted expert (offline); `openai` is any OpenAI-compatible chat endpoint given
the tools. Each output line holds `messages` (OpenAI-style, without the system message),
`tools`, `system` (the policy), `task_id` and `reward`. `--import` converts conversations
in the OpenAI messages-with-tools format (muajax.agent.sft_import). The last line printed
is JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from muajax.agent.openai_agent import AgentEndpoint
from muajax.agent.sft_import import SftImportError, import_conversations
from muajax.config.fields import ConfigError, from_dict
from muajax.config.schema import EnvConfig, UserConfig, load_config
from muajax.domains.mcp.config import McpError
from muajax.domains.registry import DomainConfigError
from muajax.models.tokenizer import load_tokenizer
from muajax.train.synth import SynthRequest, synthesize

DOMAINS = ("builtin", "retail", "airline", "telecom", "mcp")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m muajax.synth", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--import", dest="import_path", metavar="FILE", help="convert this OpenAI-format JSONL instead")
    p.add_argument("--config", help="a run config whose env and user sections to use")
    p.add_argument("--domain", choices=DOMAINS, help="default: the config's, else builtin")
    p.add_argument("--mcp-scenario", action="append", default=[], help="an MCP scenario file (repeatable)")
    p.add_argument("--split", default="train")
    p.add_argument("--max-tasks", type=int, help="only the first N tasks of the split")
    p.add_argument("--agent", choices=("expert", "openai"), default="expert")
    p.add_argument("--agent-model")
    p.add_argument("--agent-base-url")
    p.add_argument("--agent-api-key-env", default="OPENAI_API_KEY")
    p.add_argument("--user", choices=("scripted", "openai"), help="default: the config's, else scripted")
    p.add_argument("--user-model")
    p.add_argument("--user-base-url")
    p.add_argument("--user-api-key-env", help="NAME of the variable holding the user endpoint's key")
    p.add_argument("--careless", type=float, default=0.3,
                   help="expert only: share of tasks on which it writes before the user confirms")
    p.add_argument("--repeats", type=int, default=1, help="passes over the tasks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-all", action="store_true", help="also keep conversations with reward 0")
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=8)
    return p.parse_args(argv)


def sections(args) -> tuple[EnvConfig, UserConfig]:
    """The env and user sections: the config's, with the flags set over them."""
    cfg = load_config(args.config) if args.config else None
    env = dict(dataclasses.asdict(cfg.env)) if cfg else {}
    user = dict(dataclasses.asdict(cfg.user)) if cfg else {}
    if args.domain:
        env.update(domain=args.domain, domains=())
    if args.mcp_scenario:
        env.update(domain="mcp", domains=(), mcp={**env.get("mcp", {}), "scenarios": tuple(args.mcp_scenario)})
    flags = {"kind": args.user, "model": args.user_model, "base_url": args.user_base_url,
             "api_key_env": args.user_api_key_env}
    user.update({k: v for k, v in flags.items() if v is not None})
    return from_dict(EnvConfig, env, "env"), from_dict(UserConfig, user, "user")


def request_from_args(args) -> SynthRequest:
    env, user = sections(args)
    endpoint = None
    if args.agent == "openai" and args.agent_model and args.agent_base_url:
        endpoint = AgentEndpoint(args.agent_model, args.agent_base_url, args.agent_api_key_env)
    return SynthRequest(out=args.out, env=env, user=user, agent=args.agent, endpoint=endpoint, split=args.split,
                        max_tasks=args.max_tasks, careless=args.careless, repeats=args.repeats, seed=args.seed,
                        keep_all=args.keep_all, max_turns=args.max_turns, concurrency=args.concurrency)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.import_path:
            summary = import_conversations(args.import_path, args.out, load_tokenizer())
            print(f"synth: imported {summary['imported']} conversations ({summary['assistant_tokens']} of "
                  f"{summary['tokens']} tokens in the loss) to {summary['out']}")
        else:
            summary = synthesize(request_from_args(args))
            print(f"synth: kept {summary['kept']} of {summary['generated']} conversations ({summary['failed']} "
                  f"failed, {summary['kept_with_unconfirmed_write']} write before confirmation)")
    except (ConfigError, DomainConfigError, McpError, SftImportError, ValueError) as exc:
        print(f"muajax.synth: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
