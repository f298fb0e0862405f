"""The built-in domain's compact vocabulary covers every id its conversations use."""
from __future__ import annotations

import pytest

from muajax.agent.assistant_format import parse_assistant
from muajax.agent.chat import render_messages_ids
from muajax.domains.builtin import BuiltinEnvironment
from muajax.domains.builtin.expert import expert_conversation
from muajax.models.vocab import UNK_TEXT, DomainTokenizer, DomainVocab
from muajax.runtime.build import domain_ids


@pytest.fixture(scope="module")
def env():
    return BuiltinEnvironment(n_train_tasks=12, n_test_tasks=6, terse_tools=True)


@pytest.fixture(scope="module")
def tok(env, tokenizer):
    return DomainTokenizer(tokenizer, DomainVocab.from_texts(tokenizer, (), extra_ids=domain_ids(env, tokenizer)))


def test_expert_conversations_render_without_unknown_ids(env, tok):
    # The chat format's seams form ids no message text has on its own (`"}}\n`): a vocabulary
    # built from bare texts mapped them to UNK, so every tool call in the SFT data was broken.
    for task in env.tasks("train") + env.tasks("test"):
        session = env.reset(task)
        for careless in (0.0, 1.0):
            messages, _ = expert_conversation(env, task, careless=careless, seed=11)
            ids, mask = render_messages_ids(tok, env.policy_for(task), session.tools(), messages)
            assert tok.vocab.unk_id not in ids, task.task_id
            decoded = tok.decode(ids)
            assert UNK_TEXT not in decoded
            # each assistant tool call survives the compact round trip and parses back
            for m in messages:
                if m["role"] == "assistant" and m.get("tool_calls"):
                    call = m["tool_calls"][0]["function"]
                    assert f'"name": "{call["name"]}"' in decoded
        session.close()


def test_compact_round_trip_and_unknown_text(tok):
    base = tok.base
    text = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#o12"}}\n</tool_call>'
    compact = tok.encode(text)
    assert tok.decode(compact) == text
    assert tok.vocab.to_qwen(compact) == base.encode(text, add_special_tokens=False)
    parsed = parse_assistant(tok.decode(compact))
    assert parsed.tool_calls[0].name == "get_order"
    # a word the domain never uses maps to the single UNK id, decoded as U+FFFD
    unknown = tok.encode(" photosynthesis")
    assert tok.vocab.unk_id in unknown and UNK_TEXT in tok.decode(unknown)
    assert tok.vocab.padded_size(128) % 128 == 0 and tok.vocab.padded_size(128) >= len(tok)
