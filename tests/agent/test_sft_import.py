"""Conversations in the OpenAI messages-with-tools format → muajax SFT records, trained with the
rollout's loss mask (assistant tokens and their <|im_end|> only); bad lines name their line."""
from __future__ import annotations

import json

import pytest

from muajax import synth
from muajax.agent.chat import (after_assistant_ids, generation_prompt_ids, system_prompt_ids, tool_response_ids,
                               user_turn_ids)
from muajax.agent.sft_import import SftImportError, import_conversations
from muajax.models.tokenizer import IM_END_ID
from muajax.train.sft import read_examples

TOOLS = [{"type": "function", "function": {"name": "get_order", "description": "Look an order up.",
                                           "parameters": {"type": "object", "properties": {"order_id": {
                                               "type": "string"}}, "required": ["order_id"]}}}]
CONVERSATION = {
    "id": "mua-1",
    "tools": json.dumps(TOOLS),  # as datasets often store it
    "messages": [
        {"role": "system", "content": "You are a shop assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "order #1?"}]},
        {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nLet me check.", "reasoning_content": "x",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_order", "arguments": {"order_id": "#1"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
        {"role": "assistant", "content": "Order #1 has shipped.", "tool_calls": []},
        {"role": "user", "content": "Thanks!"},
    ],
}


def write_lines(path, *lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_imported_conversations_train_with_the_rollout_s_mask(tmp_path, tokenizer):
    tok = tokenizer
    src = write_lines(tmp_path / "released.jsonl", CONVERSATION, "", {**CONVERSATION, "id": None})
    summary = import_conversations(src, str(tmp_path / "sft.jsonl"), tok)
    assert summary["imported"] == 2
    first, second = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert first["task_id"] == "mua-1" and second["task_id"] == f"{src}:3" and first["tools"] == TOOLS
    assert first["system"] == "You are a shop assistant." and first["messages"][0]["role"] == "user"
    assert "reasoning_content" not in json.dumps(first["messages"]) and "<think>" not in json.dumps(first)
    assert first["messages"][1]["content"] == "Let me check."

    # the token stream a rollout of this conversation would have: the same deltas, sampled parts masked 1
    call = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#1"}}\n</tool_call>'
    pieces = [(system_prompt_ids(tok, "You are a shop assistant.", TOOLS), 0),
              (user_turn_ids(tok, "Where is order #1?"), 0), (generation_prompt_ids(tok), 0),
              (tok.encode(f"Let me check.\n{call}", add_special_tokens=False) + [IM_END_ID], 1),
              (after_assistant_ids(tok), 0), (tool_response_ids(tok, ['{"status": "shipped"}']), 0),
              (generation_prompt_ids(tok), 0),
              (tok.encode("Order #1 has shipped.", add_special_tokens=False) + [IM_END_ID], 1),
              (after_assistant_ids(tok), 0), (user_turn_ids(tok, "Thanks!"), 0)]
    want_ids = [i for ids, _ in pieces for i in ids]
    want_mask = [m for ids, m in pieces for _ in ids]
    (ids, mask), again = read_examples(str(tmp_path / "sft.jsonl"), tok, 10**6)
    assert ids == want_ids and mask == want_mask
    assert again == (ids, mask)
    assert summary["assistant_tokens"] == 2 * sum(mask) and summary["tokens"] == 2 * len(ids)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "critic", "content": "hi"}]}, "messages[0]: role must be one of"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
     "messages[1]: a tool result must follow an assistant message with tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0]: arguments of 'f' are not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]},
     "a system message is only allowed first"),
    ({"messages": [{"role": "assistant", "content": "ok"}], "tools": "[{"}, "'tools' is a string but not JSON"),
    ({"messages": [{"role": "assistant", "content": "ok"}], "tools": [{"parameters": {}}]}, "tools[0] needs a name"),
    ({"messages": [{"role": "assistant", "content": "fake <|im_end|> turn"}]}, "chat control token <|im_end|>"),
])
def test_a_bad_line_stops_the_import_naming_it(tmp_path, line, message, tokenizer):
    src = write_lines(tmp_path / "in.jsonl", CONVERSATION, line)
    with pytest.raises(SftImportError) as info:
        import_conversations(src, str(tmp_path / "out.jsonl"), tokenizer)
    assert str(info.value).startswith(f"{src}:2: ") and message in str(info.value), str(info.value)
    assert not (tmp_path / "out.jsonl").exists()  # nothing written


def test_the_import_command(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", CONVERSATION)
    assert synth.main(["--import", src, "--out", str(tmp_path / "sft.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["imported"] == 1
    bad = write_lines(tmp_path / "bad.jsonl", CONVERSATION, CONVERSATION, {"messages": "x"})
    assert synth.main(["--import", bad, "--out", str(tmp_path / "x.jsonl")]) == 2
    assert f"muajax.synth: error: {bad}:3: 'messages' must be a non-empty list" in capsys.readouterr().err
