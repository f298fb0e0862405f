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

from muajax.envs.base import Environment, Task, ToolCall
from muajax.users.base import UserSimulator


def make_environment(domain: str, **kwargs) -> Environment:
    if domain == "builtin":
        from muajax.envs.builtin import BuiltinEnvironment

        return BuiltinEnvironment(**kwargs)
    if domain in ("retail", "airline", "telecom"):
        from muajax.envs.tau2 import Tau2Environment

        return Tau2Environment(domain)
    raise ValueError(f"unknown domain {domain!r}: builtin, retail, airline, telecom (MCP via the train config)")


def expert_records(env: Environment, tasks: list[Task], *, careless: float, seed: int) -> list[dict[str, Any]]:
    from muajax.envs.builtin.expert import expert_conversation

    records = []
    for task in tasks:
        messages, evaluation = expert_conversation(env, task, careless=careless, seed=seed)
        records.append(_record(env, task, messages, evaluation.reward, evaluation.details))
    return records


def _record(env, task, messages, reward, details) -> dict[str, Any]:
    session = env.reset(task)
    try:
        tools = session.tools()
    finally:
        session.close()
    return {"task_id": task.task_id, "system": env.policy(), "tools": tools, "messages": messages,
            "reward": float(reward), "writes_confirmed": (details or {}).get("writes_confirmed")}


async def _openai_agent_conversation(client, model: str, env: Environment, task: Task, user: UserSimulator,
                                     max_turns: int) -> dict[str, Any]:
    session = env.reset(task)
    user_session = user.start(task, session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.first_user_message}]
    try:
        tools = session.tools()
        for _ in range(max_turns):
            response = await client.chat.completions.create(
                model=model, messages=[{"role": "system", "content": env.policy()}, *messages], tools=tools,
                temperature=0.0)
            reply = response.choices[0].message
            calls = reply.tool_calls or []
            if calls:
                call = calls[0]  # MUA-RL executes only the first call of a message
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    arguments = None
                messages.append({"role": "assistant", "content": reply.content or "", "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
                if not isinstance(arguments, dict):
                    content, done = "Error: arguments must be a JSON object", False
                else:
                    obs = session.step(ToolCall(call.function.name, arguments, call.id))
                    content, done = obs.content, obs.done
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
                if done:
                    break
                continue
            messages.append({"role": "assistant", "content": reply.content or ""})
            turn = await user_session.reply(reply.content or "")
            messages.append({"role": "user", "content": turn.text})
            if turn.end or turn.failed:
                break
        evaluation = session.evaluate(messages, communicate_info=True)
        return _record(env, task, messages, evaluation.reward, evaluation.details)
    finally:
        session.close()


async def openai_records(env: Environment, tasks: list[Task], user: UserSimulator, *, model: str, base_url: str,
                         api_key_env: str, max_turns: int, concurrency: int) -> list[dict[str, Any]]:
    import openai

    key = os.environ.get(api_key_env) or ("unused" if "127.0.0.1" in base_url or "localhost" in base_url else None)
    if key is None:
        raise SystemExit(f"synth: set the environment variable {api_key_env} for the agent endpoint")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=3)
    limit = asyncio.Semaphore(concurrency)

    async def one(task):
        async with limit:
            return await _openai_agent_conversation(client, model, env, task, user, max_turns)

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await client.close()


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

    env = make_environment(args.domain)
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
            from muajax.users.scripted import ScriptedUser

            records += asyncio.run(openai_records(
                env, tasks, ScriptedUser(), model=args.agent_model, base_url=args.agent_base_url,
                api_key_env=args.agent_api_key_env, max_turns=args.max_turns, concurrency=args.concurrency))
    kept = [r for r in records if args.keep_all or r["reward"] == 1.0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = f"{args.out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for record in kept:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, args.out)
    unconfirmed = sum(1 for r in kept if r["writes_confirmed"] and not all(r["writes_confirmed"]))
    summary = {"generated": len(records), "kept": len(kept), "kept_with_unconfirmed_write": unconfirmed,
               "out": args.out}
    print(f"synth: kept {len(kept)} of {len(records)} conversations ({unconfirmed} write before confirmation)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
