"""The Qwen3 chat format (non-thinking mode), token-in/token-out.

A rollout is built by appending token *deltas* to one growing sequence; nothing the model
sampled is ever re-tokenized. One conversation looks like::

    system_prompt_ids                      mask 0   <|im_start|>system ... <|im_end|>\\n
    user_turn_ids                          mask 0   <|im_start|>user\\n{text}<|im_end|>\\n
    generation_prompt_ids                  mask 0   <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n
    <sampled tokens> ... <|im_end|>        mask 1   (the agent's own tokens, incl. <|im_end|>)
    after_assistant_ids                    mask 0   \\n
    tool_response_ids                      mask 0   <|im_start|>user\\n<tool_response>...<|im_end|>\\n
    generation_prompt_ids                  mask 0   ...

The model stops sampling at `<|im_end|>`, but Qwen3's template always writes
`<|im_end|>\\n`; the `\\n` is therefore appended by the host as context (mask 0) before the
next turn (`after_assistant_ids`). Every delta starts or ends at a special token, which
the tokenizer never merges across, so concatenated deltas equal the tokenization of the
concatenated text.

A full re-render with Qwen3's own template is *not* what the model saw: the template drops
the empty think block from earlier assistant turns. `render_messages_ids` (for SFT) is
therefore built from the same deltas as the rollout.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from muajax.agent.assistant_format import assistant_text, reject_json_constant, strip_think
from muajax.domains.base import ToolCall
from muajax.models.tokenizer import CONTROL_TOKENS, strip_control_tokens

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)




def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _check_text(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    if "<|" in text:
        for token in CONTROL_TOKENS:
            if token in text:
                raise ValueError(
                    f"{what} contains the chat control token {token}; pass untrusted text through "
                    "muajax.agent.chat.strip_control_tokens first"
                )
    return text


# ---------------------------------------------------------------------------------------
# Prompt pieces and per-turn deltas
# ---------------------------------------------------------------------------------------


def system_prompt_text(system_text: str | None, tools: Sequence[dict[str, Any]] | None) -> str:
    """The system turn exactly as Qwen3's chat template renders it (incl. `<|im_end|>\\n`)."""
    if system_text is not None:
        _check_text(system_text, "system_text")
    if tools:
        parts = ["<|im_start|>system\n"]
        if system_text is not None:
            parts.append(system_text + "\n\n")
        parts.append(_TOOLS_HEADER)
        for tool in tools:
            if not isinstance(tool, dict):
                raise TypeError(f"each tool must be a JSON-schema dict, got {type(tool).__name__}")
            # Matches the template's `tool | tojson` (HF's override: ensure_ascii=False,
            # default separators, key order kept).
            parts.append("\n" + json.dumps(tool, ensure_ascii=False))
        _check_text("".join(parts[1:]), "tool schemas")
        parts.append(_TOOLS_FOOTER + "<|im_end|>\n")
        return "".join(parts)
    if system_text is None:
        return ""
    return f"<|im_start|>system\n{system_text}<|im_end|>\n"


def system_prompt_ids(tok, system_text: str | None, tools: Sequence[dict[str, Any]] | None) -> list[int]:
    """Token ids of the system turn (policy text + `# Tools` section), ending `<|im_end|>\\n`."""
    return _encode(tok, system_prompt_text(system_text, tools))


def user_turn_ids(tok, text: str) -> list[int]:
    """`<|im_start|>user\\n{text}<|im_end|>\\n`."""
    _check_text(text, "user text")
    return _encode(tok, f"<|im_start|>user\n{text}<|im_end|>\n")


def tool_response_text(contents: Sequence[str]) -> str:
    if isinstance(contents, str) or not contents:
        raise ValueError("tool_response_ids needs a non-empty list of strings (one per tool result)")
    parts = ["<|im_start|>user"]
    for content in contents:
        _check_text(content, "tool result")
        parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
    parts.append("<|im_end|>\n")
    return "".join(parts)


def tool_response_ids(tok, contents: Sequence[str]) -> list[int]:
    """One user turn holding consecutive tool results, grouped as Qwen3's template does."""
    return _encode(tok, tool_response_text(contents))


def im_end_id(tok) -> int:
    """`<|im_end|>` in this tokenizer's ids (a domain tokenizer renumbers ids)."""
    return int(tok.convert_tokens_to_ids("<|im_end|>"))


@functools.lru_cache(maxsize=16)
def _generation_prompt_cached(tok) -> tuple[int, ...]:
    return tuple(_encode(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n"))


def generation_prompt_ids(tok) -> list[int]:
    """`<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`: non-thinking mode's prompt (mask 0)."""
    return list(_generation_prompt_cached(tok))


@functools.lru_cache(maxsize=16)
def _after_assistant_cached(tok) -> tuple[int, ...]:
    return tuple(_encode(tok, "\n"))


def after_assistant_ids(tok) -> list[int]:
    """The `\\n` Qwen3's template writes after an assistant's `<|im_end|>`.

    Sampling stops at `<|im_end|>`, so this newline is never sampled: the host appends it
    as context (mask 0) before the next user/tool turn, which keeps the sequence identical
    to the template's rendering.
    """
    return list(_after_assistant_cached(tok))


def format_tool_error(message: str) -> str:
    """The observation text returned to the agent for a call that could not be executed."""
    # The message may quote model output (tool names), so it is made safe to tokenize.
    message = strip_control_tokens(str(message)).encode("utf-8", "replace").decode("utf-8").strip()
    message = message or "unknown error"
    return (
        f"Error: {message}\nA tool call must be exactly one JSON object with a string \"name\" and an "
        'object "arguments", inside <tool_call></tool_call> tags, e.g.\n'
        '<tool_call>\n{"name": "tool_name", "arguments": {"arg": "value"}}\n</tool_call>'
    )



# ---------------------------------------------------------------------------------------
# Whole conversations (SFT)
# ---------------------------------------------------------------------------------------


def _message_text(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"message {index}: only text content parts are supported, got {part!r:.80}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"message {index}: content must be a string, got {type(content).__name__}")


def _openai_tool_calls(message: dict[str, Any], index: int) -> list[ToolCall]:
    raw = message.get("tool_calls") or []
    if not isinstance(raw, list):
        raise TypeError(f"message {index}: tool_calls must be a list")
    calls = []
    for j, item in enumerate(raw):
        fn = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"message {index}, tool call {j}: needs function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args, parse_constant=reject_json_constant) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"message {index}, tool call {j}: arguments are not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise TypeError(f"message {index}, tool call {j}: arguments must be a JSON object")
        calls.append(ToolCall(fn["name"], args, item.get("id") if isinstance(item, dict) else None))
    return calls


def render_messages_ids(
    tok,
    system_text: str | None,
    tools: Sequence[dict[str, Any]] | None,
    messages: Sequence[dict[str, Any]],
) -> tuple[list[int], list[int]]:
    """(ids, assistant_mask) of an OpenAI-style conversation, from the rollout's own deltas.

    The mask is 1 exactly on what the agent produces: its content, its tool-call blocks and
    its closing `<|im_end|>`. A leading {"role": "system"} message may stand in for
    `system_text`. Assistant content is stripped and any think block dropped, the same
    normalisation `parse_assistant` applies, so a rendered call parses back to itself.
    """
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    messages = list(messages)
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        if system_text is not None:
            raise ValueError("got both system_text and a leading system message; pass one")
        system_text = _message_text(messages[0], 0)
        messages = messages[1:]
        offset = 1  # error messages count from the caller's list
    else:
        offset = 0
    ids = system_prompt_ids(tok, system_text, tools)
    mask = [0] * len(ids)

    def add(piece: list[int], m: int) -> None:
        ids.extend(piece)
        mask.extend([m] * len(piece))

    pending_tools: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"message {i + offset}: expected a dict, got {type(message).__name__}")
        role = message.get("role")
        if role == "tool":
            pending_tools.append(_message_text(message, i + offset))
            continue
        if pending_tools:
            add(tool_response_ids(tok, pending_tools), 0)
            pending_tools = []
        if role == "user":
            add(user_turn_ids(tok, _message_text(message, i + offset)), 0)
        elif role == "assistant":
            content = strip_think(_message_text(message, i + offset))
            text = assistant_text(content, _openai_tool_calls(message, i + offset))
            add(generation_prompt_ids(tok), 0)
            add(_encode(tok, _check_text(text, f"message {i + offset} (assistant)")) + [im_end_id(tok)], 1)
            add(after_assistant_ids(tok), 0)
        elif role == "system":
            raise ValueError(f"message {i + offset}: a system message is only allowed first")
        else:
            raise ValueError(f"message {i + offset}: unknown role {role!r} (user, assistant, tool)")
    if pending_tools:
        add(tool_response_ids(tok, pending_tools), 0)
    return ids, mask



