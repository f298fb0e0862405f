"""The Qwen3 chat format: equality with Qwen3's own template, masks, and a parser that never raises."""
from __future__ import annotations

import json
import os
import random
import re

import pytest

from muajax.agent import assistant_format as fmt
from muajax.agent import chat
from muajax.domains.base import ToolCall
from muajax.domains.general_tools import GENERAL_TOOL_SCHEMAS
from muajax.models.tokenizer import (
    IM_END_ID,
    IM_START_ID,
    bundled_tokenizer_dir,
    strip_control_tokens,
)

POLICY = "You are a retail agent. Politique: remboursement sous 30 jours — 日本語も可."
EXTRA_TOOL = {
    "type": "function",
    "function": {
        "name": "get_order_details",
        "description": "Look up an order by id (e.g. '#W123'). Ünïcode & <html> kept.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "The order id."}},
            "required": ["order_id"],
        },
    },
}
TOOLS = GENERAL_TOOL_SCHEMAS + [EXTRA_TOOL]


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer


@pytest.fixture(scope="module")
def template():
    # The bundled tokenizer_config.json carries Qwen3's official chat template; the
    # tokenizer object built from tokenizer.json does not, so it is passed explicitly.
    with open(os.path.join(bundled_tokenizer_dir(), "tokenizer_config.json"), encoding="utf-8") as f:
        tmpl = json.load(f).get("chat_template")
    assert tmpl and "<tool_call>" in tmpl and "enable_thinking" in tmpl, "expected Qwen3's chat template"
    return tmpl


def hf_ids(tok, template, messages, tools, gen_prompt):
    out = tok.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=gen_prompt,
        enable_thinking=False, tokenize=True,
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_text(tok, template, messages, tools):
    return tok.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=False,
        enable_thinking=False, tokenize=False,
    )


# ------------------------------------------------------------------ template equality


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_system_user_generation_prompt_equals_hf_template(tok, template, tools):
    user = "Hi, I'd like to return order #W2378156 — the lamp is broken."
    messages = [{"role": "system", "content": POLICY}, {"role": "user", "content": user}]
    ours = chat.system_prompt_ids(tok, POLICY, tools) + chat.user_turn_ids(tok, user) + chat.generation_prompt_ids(tok)
    assert ours == hf_ids(tok, template, messages, tools, gen_prompt=True)
    assert tok.decode(ours).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_system_prompt_layout(tok):
    text = tok.decode(chat.system_prompt_ids(tok, POLICY, TOOLS))
    assert text.startswith(f"<|im_start|>system\n{POLICY}\n\n# Tools\n")
    assert text.endswith("</tool_call><|im_end|>\n")
    lines = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in lines] == TOOLS  # one schema per line
    assert chat.system_prompt_ids(tok, None, None) == []


def test_final_assistant_turn_equals_hf_template(tok, template):
    # Qwen3's template writes the empty think block only on the last assistant turn, which
    # is exactly where the rollout's delta layout and a full render coincide.
    call = {"type": "function", "function": {"name": "get_order_details", "arguments": {"order_id": "#W1"}}}
    messages = [
        {"role": "user", "content": "Where is my order?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
    ]
    ids, _ = chat.render_messages_ids(tok, POLICY, TOOLS, messages)
    ref = hf_ids(tok, template, [{"role": "system", "content": POLICY}] + messages, TOOLS, gen_prompt=False)
    assert ids == ref


def test_multi_turn_equals_hf_text_with_think_blocks(tok, template):
    messages = [
        {"role": "user", "content": "Cancel order #W9 please."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_order_details", "arguments": '{"order_id": "#W9"}'}},
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2 + 2"}}},
        ]},
        {"role": "tool", "content": '{"status": "pending"}'},
        {"role": "tool", "content": "4.0"},
        {"role": "assistant", "content": "It is pending. Shall I cancel it? (yes/no)"},
        {"role": "user", "content": "yes ###STOP###"},
        {"role": "assistant", "content": "Done."},
    ]
    ids, mask = chat.render_messages_ids(tok, POLICY, TOOLS, messages)
    ref = hf_text(tok, template, [{"role": "system", "content": POLICY}] + messages, TOOLS)
    # The rollout keeps the empty think block the model saw on *every* assistant turn.
    head = "<|im_start|>assistant\n"
    ref = ref.replace(head + "<think>\n\n</think>\n\n", head).replace(head, head + "<think>\n\n</think>\n\n")
    assert tok.decode(ids) == ref
    assert ids == tok.encode(ref, add_special_tokens=False)  # deltas == one-shot tokenization
    assert ref.count("<|im_start|>user\n<tool_response>\n") == 1  # consecutive tools grouped
    assert len(mask) == len(ids)


# ------------------------------------------------------------------ deltas and masks


def test_deltas(tok):
    assert tok.decode(chat.user_turn_ids(tok, "héllo")) == "<|im_start|>user\nhéllo<|im_end|>\n"
    assert tok.decode(chat.tool_response_ids(tok, ["a", "b"])) == (
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>\n"
    )
    gp = chat.generation_prompt_ids(tok)
    assert gp[0] == IM_START_ID and tok.decode(gp) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert chat.after_assistant_ids(tok) == tok.encode("\n", add_special_tokens=False) == [198]
    gp.append(0)  # callers get fresh lists; the cached tuple must not change
    assert len(chat.generation_prompt_ids(tok)) == len(gp) - 1


def _expected_mask(tok, ids):
    """Independent oracle: 1 from just after each generation prompt through its <|im_end|>."""
    gp = chat.generation_prompt_ids(tok)
    mask, i, inside = [], 0, False
    while i < len(ids):
        if not inside and ids[i:i + len(gp)] == gp:
            mask += [0] * len(gp)
            i += len(gp)
            inside = True
            continue
        mask.append(1 if inside else 0)
        if inside and ids[i] == IM_END_ID:
            inside = False
        i += 1
    return mask


def test_mask_is_exactly_the_assistant_tokens(tok):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "order #W1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_order_details", "arguments": {"order_id": "#W1"}}}]},
        {"role": "tool", "content": "shipped"},
        {"role": "assistant", "content": "It shipped."},
    ]
    ids, mask = chat.render_messages_ids(tok, POLICY, TOOLS, messages)
    assert mask == _expected_mask(tok, ids)
    sys_len = len(chat.system_prompt_ids(tok, POLICY, TOOLS))
    assert not any(mask[:sys_len])
    # Masked spans decode to exactly the assistant texts plus their closing <|im_end|>.
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    assert [tok.decode(s) for s in spans] == [
        "Hello! How can I help?<|im_end|>",
        '<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n</tool_call><|im_end|>',
        "It shipped.<|im_end|>",
    ]
    # Every <|im_end|> that closes an assistant turn is masked, the newline after it is not.
    for k, t in enumerate(ids):
        if t == IM_END_ID and mask[k]:
            assert mask[k + 1] == 0 and ids[k + 1] == 198


def test_round_trip_render_decode_parse(tok):
    cases = [
        ("", [ToolCall("get_order_details", {"order_id": "#W1"})]),
        ("Je vérifie — un instant.", [ToolCall("calculate", {"expression": "(3 + 4) * 2"})]),
        ("multi", [ToolCall("think", {"thought": "ü \"quoted\" \\ back"}),
                   ToolCall("x", {"nested": {"a": [1, 2.5, None, True]}, "emoji": "🙂"})]),
    ]
    for content, calls in cases:
        wire = [{"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in calls]
        ids, mask = chat.render_messages_ids(tok, None, TOOLS, [
            {"role": "user", "content": "go"}, {"role": "assistant", "content": content, "tool_calls": wire}])
        sampled = [t for t, m in zip(ids, mask) if m]
        assert sampled[-1] == IM_END_ID
        parsed = fmt.parse_assistant(tok.decode(sampled[:-1]))
        assert parsed.error is None
        assert parsed.content == content
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in calls]
        assert tok.decode(sampled[:-1]) == fmt.assistant_text(content, calls)


def test_render_rejects_bad_input(tok):
    with pytest.raises(ValueError, match="unknown role"):
        chat.render_messages_ids(tok, None, None, [{"role": "bot", "content": "x"}])
    with pytest.raises(ValueError, match="both system_text"):
        chat.render_messages_ids(tok, "a", None, [{"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="only allowed first"):
        chat.render_messages_ids(tok, None, None, [{"role": "user", "content": "x"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="not valid JSON"):
        chat.render_messages_ids(tok, None, None, [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ValueError, match="not valid JSON"):
        chat.render_messages_ids(tok, None, None, [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"x": NaN}'}}]}])
    with pytest.raises(ValueError, match="not JSON compliant"):
        fmt.tool_call_text("f", {"x": float("inf")})
    with pytest.raises(TypeError, match="JSON object"):
        chat.render_messages_ids(tok, None, None, [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(ValueError, match="control token"):
        chat.user_turn_ids(tok, "bye<|im_end|>")
    with pytest.raises(ValueError, match="control token"):
        chat.tool_response_ids(tok, ["<|im_start|>system"])
    with pytest.raises(ValueError, match="non-empty list"):
        chat.tool_response_ids(tok, "not a list")
    assert strip_control_tokens("a<|im_end|>b<|endoftext|>") == "ab"
    ids, _ = chat.render_messages_ids(tok, None, None, [{"role": "system", "content": "S"}])
    assert tok.decode(ids) == "<|im_start|>system\nS<|im_end|>\n"


def test_format_tool_error():
    text = chat.format_tool_error("tool call is not valid JSON")
    assert text.startswith("Error: tool call is not valid JSON")
    assert "<tool_call>" in text and chat.format_tool_error("").startswith("Error: unknown error")


# ------------------------------------------------------------------ parser


@pytest.mark.parametrize("text,match", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'no "name"'),
    ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', 'no "name"'),
    ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', 'no "name"'),
    ('<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>', "string that is not a JSON object"),
    ('<tool_call>\n{"name": "f", "arguments": "[1]"}\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n["f", {}]\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n', "unclosed"),
    ('<tool_call><tool_call>{"name": "f"}</tool_call></tool_call>', "nested"),
    ('ok </tool_call>', "without a matching"),
    ('<tool_call>\n{"name": "f", "arguments": {}} {"name": "g"}\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "\\ud800"}}\n</tool_call>', "invalid unicode"),
    ("<tool_call>" + "[" * 30000 + "]" * 30000 + "</tool_call>", "nested too deeply|not valid JSON"),
    ('<tool_call>{"name": "f", "arguments": {"a": "' + "x" * (fmt.MAX_TOOL_CALL_CHARS + 10) + '"}}</tool_call>',
     "too large"),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": 5}</tool_call>',
     "tool call 2 of 2"),
])
def test_parser_errors(text, match):
    parsed = fmt.parse_assistant(text)
    assert parsed.error is not None and parsed.tool_calls == []
    assert parsed.wants_tool
    assert re.search(match, parsed.error), parsed.error


def test_parser_valid_forms():
    p = fmt.parse_assistant('<think>\nplan\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": '
                             '{"a": "é"}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}'
                             "</tool_call>")
    assert p.error is None and p.content == "Sure."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("f", {"a": "é"}), ("g", {"b": 2})]
    assert fmt.parse_assistant('<tool_call>{"name": "t"}</tool_call>').tool_calls == [ToolCall("t", {})]
    plain = fmt.parse_assistant("  Hello there.  ")
    assert plain == fmt.ParsedAssistant("Hello there.", [], None) and not plain.wants_tool
    assert fmt.parse_assistant("reasoning</think>answer").content == "answer"
    assert fmt.parse_assistant(None).error is not None
    assert fmt.visible_text('Hi <tool_call>{"name": "secret_tool"}</tool_call> there') == "Hi  there"


def _random_unicode(rng: random.Random, n: int) -> str:
    pools = [(0x20, 0x7E), (0xA0, 0x2FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F5FF), (0xD800, 0xDFFF), (0, 0x1F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-10**6, 10**6)
    if kind == 1:
        return _random_unicode(rng, rng.randint(0, 8))
    if kind == 2:
        return rng.choice([None, True, False, 1.5])
    if kind == 3:
        return "x" * rng.randint(0, 200)
    if kind == 4:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_random_unicode(rng, 3): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _random_output(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.25:
            pieces.append(_random_unicode(rng, rng.randint(0, 40)))
        elif r < 0.55:
            call = {"name": rng.choice(["f", "", 7, None, _random_unicode(rng, 4)]),
                    "arguments": _random_json(rng)}
            if rng.random() < 0.3:
                call["arguments"] = json.dumps(call["arguments"])
            if rng.random() < 0.2:
                del call[rng.choice(["name", "arguments"])]
            body = json.dumps(call, ensure_ascii=rng.random() < 0.5)
            if rng.random() < 0.4:  # corrupt it
                cut = rng.randrange(len(body) + 1)
                body = body[:cut] + rng.choice(["", "}", "{", '"', "\\", "<tool_call>", "NaN"]) + body[cut:]
            pieces.append(f"<tool_call>\n{body}\n</tool_call>")
        elif r < 0.75:
            pieces.append(rng.choice(["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>"]))
        elif r < 0.85:
            pieces.append("<tool_call>" + "{" * rng.randint(1, 5000) + "</tool_call>")
        elif r < 0.95:
            pieces.append('<tool_call>{"name": "f", "arguments": {"a": "' + "y" * rng.randint(1, 100_000) + '"}}'
                          + rng.choice(["</tool_call>", ""]))
        else:
            pieces.append(chr(rng.randint(0, 0x10FFFF)) * rng.randint(1, 50))
    return "".join(pieces)


def test_parser_fuzz_never_raises(tok):
    rng = random.Random(1234)
    outcomes = {"ok_calls": 0, "errors": 0, "plain": 0}
    for _ in range(1000):
        text = _random_output(rng)
        parsed = fmt.parse_assistant(text)
        assert isinstance(parsed, fmt.ParsedAssistant) and isinstance(parsed.content, str)
        if parsed.error is not None:
            assert parsed.tool_calls == [] and isinstance(parsed.error, str) and parsed.error
            # The error goes back to the agent as an observation: it must always tokenize.
            ids = chat.tool_response_ids(tok, [chat.format_tool_error(parsed.error)])
            assert ids.count(IM_END_ID) == 1
            outcomes["errors"] += 1
        elif parsed.tool_calls:
            for call in parsed.tool_calls:
                assert isinstance(call.name, str) and call.name
                assert isinstance(call.arguments, dict)
                json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")
            outcomes["ok_calls"] += 1
        else:
            assert "<tool_call>" not in parsed.content and "</tool_call>" not in parsed.content
            outcomes["plain"] += 1
    # The generator must actually exercise every branch, or the fuzz proves little.
    assert all(v > 10 for v in outcomes.values()), outcomes


def test_parser_fuzz_valid_calls_survive_noise():
    rng = random.Random(99)
    for _ in range(200):
        args = {"k": _random_json(rng), "s": "".join(c for c in _random_unicode(rng, 10) if not 0xD800 <= ord(c) <= 0xDFFF)}
        noise = "".join(c for c in _random_unicode(rng, 20) if not 0xD800 <= ord(c) <= 0xDFFF and c != "<")
        text = noise + "\n" + fmt.tool_call_text("lookup", args)
        parsed = fmt.parse_assistant(text)
        if any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(args, ensure_ascii=False)):
            continue
        assert parsed.error is None, parsed.error
        assert parsed.tool_calls == [ToolCall("lookup", args)]
        assert parsed.content == noise.strip()
