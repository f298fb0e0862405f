"""Did the user explicitly confirm each write? Decided from the conversation alone.

The session sees tool calls but never the user's words, so confirmation is read from the
OpenAI-style messages: a write counts as confirmed iff the latest user message before it
is an explicit affirmative ("yes", "sure, go ahead", ...) with no hedge or counter-request
("yes, but...", "actually...", "instead"), and that affirmative has not already licensed
an earlier write (one yes, one write). This works for any user simulator, scripted or LLM.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

_AFFIRM = re.compile(
    r"^\W*(yes|yeah|yep|yup|sure|confirm|confirmed|i confirm|correct|go ahead|please do|proceed|do it)\b",
    re.IGNORECASE)
_HEDGE = re.compile(
    r"\b(no|not|don't|dont|do not|wait|instead|actually|but|hold on|prefer|rather|however|change my mind)\b",
    re.IGNORECASE)


def message_text(message: dict[str, Any]) -> str:
    """The plain text of a message whose content may be a string, None or a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def is_affirmative(text: str) -> bool:
    return isinstance(text, str) and bool(_AFFIRM.match(text)) and not _HEDGE.search(text)


def first_call_name(message: dict[str, Any]) -> str | None:
    """Name of the first tool call of an assistant message: the only one a rollout executes."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
        return None
    call = calls[0]
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    return name if isinstance(name, str) else None


def write_calls(messages: Sequence[dict[str, Any]], write_tools: Iterable[str]) -> list[tuple[bool, bool]]:
    """(confirmed, failed) per write call in `messages`, in order. `failed`: the tool message
    answering the call starts with "Error" (the call was rejected or never executed)."""
    writes = frozenset(write_tools)
    calls: list[list[bool]] = []
    licence = False
    awaiting_result = False
    for message in messages:
        role = message.get("role")
        if role == "user":
            licence = is_affirmative(message_text(message))
        elif role == "tool" and awaiting_result:
            calls[-1][1] = message_text(message).lstrip().startswith("Error")
        elif role == "assistant" and first_call_name(message) in writes:
            calls.append([licence, False])
            licence = False
        awaiting_result = role == "assistant" and first_call_name(message) in writes
    return [(confirmed, failed) for confirmed, failed in calls]


def write_confirmations(messages: Sequence[dict[str, Any]], write_tools: Iterable[str]) -> list[bool]:
    """One flag per write call in `messages` (in order): was it explicitly confirmed?"""
    return [confirmed for confirmed, _ in write_calls(messages, write_tools)]
