"""An agent behind any OpenAI-compatible chat endpoint, played against a domain and its
simulated user: the source of cold-start data from a stronger model (`python -m muajax.synth`).

Like MUA-RL's rollouts, only the first tool call of a message is executed (and recorded);
the user sees the agent's visible text only. A conversation whose agent endpoint failed,
or whose user could not answer, is returned with `failed` set: it says nothing about the
agent and is never kept as training data.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import urllib.parse
from typing import Any

import openai

from muajax.agent.assistant_format import visible_text
from muajax.domains.base import Environment, Task, ToolCall, UserSimulator, sft_record

log = logging.getLogger(__name__)
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class AgentEndpoint:
    """The agent's endpoint: a model name, a base URL and the NAME of the variable holding its
    key (a local server needs none)."""

    model: str
    base_url: str
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0

    def client(self) -> openai.AsyncOpenAI:
        key = os.environ.get(self.api_key_env)
        if not key and (urllib.parse.urlsplit(self.base_url).hostname or "") not in _LOCAL_HOSTS:
            raise ValueError(f"the agent endpoint {self.base_url} needs an API key: set the environment variable "
                             f"{self.api_key_env}")
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key or "EMPTY", max_retries=3)


def _first_call(reply) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The assistant message as recorded (its first tool call only) and that call's arguments
    (None when they are not a JSON object)."""
    call = reply.tool_calls[0]
    raw = call.function.arguments or "{}"
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError:
        arguments = None
    message = {"role": "assistant", "content": reply.content or "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": raw}}]}
    return message, arguments if isinstance(arguments, dict) else None


async def _conversation(client, agent: AgentEndpoint, env: Environment, task: Task, user: UserSimulator,
                        max_turns: int) -> dict[str, Any]:
    session = env.reset(task)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.first_user_message}]
    failed = None
    try:
        user_session = user.start(task, session)
        tools = session.tools()
        for _ in range(max_turns):
            response = await client.chat.completions.create(
                model=agent.model, messages=[{"role": "system", "content": env.policy_for(task)}, *messages],
                tools=tools, temperature=agent.temperature)
            reply = response.choices[0].message
            if reply.tool_calls:  # MUA-RL executes only the first call of a message
                message, arguments = _first_call(reply)
                messages.append(message)
                call = message["tool_calls"][0]
                obs = (session.step(ToolCall(call["function"]["name"], arguments, call["id"]))
                       if arguments is not None else None)
                content = obs.content if obs is not None else "Error: arguments must be a JSON object"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
                if obs is not None and obs.done:
                    break
                continue
            messages.append({"role": "assistant", "content": reply.content or ""})
            turn = await user_session.reply(visible_text(reply.content or ""))
            if turn.failed:
                failed = f"the user could not answer: {turn.error}"
                break
            messages.append({"role": "user", "content": turn.text})
            if turn.end:
                break
        record = sft_record(env, task, messages, session.evaluate(messages, communicate_info=True), tools=tools)
    except Exception as exc:  # noqa: BLE001 - one failed conversation must not end the others
        what = "the agent endpoint failed" if isinstance(exc, openai.OpenAIError) else "the conversation failed"
        log.error("synth: task %s: %s: %s", task.task_id, what, exc)
        record = {"task_id": task.task_id, "messages": messages, "reward": 0.0}
        failed = f"{what}: {type(exc).__name__}: {exc}"
    finally:
        session.close()
    record["failed"] = failed
    return record


async def openai_records(env: Environment, tasks: list[Task], user: UserSimulator, agent: AgentEndpoint, *,
                         repeats: int = 1, max_turns: int = 30, concurrency: int = 8) -> list[dict[str, Any]]:
    """SFT records (`muajax.domains.base.sft_record`, plus `failed`) of the agent on every task,
    `repeats` times, kept or not; at most `concurrency` conversations at once."""
    client = agent.client()
    limit = asyncio.Semaphore(concurrency)

    async def one(task):
        async with limit:
            return await _conversation(client, agent, env, task, user, max_turns)

    try:
        return list(await asyncio.gather(*(one(t) for _ in range(repeats) for t in tasks)))
    finally:
        await client.close()
