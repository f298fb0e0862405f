"""`rollout.end_on_malformed_call`: the released code ends the episode at a tool call it cannot
parse (or that breaks the tool's schema), unexecuted; off (the default), the agent gets an
error observation and the episode goes on."""
from muajax.agent.calls import tool_schemas
from muajax.agent.conversation import Conversation
from muajax.agent.trajectory import MALFORMED_CALL
from muajax.config.schema import load_config
from muajax.domains.builtin import BuiltinEnvironment
from muajax.models.tokenizer import IM_END_ID, load_tokenizer

UNPARSEABLE = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": \n</tool_call>'
BAD_SCHEMA = '<tool_call>\n{"name": "cancel_order", "arguments": {"order": "#1"}}\n</tool_call>'


def generate(strict: bool, text: str):
    options = load_config(None, [f"rollout.end_on_malformed_call={str(strict).lower()}"]).rollout
    env = BuiltinEnvironment()
    task = env.tasks("train")[0]
    session = env.reset(task)
    conv = Conversation(load_tokenizer(), options, task, group_id=0, rollout_index=0, seed=0, session=session,
                        user_session=None, system_ids=[1, 2], schemas=tool_schemas(session), max_context=10**6)
    ids = load_tokenizer().encode(text, add_special_tokens=False) + [IM_END_ID]
    return conv, conv.on_generation(ids, [-1.0] * len(ids), "stop")


def test_a_malformed_call_ends_the_episode_unexecuted_when_strict():
    for text in (UNPARSEABLE, BAD_SCHEMA):
        conv, route = generate(True, text)
        assert route.kind == "end" and conv.done and conv.record.termination == MALFORMED_CALL, text
        assert conv.record.malformed_calls == 1 and not conv.record.tool_calls
        assert conv.record.messages[-1]["role"] == "assistant" and "tool_calls" not in conv.record.messages[-1]
        assert conv.record.loss_mask[-1] == 1  # the agent's own tokens stay in the loss


def test_a_malformed_call_gets_an_error_observation_by_default():
    conv, route = generate(False, UNPARSEABLE)
    assert route.kind == "tool" and route.call is None and route.error_observation.startswith("Error:")
    assert not conv.done and conv.record.malformed_calls == 1
    conv, route = generate(False, BAD_SCHEMA)  # runs through the environment, whose error the agent sees
    assert route.kind == "tool" and route.call is not None and not conv.done
