"""Cold-start SFT data: run an agent against an environment with a simulated user and
keep the conversations that earn reward 1.

  python -m muajax.synth --out data/sft.jsonl [--domain builtin] [--agent expert]
                         [--careless 0.3] [--split train] [--repeats 1]
  python -m muajax.synth --out data/sft.jsonl --agent openai --agent-model NAME \
                         --agent-base-url URL [--agent-api-key-env OPENAI_API_KEY]

`expert` is the built-in domain's scripted expert (offline). `openai` is any
OpenAI-compatible chat endpoint given the tools, talking to the simulated user
(scripted for the built-in domain). Each JSONL line holds `messages` (OpenAI-style,
without the system message), `tools`, `system` (the policy), `task_id` and `reward`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from muajax.agent.openai_agent import openai_records
from muajax.config.schema import EnvConfig, UserConfig
from muajax.domains.base import WRITES_CONFIRMED
from muajax.domains.builtin.expert import expert_records
from muajax.domains.registry import make_environment, make_user


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m muajax.synth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--domain", default="builtin")
    parser.add_argument("--split", default="train")
    parser.add_argument("--agent", choices=("expert", "openai"), default="expert")
    parser.add_argument("--careless", type=float, default=0.3,
                        help="expert only: share of tasks on which it writes before the user confirms")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the tasks, each with its own seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-all", action="store_true", help="also keep conversations with reward 0")
    parser.add_argument("--agent-model")
    parser.add_argument("--agent-base-url")
    parser.add_argument("--agent-api-key-env", default="OPENAI_API_KEY")
    parser.add_argument("--max-turns", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)

    env_cfg = EnvConfig(domain=args.domain)
    env = make_environment(env_cfg)
    tasks = env.tasks(args.split)
    records: list[dict[str, Any]] = []
    for r in range(args.repeats):
        if args.agent == "expert":
            if args.domain != "builtin":
                parser.error("--agent expert exists only for --domain builtin")
            records += expert_records(env, tasks, careless=args.careless, seed=args.seed + r)
        else:
            if not (args.agent_model and args.agent_base_url):
                parser.error("--agent openai needs --agent-model and --agent-base-url")
            records += asyncio.run(openai_records(
                env, tasks, make_user(UserConfig(kind="scripted"), env_cfg), model=args.agent_model, base_url=args.agent_base_url,
                api_key_env=args.agent_api_key_env, max_turns=args.max_turns, concurrency=args.concurrency))
    kept = [r for r in records if args.keep_all or r["reward"] == 1.0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = f"{args.out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for record in kept:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, args.out)
    unconfirmed = sum(1 for r in kept if r[WRITES_CONFIRMED] and not all(r[WRITES_CONFIRMED]))
    summary = {"generated": len(records), "kept": len(kept), "kept_with_unconfirmed_write": unconfirmed,
               "out": args.out}
    print(f"synth: kept {len(kept)} of {len(records)} conversations ({unconfirmed} write before confirmation)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
