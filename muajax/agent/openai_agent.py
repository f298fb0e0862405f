"""An agent behind any OpenAI-compatible chat endpoint, played against a domain and its
simulated user: the source of cold-start data from a stronger model (`python -m muajax.synth`).

Like MUA-RL's rollouts, only the first tool call of a message is executed; the user sees
the agent's visible text only.
"""
from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import openai

from muajax.agent.assistant_format import visible_text
from muajax.domains.base import Environment, Task, ToolCall, UserSimulator, sft_record


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
            turn = await user_session.reply(visible_text(reply.content or ""))
            messages.append({"role": "user", "content": turn.text})
            if turn.end or turn.failed:
                break
        evaluation = session.evaluate(messages, communicate_info=True)
        return sft_record(env, task, messages, evaluation)
    finally:
        session.close()


async def openai_records(env: Environment, tasks: list[Task], user: UserSimulator, *, model: str, base_url: str,
                         api_key_env: str, max_turns: int, concurrency: int) -> list[dict[str, Any]]:
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
