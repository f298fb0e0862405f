"""The OpenAI chat-completions wire format: request validation and response building.

Validation is strict where silently ignoring a field would change the answer (n > 1,
forced tool choice, logit bias, penalties, structured output: refused with a 400 that
names the field) and lenient about fields that do not (user, metadata, ...).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import time
import uuid
from typing import Any

from muajax.agent.assistant_format import ParsedAssistant, parse_assistant
from muajax.models.tokenizer import strip_control_tokens
from muajax.serving import json_depth

MAX_STOP_SEQUENCES = 4
# Every stop string is searched for in the whole generation after each decode chunk, and a
# streamed tail that may start one is held back: both cost grows with the string's length.
MAX_STOP_CHARS = 256
INT64 = (-(2**63), 2**63 - 1)  # OpenAI's range for `seed`
# A \u escape of a UTF-16 surrogate: only then can the parsed body hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask of this server; checked before it reaches the engine."""

    context: int  # tokens per request: prompt + completion
    vocab_size: int  # the model's output ids: `top_k`'s upper bound
    max_json_depth: int = 128  # nesting of the body, and of tool-call arguments given as JSON text


@dataclasses.dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int | None
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes, max_depth: int) -> Any:
    """The request body as Python values: strict JSON (no NaN/Infinity), at most
    `max_depth` levels deep (measured before parsing: the parser recurses per level),
    and no lone UTF-16 surrogate (it would break tokenization and every re-encoding)."""
    if json_depth.exceeds(raw, max_depth):
        raise bad(f"the request body nests deeper than {max_depth} levels", code="nesting_too_deep")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad(f"the request body is not valid JSON ({e})") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad("the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)") from None
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    # a float may be inf (JSON 1e400 parses to it) or NaN, which every comparison lets through
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number, got {value}", name)
    if value > hi or value < lo or (lo_open and value == lo):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}", name)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int, why: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be in [{lo}, {hi}]{why}, got {value}", name)
    return value


def _check_tool_call_arguments(m: dict[str, Any], i: int, max_depth: int) -> None:
    """Arguments sent as JSON text are parsed when the history is rendered: bound their depth too."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        return
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str) and json_depth.exceeds(args, max_depth):
            raise bad(f"messages[{i}].tool_calls[{j}].function.arguments nests deeper than {max_depth} levels",
                      f"messages[{i}].tool_calls[{j}].function.arguments", "nesting_too_deep")


def _check_messages(messages: Any, limits: Limits) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of message objects", "messages")
    if len(messages) > limits.context:  # each renders to a few tokens at least: no need to render them all
        raise bad(f"{len(messages)} messages cannot fit in this server's context of {limits.context} tokens",
                  "messages", "context_length_exceeded")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object, got {type(m).__name__}", f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r:.40}",
                      f"messages[{i}].role")
        if role == "developer":  # OpenAI's newer name for the system message
            m = dict(m, role="system")
        content = m.get("content")
        if content is None and role != "assistant":
            raise bad(f"messages[{i}] ({role}) needs 'content'", f"messages[{i}].content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        if role == "assistant" and content is None and not m.get("tool_calls"):
            raise bad(f"messages[{i}] (assistant) needs 'content' or 'tool_calls'", f"messages[{i}]")
        _check_tool_call_arguments(m, i, limits.max_json_depth)
        out.append(m)
    return out


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object",
                      f"tools[{i}].function.parameters")
    return tools or None


def _check_unsupported(body: dict[str, Any]) -> None:
    """Fields whose silent omission would change the answer."""
    if _int(body, "n", 1, INT64[1]) not in (None, 1):
        raise bad("only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(f"'{name}' is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad("'logprobs' is not supported", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("only response_format {'type': 'text'} is supported", "response_format")


def _check_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP_SEQUENCES
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} strings, each of 1 to "
                  f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def parse_request(body: Any, served_model: str, limits: Limits) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    if model != served_model:
        raise ApiError(404, f"model {model!r:.100} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    messages = _check_messages(body.get("messages"), limits)
    tools = _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice == "none":
        tools = None  # the model is not shown the tools, so it cannot call them
    elif choice not in (None, "auto"):
        raise bad("only tool_choice 'auto' and 'none' are supported (a call cannot be forced)", "tool_choice")
    _check_unsupported(body)
    context = " (this server's context: prompt + completion tokens)"
    max_tokens = _int(body, "max_completion_tokens", 1, limits.context, context)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limits.context, context)
    seed = _int(body, "seed", *INT64)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    # top_k is a vLLM extension: 0 (or vLLM's -1) = off; the engine holds it as int32
    top_k = _int(body, "top_k", -1, limits.vocab_size, " (the vocabulary size)") or 0
    return ChatRequest(
        model=model, messages=messages, tools=tools,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),
        max_tokens=max_tokens,
        # without a seed, sampling is not reproducible (as with OpenAI); the engine takes uint32
        seed=(seed if seed is not None else secrets.randbits(32)) & 0xFFFFFFFF,
        stop=_check_stop(body.get("stop")), stream=stream, include_usage=include_usage)


# ---------------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Output:
    """What the model said, in OpenAI terms."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def clean_text(text: str) -> str:
    # A sampled <|im_start|> or <|endoftext|> is not text; returned as-is it would make the
    # client's next request (which echoes it) unrenderable.
    return strip_control_tokens(text)


def build_output(text: str, engine_finish: str, stopped_by_string: bool = False, *, tools: bool = True) -> Output:
    """Parse the generation as the rollout loop does. A malformed tool call is returned as
    plain text (the client sees exactly what the model wrote); so is every tool call of a
    request that offered no tools (OpenAI never returns calls the client did not allow)."""
    text = clean_text(text)
    parsed: ParsedAssistant = parse_assistant(text)
    finish = "stop" if engine_finish == "stop" or stopped_by_string else "length"
    if not tools:
        return Output(text.strip(), [], finish)
    if parsed.error is None and parsed.tool_calls:
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                 for c in parsed.tool_calls]
        return Output(parsed.content or None, calls, "tool_calls")
    if parsed.error is not None:
        return Output(text.strip(), [], finish)
    return Output(parsed.content, [], finish)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, output: Output, prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": output.content}
    if output.tool_calls:
        message["tool_calls"] = output.tool_calls
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": output.finish_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(request_id: str, model: str, created: int, delta: dict[str, Any] | None,
               finish_reason: str | None = None, usage_counts: dict[str, int] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [] if delta is None else [
                                {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body


_HOLD_MARKERS = ("<tool_call>", "<think>")


def streamable_prefix(text: str) -> str:
    """The part of a growing generation that can be sent as content now and will not be
    taken back: everything before a tool call, nothing inside an open think block, no
    trailing partial marker, no trailing whitespace (the final content is stripped) and
    no half-decoded UTF-8 character (U+FFFD at the end)."""
    text = clean_text(text)
    if "<think>" in text:
        if "</think>" not in text:
            return ""
        text = text.rsplit("</think>", 1)[1]
    cut = text.find("<tool_call>")
    if cut >= 0:
        text = text[:cut]
    else:
        for marker in _HOLD_MARKERS:
            for n in range(len(marker) - 1, 0, -1):
                if text.endswith(marker[:n]):
                    text = text[:-n]
                    break
    text = text.rstrip("\ufffd").lstrip()
    return text.rstrip()
