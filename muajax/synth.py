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

An agent plays every task of a split against the domain (built from the `env` section, as
in training: τ2, the built-in shop, MCP scenarios) and the simulated user (the `user`
section, as in training); the conversations that earn reward 1 (τ-bench's output check
on) are kept, one JSON line each (`muajax.domains.base.sft_record`), for `sft.data`.
Conversations whose user or agent endpoint failed are never kept.

Agents: `expert`, the built-in domain's scripted expert (offline; it plays against the
domain's scripted user), or `openai`, any OpenAI-compatible chat endpoint given the tools
(`muajax.agent.openai_agent`).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from typing import Any

from muajax.agent.openai_agent import AgentEndpoint, openai_records
from muajax.agent.sft_import import SftImportError, import_conversations
from muajax.config.schema import EnvConfig, UserConfig, load_config
from muajax.domains.base import WRITES_CONFIRMED, Environment
from muajax.domains.builtin.expert import expert_records
from muajax.domains.mcp.config import McpError
from muajax.domains.registry import DomainConfigError, make_environment, make_user
from muajax.models.tokenizer import load_tokenizer
from muajax.settings.fields import ConfigError, from_dict

@dataclasses.dataclass(frozen=True)
class SynthRequest:
    out: str
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    user: UserConfig = dataclasses.field(default_factory=UserConfig)
    agent: str = "expert"  # "expert" (built-in domain) or "openai" (`endpoint`)
    endpoint: AgentEndpoint | None = None
    split: str = "train"
    max_tasks: int | None = None  # the first N tasks of the split
    careless: float = 0.3  # expert only: share of tasks on which it writes before the user confirms
    repeats: int = 1  # passes over the tasks (the expert's with their own seeds)
    seed: int = 0
    keep_all: bool = False  # also keep reward-0 conversations (never failed ones)
    max_turns: int = 30
    concurrency: int = 8


def check_request(request: SynthRequest) -> None:
    """A request that cannot run stops here, naming what to change."""
    if request.agent not in ("expert", "openai"):
        raise DomainConfigError(f"agent: expected 'expert' or 'openai', got {request.agent!r}")
    if request.agent == "expert" and (request.env.domain != "builtin" or request.env.domains):
        raise DomainConfigError("the expert agent exists only for the built-in domain; use an OpenAI-compatible "
                                "agent (--agent openai) for τ2 and MCP")
    if request.user.kind == "scripted" and (request.env.domain != "builtin" or request.env.domains):
        raise DomainConfigError("the scripted user exists only for the built-in domain: give an LLM user "
                                "(user.kind=openai, or --user openai --user-model M --user-base-url URL)")
    if request.agent == "openai" and request.endpoint is None:
        raise DomainConfigError("the openai agent needs an endpoint (--agent-model and --agent-base-url)")
    for name in ("repeats", "max_turns", "concurrency"):
        if getattr(request, name) < 1:
            raise DomainConfigError(f"{name} must be >= 1, got {getattr(request, name)}")


async def _openai_run(request: SynthRequest, env: Environment, tasks) -> list[dict[str, Any]]:
    # The user simulator's HTTP client belongs to this event loop: made, used and closed in it.
    user = make_user(request.user, request.env)
    try:
        return await openai_records(env, tasks, user, request.endpoint, repeats=request.repeats,
                                    max_turns=request.max_turns, concurrency=request.concurrency)
    finally:
        await user.aclose()


def generate(request: SynthRequest, env: Environment) -> list[dict[str, Any]]:
    """Every conversation of the request, kept or not."""
    tasks = env.tasks(request.split)[: request.max_tasks]
    if not tasks:
        raise DomainConfigError(f"split {request.split!r} of {env.name} has no tasks")
    if request.agent == "expert":
        return [record for r in range(request.repeats)
                for record in expert_records(env, tasks, careless=request.careless, seed=request.seed + r)]
    return asyncio.run(_openai_run(request, env, tasks))


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)


def synthesize(request: SynthRequest) -> dict[str, Any]:
    """Generate, filter and write the data; returns the summary (counts, the first failure)."""
    check_request(request)
    env = make_environment(request.env)
    try:
        records = generate(request, env)
    finally:
        close = getattr(env, "close", None)  # MCP: shared servers
        if close is not None:
            close()
    failed = [r for r in records if r.get("failed")]
    kept = [r for r in records if not r.get("failed") and (request.keep_all or r["reward"] == 1.0)]
    write_jsonl(request.out, kept)
    unconfirmed = sum(1 for r in kept if r.get(WRITES_CONFIRMED) and not all(r[WRITES_CONFIRMED]))
    return {"generated": len(records), "failed": len(failed), "kept": len(kept),
            "kept_with_unconfirmed_write": unconfirmed, "first_failure": failed[0]["failed"] if failed else None,
            "out": os.path.abspath(request.out)}


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
