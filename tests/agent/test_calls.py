"""Routing an assistant message: what reaches the user is its visible text, never the
agent's reasoning or tool-call markup."""
from muajax.agent.calls import END, TOOL, USER, route_assistant

SCHEMAS = {"get_order_details": {"name": "get_order_details", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}


def test_reasoning_never_reaches_the_user():
    route = route_assistant("<think>SECRET-REASONING</think>Which order do you mean?", "stop", SCHEMAS)
    assert route.kind == USER and route.user_text == "Which order do you mean?"
    assert "SECRET" not in str(route.message)


def test_a_tool_call_goes_to_the_environment_and_nothing_to_the_user():
    text = ('<think>SECRET</think>Let me look that up.\n<tool_call>\n'
            '{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n</tool_call>')
    route = route_assistant(text, "stop", SCHEMAS)
    assert route.kind == TOOL and route.user_text is None
    assert route.call.name == "get_order_details" and route.call.arguments == {"order_id": "#W1"}
    assert route.message["content"] == "Let me look that up." and route.malformed is None


def test_a_turn_cut_by_the_context_ends_the_episode():
    route = route_assistant("Let me", "context", SCHEMAS)
    assert route.kind == END and route.termination == "context"
