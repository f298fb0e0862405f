"""A simulated user behind any OpenAI-compatible chat endpoint (OpenAI, vLLM, SGLang, ...).

The simulated user's own view of the conversation is role-flipped (MUA-RL / τ-bench): its
system prompt is the user guidelines plus the task scenario, its own turns are
"assistant" messages (starting with the task's first user message) and the agent's plain
text arrives as "user" messages. The agent's tool calls and tool results never enter it.

Reliability: every request has a timeout; connection errors, timeouts, 408/409/429 and
5xx are retried with exponential backoff and jitter, waiting at least what a Retry-After
asks; one `asyncio.Semaphore` caps the requests in flight across all sessions of a
simulator. Pacing (`muajax.domains.pacing`): `requests_per_minute` and `tokens_per_minute`
start requests no faster than the endpoint allows, through a limiter the whole process
shares. `turn_timeout_s` bounds one whole user turn (waits for a slot and for the limiter,
every attempt, backoff and round of the user's own tools): a retry whose wait would end
past the deadline is not waited for, and the turn fails at the deadline whatever is in
flight. When a turn fails, `reply` returns `UserTurn(failed=True, error=...)` instead of
raising, so one flaky endpoint cannot take down a batch of rollouts (the rollout counts as
a user failure, out of the update).

The API key is read from the environment variable named by `api_key_env`, at
construction; it is handed to the client and is never logged, stored on the simulator,
or shown in repr. A credential inside `base_url` (userinfo, a `?key=` parameter; run
configs refuse them, code may pass one) is hidden too: the repr, the missing-key message
and every logged error show the URL redacted. A simulator (and its HTTP client) belongs to
one event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import urllib.parse
from typing import Any

import openai

from muajax.settings.secrets import redact, redact_url
from muajax.domains.pacing import estimate_tokens, retry_after_s, shared_limiter
from muajax.models.tokenizer import strip_control_tokens
from muajax.domains.base import EnvSession, Observation, Task, ToolCall
from muajax.domains.base import UserSession, UserSimulator, UserTurn, find_end_token

log = logging.getLogger(__name__)

DEFAULT_USER_GUIDELINES = """\
You are playing the role of a customer contacting a customer service agent. Your goal is \
to simulate a realistic, natural conversation while following the scenario below.

Rules:
- Write only what the customer says next: one message at a time, in plain language.
- Reveal information gradually and only when it is needed or asked for; do not recite \
the whole scenario at once.
- Never invent information that the scenario does not give you (names, ids, numbers, \
addresses, order details). If you are asked for something you do not know, say that you \
do not know or do not have it.
- Do not repeat the scenario's instructions word for word; say things in your own words.
- Stay in character: you are the customer, not the agent. Do not offer to perform the \
agent's work, and do not accept actions your scenario does not want.
- If the agent proposes something, judge it against your scenario before agreeing.
- When the task in your scenario is fully done, reply with only ###STOP###.
- If you are transferred to another (human) agent, reply with only ###TRANSFER###.
- If the scenario does not give you enough information to continue, reply with only \
###OUT-OF-SCOPE###.
"""

_RETRY_STATUS = frozenset({408, 409, 429})
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


def _is_local(base_url: str) -> bool:
    host = urllib.parse.urlsplit(base_url).hostname or ""
    return host in _LOCAL_HOSTS or host.startswith("127.")


# httpx logs every request's full URL at INFO, userinfo included; the OpenAI client logs
# requests at DEBUG. Their records pass through a filter that hides credentials.
_HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "openai._base_client")


class _RedactCredentials(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def _redact_http_logs() -> None:
    for name in _HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactCredentials) for f in logger.filters):
            logger.addFilter(_RedactCredentials())


class MissingApiKeyError(ValueError):
    """A remote endpoint and no key in the environment variable that should hold it."""


def _retry_after_s(error: openai.APIStatusError) -> float | None:
    return retry_after_s(getattr(getattr(error, "response", None), "headers", None))


# name: (the least value, whether it may equal it); None passes (no limit) where allowed
_LOWER_BOUNDS = {"temperature": (0, True), "max_tokens": (1, True), "timeout_s": (0, False),
                 "max_retries": (0, True), "max_concurrency": (1, True), "max_user_tool_steps": (0, True),
                 "turn_timeout_s": (0, False)}
_MAY_BE_NONE = frozenset({"max_tokens", "turn_timeout_s"})


def _check_numbers(**values: Any) -> None:
    for name, value in values.items():
        least, inclusive = _LOWER_BOUNDS[name]
        if value is None and name in _MAY_BE_NONE:
            continue
        if value is None or not (value >= least if inclusive else value > least):
            raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {least}, got {value}")


class OpenAIUserSimulator(UserSimulator):
    """Simulated users over one OpenAI-compatible endpoint; sessions share its limits."""

    def __init__(
        self,
        *,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key_env: str = "OPENAI_API_KEY",
        guidelines: str = DEFAULT_USER_GUIDELINES,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        max_concurrency: int = 16,
        max_user_tool_steps: int = 10,
        extra_body: dict[str, Any] | None = None,
        seed: int | None = None,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        turn_timeout_s: float | None = None,
    ):
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string (the endpoint's model name)")
        if not isinstance(base_url, str) or urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
            raise ValueError(f"base_url must be an http(s) URL, got {redact(repr(base_url))}")
        if not isinstance(api_key_env, str) or not api_key_env:
            raise ValueError("api_key_env must name an environment variable")
        if not isinstance(guidelines, str):
            raise TypeError("guidelines must be a str")
        _check_numbers(temperature=temperature, max_tokens=max_tokens, timeout_s=timeout_s, max_retries=max_retries,
                       max_concurrency=max_concurrency, max_user_tool_steps=max_user_tool_steps,
                       turn_timeout_s=turn_timeout_s)
        if backoff_base_s < 0 or backoff_max_s < backoff_base_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")
        self._limiter = shared_limiter(base_url, model, requests_per_minute, tokens_per_minute)

        _redact_http_logs()
        api_key = os.environ.get(api_key_env, "")
        if not api_key:
            if not _is_local(base_url):
                raise MissingApiKeyError(
                    f"the user simulator at {redact_url(base_url)} needs an API key: set the environment variable "
                    f"{api_key_env} (or point api_key_env at the variable that holds it)"
                )
            api_key = "EMPTY"  # local servers (vLLM, SGLang) accept any key; the client requires one
        self.model = model
        self.base_url = base_url
        self.api_key_env = api_key_env
        self.guidelines = guidelines
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_concurrency = max_concurrency
        self.max_user_tool_steps = max_user_tool_steps
        self.turn_timeout_s = turn_timeout_s
        self.extra_body = dict(extra_body or {})
        # The client does no retrying of its own: the policy (and its counters) lives here.
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._rng = random.Random(seed)
        self.requests = 0  # HTTP attempts sent
        self.retries = 0  # attempts after the first, per request
        self.failures = 0  # replies given up on (failed=True)
        self.timeouts = 0
        self.user_tool_calls = 0
        self.turns = 0
        self.throttled = 0  # 429 answers
        self.deadline_failures = 0  # turns failed at (or so as not to pass) their turn_timeout_s

    def __repr__(self) -> str:
        return (
            f"OpenAIUserSimulator(model={self.model!r}, base_url={redact_url(self.base_url)!r}, "
            f"api_key_env={self.api_key_env!r}, temperature={self.temperature}, "
            f"max_concurrency={self.max_concurrency})"
        )

    __str__ = __repr__

    def stats(self) -> dict[str, int]:
        return {
            "requests": self.requests, "retries": self.retries, "failures": self.failures,
            "timeouts": self.timeouts, "user_tool_calls": self.user_tool_calls, "turns": self.turns,
            "throttled": self.throttled, "deadline_failures": self.deadline_failures,
        }

    def system_prompt(self, task: Task) -> str:
        return f"{self.guidelines.rstrip()}\n\n<scenario>\n{task.user_scenario.strip()}\n</scenario>"

    def start(self, task: Task, env: EnvSession | None = None) -> OpenAIUserSession:
        return OpenAIUserSession(self, task, env)

    async def aclose(self) -> None:
        await self._client.close()

    # ------------------------------------------------------------------ requests

    def _redact(self, text: str) -> str:
        """An error for the logs: no API key, no credential inside a URL."""
        key = self._client.api_key
        if isinstance(key, str) and len(key) >= 4 and key != "EMPTY":
            text = text.replace(key, "***")
        return redact(text)

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        delay *= 0.5 + self._rng.random()  # jitter spreads a herd of retrying rollouts apart
        if retry_after is not None:  # the endpoint's word is a floor; the turn's deadline bounds it
            delay = max(delay, retry_after)
        return delay

    def _request(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature}
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        if tools:
            kwargs["tools"] = tools
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        return kwargs

    def _settle(self, response: Any, estimate: int) -> None:
        """Charge the limiter what a reply used beyond the request's estimate."""
        usage = getattr(response, "usage", None)
        used = getattr(usage, "total_tokens", None) if usage is not None else None
        if self._limiter is not None and isinstance(used, int) and used > estimate:
            self._limiter.charge(used - estimate)

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
        deadline: float | None = None,
    ) -> tuple[Any | None, str | None]:
        """(the reply message, None), or (None, error) once retries are exhausted or the next
        wait (backoff, Retry-After, the rate limiter) would end past `deadline` (time.monotonic)."""
        kwargs = self._request(messages, tools)
        estimate = estimate_tokens(messages, tools, self.max_tokens) if self._limiter is not None else 0
        last_error = "no attempt made"
        retry_after: float | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = self._backoff_s(attempt, retry_after)
                if deadline is not None and time.monotonic() + delay > deadline:
                    self.deadline_failures += 1
                    return None, (f"{last_error}; its retry (in {delay:.2f}s) would pass the turn's deadline "
                                  f"(turn_timeout_s={self.turn_timeout_s})")
                self.retries += 1
                log.warning("user simulator: attempt %d/%d failed (%s); retrying in %.2fs",
                            attempt, self.max_retries + 1, last_error, delay)
                await asyncio.sleep(delay)
            retry_after = None
            try:
                async with self._semaphore:
                    # Paced inside the slot: a request starts the moment the limiter lets it.
                    if self._limiter is not None and not await self._limiter.acquire(estimate, deadline):
                        self.deadline_failures += 1
                        return None, (f"the rate limit ({self._limiter}) would start the request past the turn's "
                                      f"deadline (turn_timeout_s={self.turn_timeout_s}); last error: {last_error}")
                    self.requests += 1
                    # The client's own timeout covers each socket operation; this one bounds
                    # the whole request, so a server that trickles bytes cannot hang a rollout.
                    async with asyncio.timeout(self.timeout_s):
                        response = await self._client.chat.completions.create(**kwargs)
            except (openai.APITimeoutError, TimeoutError):
                self.timeouts += 1
                last_error = f"timed out after {self.timeout_s:g}s"
                continue
            except openai.APIConnectionError as e:
                last_error = self._redact(f"connection error: {e}")
                continue
            except openai.APIStatusError as e:
                last_error = self._redact(f"HTTP {e.status_code}: {e.message}")
                self.throttled += e.status_code == 429
                if e.status_code in _RETRY_STATUS or e.status_code >= 500:
                    retry_after = _retry_after_s(e)
                    continue
                return None, last_error  # 4xx other than the above will not get better
            except openai.OpenAIError as e:
                return None, self._redact(f"{type(e).__name__}: {e}")
            self._settle(response, estimate)
            if not response.choices:
                last_error = "the endpoint returned no choices"
                continue
            return response.choices[0].message, None
        return None, f"gave up after {self.max_retries + 1} attempts: {last_error}"


class OpenAIUserSession(UserSession):
    """One simulated user: its role-flipped history and (dual control) its own tools."""

    def __init__(self, simulator: OpenAIUserSimulator, task: Task, env: EnvSession | None):
        self.simulator = simulator
        self.task = task
        self.env = env
        self.tools = list(env.user_tools()) if env is not None else []
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": simulator.system_prompt(task)},
            {"role": "assistant", "content": task.first_user_message},
        ]

    def __repr__(self) -> str:
        return f"OpenAIUserSession(task={self.task.task_id!r}, messages={len(self.messages)})"

    async def reply(self, agent_message: str) -> UserTurn:
        """The user's next message. `latency_s` covers the whole turn: retries, backoff and
        any rounds of the user's own tool calls; `turn_timeout_s` bounds it."""
        sim = self.simulator
        t0 = time.monotonic()
        rollback = len(self.messages)
        # The caller passes the agent's visible text only (see `UserSession.reply`).
        self.messages.append({"role": "user", "content": strip_control_tokens(str(agent_message))})
        if sim.turn_timeout_s is None:
            text, error = await self._turn(None)
        else:
            try:
                async with asyncio.timeout(sim.turn_timeout_s):
                    text, error = await self._turn(t0 + sim.turn_timeout_s)
            except TimeoutError:
                sim.deadline_failures += 1
                text, error = None, f"no reply within the turn's deadline (turn_timeout_s={sim.turn_timeout_s})"
        if error is not None:
            # A failed turn leaves the history as it was, so the caller may retry it.
            del self.messages[rollback:]
            sim.failures += 1
            log.error("user simulator for task %s failed: %s", self.task.task_id, error)
            return UserTurn("", latency_s=time.monotonic() - t0, failed=True, error=error)
        self.messages.append({"role": "assistant", "content": text})
        sim.turns += 1
        text = strip_control_tokens(text)
        return UserTurn(text, end=find_end_token(text), latency_s=time.monotonic() - t0)

    async def _turn(self, deadline: float | None) -> tuple[str | None, str | None]:
        """(the user's text, None) or (None, the error): requests, and rounds of the user's tools."""
        sim = self.simulator
        for step in range(sim.max_user_tool_steps + 1):
            message, error = await sim.complete(self.messages, self.tools, deadline=deadline)
            if error is None and message.tool_calls and self.tools and step == sim.max_user_tool_steps:
                error = f"the user made more than {sim.max_user_tool_steps} rounds of tool calls in one turn"
            if error is not None:
                return None, error
            if message.tool_calls and self.tools:
                self._run_tools(message, step)
                continue
            return message.content or "", None
        raise AssertionError("unreachable: the loop returns on its last step")

    def _run_tools(self, message: Any, step: int) -> None:
        calls = []
        for i, tc in enumerate(message.tool_calls):
            # Non-function ("custom") tool calls have no .function; they get an error result
            # from the env like any unknown tool instead of crashing the turn.
            fn = getattr(tc, "function", None)
            calls.append({
                "id": getattr(tc, "id", None) or f"user_call_{step}_{i}", "type": "function",
                "function": {"name": getattr(fn, "name", None) or "", "arguments": getattr(fn, "arguments", None) or "{}"},
            })
        self.messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        for call in calls:
            observation = self._execute(call["function"]["name"], call["function"]["arguments"])
            self.simulator.user_tool_calls += 1
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": observation.content})

    def _execute(self, name: str, raw_arguments: str) -> Observation:
        try:
            arguments = json.loads(raw_arguments) if raw_arguments.strip() else {}
        except ValueError as e:
            return Observation(f"Error: arguments of {name!r} are not valid JSON ({e})", error=True)
        if not isinstance(arguments, dict):
            return Observation(f"Error: arguments of {name!r} must be a JSON object", error=True)
        try:
            return self.env.user_step(ToolCall(name, arguments))
        except Exception as e:  # user_step must never raise, but one bad env must not kill a batch
            log.exception("user tool %r raised", name)
            return Observation(f"Error: {type(e).__name__}: {e}", error=True)
