"""The built-in domain's warm-up windows: tool-call slices of other shops' expert conversations."""
import json

from muajax.domains.builtin import BuiltinEnvironment, is_affirmative
from muajax.domains.builtin.copy_windows import tool_call_windows, warmup_shop_seeds, warmup_windows


def test_windows_end_on_a_tool_call_and_open_on_a_user_turn():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Name?"},
        {"role": "user", "content": "Ann Ng, 12345"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "find_user", "arguments": "{}"}}]},
        {"role": "tool", "content": "{}"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_order", "arguments": "{}"}}]},
        {"role": "tool", "content": "{}"},
        {"role": "assistant", "content": "Done."},
    ]
    windows = tool_call_windows(messages, context_messages=1)
    # the opening request, then the recent part, reaching back past tool results to a user turn
    assert [[m["content"] for m in w] for w in windows] == [
        ["Hi", "Ann Ng, 12345", ""], ["Hi", "Ann Ng, 12345", "", "{}", ""]]
    assert windows[1][-1]["tool_calls"][0]["function"]["name"] == "get_order"
    wide = tool_call_windows(messages, context_messages=4)
    assert [len(w) for w in wide] == [4, 6]  # the whole conversation so far: no request repeated
    assert tool_call_windows(messages[1:], context_messages=4)[0][0]["content"] == "Ann Ng, 12345"
    assert tool_call_windows([messages[3]], context_messages=4) == []  # no user turn: no window


def test_warmup_comes_from_other_shops_deterministically_and_without_a_write_preference():
    assert 0 not in warmup_shop_seeds(0, 8) and 3 not in warmup_shop_seeds(3, 8)
    windows = warmup_windows(0, shops=2, tasks_per_shop=60)
    assert windows == warmup_windows(0, shops=2, tasks_per_shop=60)
    assert all(w[0]["role"] == "user" and w[-1]["role"] == "assistant" and w[-1]["tool_calls"] for w in windows)
    # none of the run's own customers (name and zip together) is in the warm-up
    own = BuiltinEnvironment(seed=0).fresh_db()["users"].values()
    text = json.dumps(windows)
    assert not any(f'\\"name\\": \\"{u["name"]}\\", \\"zip\\": \\"{u["zip"]}\\"' in text for u in own)
    assert '\\"zip\\": \\"' in text  # the check above looks at the form the calls really take
    # writes come both straight after the facts and after an explicit yes
    writes = [w for w in windows
              if w[-1]["tool_calls"][0]["function"]["name"] in ("modify_item", "cancel_order", "update_address")]
    after_yes = [w for w in writes if is_affirmative(w[-2]["content"] if w[-2]["role"] == "user" else "")]
    assert 0.25 < len(after_yes) / len(writes) < 0.75, (len(after_yes), len(writes))
