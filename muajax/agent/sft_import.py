"""Conversations in the OpenAI messages-with-tools format (the format of MUA-RL's released
cold-start set, and of most tool-use SFT sets) as muajax SFT records
(`python -m muajax.synth --import FILE.jsonl --out sft.jsonl`).

One JSON object per line::

    {"messages": [{"role": "system", "content": "..."},            # optional, first only
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...",
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "f", "arguments": "{...}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "..."}, ...],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {...}}}, ...],
     "id": "optional"}

`tools` may also be a JSON string (as datasets often store it) or bare function schemas;
`system` may be a top-level field instead of a first message; content may be a string,
null or a list of text parts; tool-call arguments may be a JSON string or an object.
Assistant reasoning (`reasoning_content`, think blocks) is dropped: muajax trains Qwen3's
non-thinking format. The SFT stage renders a record with the rollout's own token deltas
(`muajax.agent.chat.render_messages_ids`), so its loss mask is the rollout's: 1 on the
assistant's tokens and closing `<|im_end|>`, 0 on everything else. Every record is
rendered here too, so a line the SFT stage would refuse is refused now, naming its line.
"""
from __future__ import annotations

import json
import os
from typing import Any

from muajax.agent.assistant_format import strip_think
from muajax.agent.chat import render_messages_ids

ROLES = ("system", "user", "assistant", "tool")


class SftImportError(ValueError):
    """A line that is not a conversation muajax can train on; the message names the line."""


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise SftImportError(f"{where}: only text content parts are supported, got {str(part)[:80]}")
            parts.append(part["text"])
        return "".join(parts)
    raise SftImportError(f"{where}: content must be a string, a list of text parts or null, "
                       f"got {type(content).__name__}")


def _tool_call(item: Any, where: str) -> dict[str, Any]:
    fn = item.get("function", item) if isinstance(item, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise SftImportError(f"{where}: a tool call needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise SftImportError(f"{where}: arguments of {fn['name']!r} are not valid JSON ({exc})") from None
    if not isinstance(args, dict):
        raise SftImportError(f"{where}: arguments of {fn['name']!r} must be a JSON object")
    call = {"type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
    if isinstance(item.get("id"), str):
        call = {"id": item["id"], **call}
    return call


def _messages(raw: Any, where: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the leading system message's text or None, the other messages normalised)."""
    if not isinstance(raw, list) or not raw:
        raise SftImportError(f"{where}: 'messages' must be a non-empty list")
    system, out, after_call = None, [], False
    for i, message in enumerate(raw):
        at = f"{where}: messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise SftImportError(f"{at}: role must be one of {', '.join(ROLES)}, got {role!r}")
        text = _text(message.get("content"), at)
        if role == "system":
            if i:
                raise SftImportError(f"{at}: a system message is only allowed first")
            system = text
        elif role == "tool":
            if not after_call:
                raise SftImportError(f"{at}: a tool result must follow an assistant message with tool_calls")
            out.append({"role": "tool", "content": text, **({"tool_call_id": message["tool_call_id"]}
                                                              if isinstance(message.get("tool_call_id"), str) else {})})
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise SftImportError(f"{at}: tool_calls must be a list")
            out.append({"role": "assistant", "content": strip_think(text).strip(),
                        **({"tool_calls": [_tool_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(calls)]}
                           if calls else {})})
        else:
            out.append({"role": "user", "content": text})
        after_call = role == "tool" or (role == "assistant" and "tool_calls" in out[-1])
    if not any(m["role"] == "assistant" for m in out):
        raise SftImportError(f"{where}: no assistant message: nothing to train on")
    return system, out


def _tools(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SftImportError(f"{where}: 'tools' is a string but not JSON ({exc})") from None
    if not isinstance(raw, list):
        raise SftImportError(f"{where}: 'tools' must be a list of function schemas")
    tools = []
    for i, tool in enumerate(raw):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise SftImportError(f"{where}: tools[{i}] needs a name (an OpenAI function schema)")
        tools.append(tool if "function" in tool else {"type": "function", "function": fn})
    return tools


def convert(obj: Any, where: str) -> dict[str, Any]:
    """One line's object as a muajax SFT record (`system`, `tools`, `messages`, `task_id`)."""
    if not isinstance(obj, dict):
        raise SftImportError(f"{where}: expected a JSON object with 'messages'")
    system, messages = _messages(obj.get("messages"), where)
    top = obj.get("system")
    if top is not None and system is not None:
        raise SftImportError(f"{where}: both a top-level 'system' and a system message; give one")
    if top is not None and not isinstance(top, str):
        raise SftImportError(f"{where}: 'system' must be a string")
    record_id = obj.get("id", obj.get("task_id"))
    return {"task_id": str(record_id) if record_id is not None else where,
            "system": top if top is not None else system, "tools": _tools(obj.get("tools"), where),
            "messages": messages, "source": where}


def import_conversations(path: str, out: str, tokenizer) -> dict[str, Any]:
    """Convert every line of `path` and write the records to `out`; any bad line stops the
    import (nothing written) with an `SftImportError` naming `path:line`."""
    records, tokens, trained = [], 0, 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SftImportError(f"{where}: not valid JSON ({exc})") from None
            record = convert(obj, where)
            try:
                ids, mask = render_messages_ids(tokenizer, record["system"], record["tools"], record["messages"])
            except (TypeError, ValueError) as exc:
                raise SftImportError(f"{where}: {exc}") from None
            records.append(record)
            tokens, trained = tokens + len(ids), trained + sum(mask)
    if not records:
        raise SftImportError(f"{path}: no conversations")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, out)
    return {"imported": len(records), "tokens": tokens, "assistant_tokens": trained, "out": os.path.abspath(out)}
