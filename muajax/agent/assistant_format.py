"""The assistant's text in Qwen3's format: rendered from content and tool calls (for SFT)
and parsed back (for rollouts). The two must agree: a rendered call parses to itself.

A tool call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; reasoning
sits in `<think>...</think>` and is never shown to the user.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Any

from muajax.domains.base import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# A single call body beyond this is a runaway generation, not a tool call; refusing it
# keeps json.loads (and the environment) away from pathological payloads.
MAX_TOOL_CALL_CHARS = 65_536

_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE), re.DOTALL)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One `<tool_call>` block in the exact format the model samples and the parser reads."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call name must be a non-empty string, got {name!r}")
    if not isinstance(arguments, dict):
        raise TypeError(f"tool call arguments must be a dict, got {type(arguments).__name__}")
    # allow_nan=False: NaN/Infinity are not JSON, and the parser would reject them.
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, allow_nan=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def assistant_text(content: str | None, tool_calls: Iterable[ToolCall] = ()) -> str:
    """The assistant's text up to (not incl.) `<|im_end|>`, laid out as Qwen3's template does:
    content, then each call block on its own line."""
    text = (content or "").strip()
    for call in tool_calls:
        block = tool_call_text(call.name, call.arguments)
        text = f"{text}\n{block}" if text else block
    return text


def strip_think(text: str) -> str:
    text = _THINK_BLOCK.sub("", text)
    # A lone closing tag means everything before it was reasoning (the template's own rule);
    # a lone opening tag is a truncated thought we cannot delimit, so only the tag goes.
    if THINK_CLOSE in text:
        text = text.rsplit(THINK_CLOSE, 1)[1]
    return text.replace(THINK_OPEN, "")


def _short(name: str) -> str:
    return repr(name[:60] + ("..." if len(name) > 60 else ""))


def reject_json_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _decode_call(body: str) -> tuple[ToolCall | None, str | None]:
    if len(body) > MAX_TOOL_CALL_CHARS:
        return None, f"tool call is too large ({len(body)} characters; the limit is {MAX_TOOL_CALL_CHARS})"
    try:
        obj = json.loads(body, parse_constant=reject_json_constant)
    except RecursionError:
        return None, "tool call JSON is nested too deeply"
    except ValueError as e:
        return None, f"tool call is not valid JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, 'tool call has no "name" string'
    args = obj.get("arguments", {})
    if args is None:
        args = {}
    if isinstance(args, str):
        # Some models emit OpenAI's wire form (arguments as a JSON string); accept it when
        # it holds an object, since the intent is unambiguous.
        try:
            args = json.loads(args, parse_constant=reject_json_constant)
        except (ValueError, RecursionError):
            return None, f'tool call {_short(name)}: "arguments" is a string that is not a JSON object'
    if not isinstance(args, dict):
        return None, f'tool call {_short(name)}: "arguments" must be a JSON object, got {type(args).__name__}'
    try:
        # Lone surrogates survive json.loads but not UTF-8 encoding further down the line.
        json.dumps(args, ensure_ascii=False).encode("utf-8")
        name.encode("utf-8")
    except (UnicodeEncodeError, ValueError, RecursionError):
        return None, f"tool call {_short(name)}: arguments contain invalid unicode"
    return ToolCall(name=name.strip(), arguments=args), None


@dataclasses.dataclass(frozen=True)
class ParsedAssistant:
    """An assistant message split into its text and tool calls.

    When `error` is set, `tool_calls` is empty: a message with any malformed call is never
    partially executed; the rollout answers it with `format_tool_error(error)`.
    `content` is always the text outside the tool-call tags (best effort when malformed).
    """

    content: str
    tool_calls: list[ToolCall]
    error: str | None = None

    @property
    def wants_tool(self) -> bool:
        """True when the message goes to the environment (a call, or a failed attempt at one)."""
        return bool(self.tool_calls) or self.error is not None


def parse_assistant(text: str) -> ParsedAssistant:
    """Parse Qwen3/Hermes `<tool_call>` blocks out of an assistant message. Never raises."""
    if not isinstance(text, str):
        return ParsedAssistant("", [], f"assistant output must be text, got {type(text).__name__}")
    text = strip_think(text)
    outside: list[str] = []
    bodies: list[str] = []
    error: str | None = None
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        stray_close = text.find(TOOL_CALL_CLOSE, pos)
        if start < 0:
            outside.append(text[pos:])
            if stray_close >= 0 and error is None:
                error = f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"
            break
        outside.append(text[pos:start])
        if 0 <= stray_close < start and error is None:
            error = f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        nested = text.find(TOOL_CALL_OPEN, body_start)
        if end < 0:
            if error is None:
                error = f"unclosed {TOOL_CALL_OPEN} (missing {TOOL_CALL_CLOSE})"
            break
        if 0 <= nested < end:
            if error is None:
                error = f"nested {TOOL_CALL_OPEN} tags"
            # Skip past the outermost close so the rest of the text is still scanned.
            pos = end + len(TOOL_CALL_CLOSE)
            continue
        bodies.append(text[body_start:end])
        pos = end + len(TOOL_CALL_CLOSE)
    content = "".join(outside).strip()
    if error is not None:
        return ParsedAssistant(content, [], error)
    calls: list[ToolCall] = []
    for i, body in enumerate(bodies):
        call, err = _decode_call(body.strip())
        if err is not None:
            where = f"tool call {i + 1} of {len(bodies)}: " if len(bodies) > 1 else ""
            return ParsedAssistant(content, [], where + err)
        calls.append(call)
    return ParsedAssistant(content, calls, None)


def visible_text(agent_message: str) -> str:
    """What a user may see of an agent message: no reasoning and no tool-call markup."""
    return parse_assistant(agent_message).content

