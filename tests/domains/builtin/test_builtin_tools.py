"""The built-in shop domain's tools (schemas, errors, authentication, ids) and its
confirmation rule (one yes licenses one write)."""
from __future__ import annotations

import pytest

from muajax.domains.base import ToolCall, confirm_before_write_rate
from muajax.domains.builtin import WRITE_TOOLS, BuiltinEnvironment, is_affirmative, write_confirmations
from muajax.domains.builtin.database import db_hash
from muajax.domains.general_tools import GENERAL_TOOL_NAMES
from tests.domains.builtin.builtin_support import first_of, tool_msg


@pytest.fixture(scope="module")
def env() -> BuiltinEnvironment:
    return BuiltinEnvironment()


# -- tools ----------------------------------------------------------------------------------

def test_tools_are_openai_schemas_including_the_general_tools(env):
    session = env.reset(env.tasks("train")[0])
    tools = session.tools()
    names = [t["function"]["name"] for t in tools]
    assert set(names) == {"find_user", "get_order", "list_variants", *WRITE_TOOLS, *GENERAL_TOOL_NAMES}
    for tool in tools:
        assert tool["type"] == "function"
        params = tool["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) == set(params["properties"])
    tools[0]["function"]["name"] = "mutated"
    assert session.tools()[0]["function"]["name"] != "mutated"
    assert "yes" in env.policy() and "find_user" in env.policy()


def test_general_tools_work_inside_the_session(env):
    session = env.reset(env.tasks("train")[0])
    assert session.step(ToolCall("think", {"thought": "hmm"})).content == ""
    assert session.step(ToolCall("calculate", {"expression": "2 * (3 + 4)"})).content == "14.0"
    assert session.step(ToolCall("calculate", {"expression": 7})).error
    obs = session.step(ToolCall("transfer_to_human_agents", {"summary": "wants a human"}))
    assert obs.done and session.transferred


def _authed(env, task):
    session = env.reset(task)
    assert not session.step(task.gold_actions[0]).error
    return session


def test_bad_calls_give_error_observations(env):
    task = first_of(env, "modify")
    order_id = task.metadata["order_id"]
    session = _authed(env, task)
    other_user_order = next(k for k, v in session.db["orders"].items() if v["user_id"] != task.metadata["user_id"])
    huge = "x" * 100_000
    cases = [
        (ToolCall("drop_table", {}), "unknown tool"),
        (ToolCall(None, {}), "unknown tool"),  # type: ignore[arg-type]
        (ToolCall("get_order", ["#o1"]), "JSON object"),  # type: ignore[arg-type]
        (ToolCall("get_order", {}), "missing argument 'order_id'"),
        (ToolCall("get_order", {"order_id": order_id, "verbose": "1"}), "unexpected argument 'verbose'"),
        (ToolCall("find_user", {"name": "Ann", "zip": 12345}), "must be a string"),
        (ToolCall("find_user", {"name": huge, "zip": "1"}), "too long"),
        (ToolCall("find_user", {"name": "Nobody Here", "zip": "00000"}), "no user named"),
        (ToolCall("get_order", {"order_id": "#o9999"}), "not found"),
        (ToolCall("get_order", {"order_id": other_user_order}), "does not belong"),
        (ToolCall("list_variants", {"product": "spaceship"}), "not found"),
        (ToolCall("modify_item", {"order_id": order_id, "item_id": "v00", "new_item_id": "v01"}), "not in order"),
        (ToolCall("modify_item", {"order_id": order_id, "item_id": task.metadata["item_id"],
                                  "new_item_id": "v00"}), "not a variant"),
        (ToolCall("update_address", {"user_id": "u99", "address": "1 Oak St"}), "not the authenticated user"),
        (ToolCall("cancel_order", {"order_id": ""}), "empty"),
        ("not a call", "expected a tool call"),
    ]
    for call, expected in cases:
        obs = session.step(call)  # type: ignore[arg-type]
        assert obs.error and not obs.done and obs.content.startswith("Error: "), call
        assert expected in obs.content, (expected, obs.content)
        assert len(obs.content) < 400  # huge arguments are never echoed back
    assert db_hash(session.db) == db_hash(env.fresh_db())  # no bad call changed anything
    failed = [w for w in session.writes if not w.ok]
    assert failed and all(w.error for w in failed)


def test_only_pending_orders_can_be_written(env):
    db = env.fresh_db()
    closed = [(k, v) for k, v in db["orders"].items() if v["status"] != "pending"]
    assert closed
    order_id, order = closed[0]
    user = db["users"][order["user_id"]]
    session = env.reset(env.tasks("train")[0])
    assert not session.step(ToolCall("find_user", {"name": user["name"].upper(), "zip": user["zip"]})).error
    for call in (ToolCall("cancel_order", {"order_id": order_id}),
                 ToolCall("modify_item", {"order_id": order_id, "item_id": order["items"][0]["item_id"],
                                          "new_item_id": "v00"})):
        obs = session.step(call)
        assert obs.error and "only pending orders" in obs.content, obs.content


def test_writes_and_reads_need_authentication(env):
    task = first_of(env, "cancel")
    session = env.reset(task)
    for call in (ToolCall("get_order", {"order_id": task.metadata["order_id"]}),
                 ToolCall("cancel_order", {"order_id": task.metadata["order_id"]})):
        obs = session.step(call)
        assert obs.error and "authenticate the user first" in obs.content
    assert not session.step(ToolCall("list_variants", {"product": "mug"})).error  # the catalog is public


def test_ids_are_canonicalised(env):
    task = first_of(env, "cancel")
    session = _authed(env, task)
    bare = task.metadata["order_id"].lstrip("#").upper()
    assert not session.step(ToolCall("cancel_order", {"order_id": bare})).error
    assert session.evaluate([], communicate_info=False).reward == 1.0


# -- confirmation ---------------------------------------------------------------------------

def test_affirmative_detection():
    for text in ("Yes.", "yes", "Yes, please go ahead.", "Sure, do it.", "Confirmed."):
        assert is_affirmative(text), text
    for text in ("No.", "Hmm, I prefer red L instead.", "Yes, but make it blue.", "I am Ann Ng, zip 12345.",
                 "Actually yes", "Wait, yes", ""):
        assert not is_affirmative(text), text


def test_one_yes_licenses_one_write():
    msgs = [{"role": "user", "content": "Cancel #o1"}, tool_msg("cancel_order", {}),
            {"role": "tool", "content": "{}"},
            {"role": "assistant", "content": "Confirm? Reply yes."}, {"role": "user", "content": "Yes."},
            tool_msg("get_order", {}), {"role": "tool", "content": "{}"},
            tool_msg("modify_item", {}), tool_msg("update_address", {})]
    assert write_confirmations(msgs, WRITE_TOOLS) == [False, True, False]
    assert confirm_before_write_rate([[True], [True, False], [], [True, True]]) == pytest.approx(2 / 3)
    assert confirm_before_write_rate([[], []]) is None


def test_confirmations_align_with_the_writes_the_session_saw(env):
    task = first_of(env, "cancel")
    session = _authed(env, task)
    cancel = {"order_id": task.metadata["order_id"]}
    assert not session.step(ToolCall("cancel_order", cancel)).error
    unparsed = [tool_msg("cancel_order", {}), {"role": "tool", "content": "Error: could not parse the tool call"}]
    confirmed = [{"role": "assistant", "content": "Cancel it? Reply yes to confirm."},
                 {"role": "user", "content": "Yes."}, tool_msg("cancel_order", cancel),
                 {"role": "tool", "content": "{}"}]
    msgs = [{"role": "user", "content": task.first_user_message}] + unparsed + confirmed
    ev = session.evaluate(msgs, communicate_info=False)
    assert ev.details["writes_confirmed"] == [True] and session.all_writes_confirmed() is True
    # Messages that cannot be matched to the session's writes leave the flags unknown, not guessed.
    ev = session.evaluate(msgs[:1], communicate_info=False)
    assert ev.details["writes_confirmed"] is None and session.all_writes_confirmed() is None
    assert confirm_before_write_rate([None, [True], [False]]) == 0.5


def test_write_before_confirmation_on_change_of_mind_task_scores_zero(env):
    task = first_of(env, "modify_mind")
    meta = task.metadata
    session = env.reset(task)
    msgs = [{"role": "user", "content": task.first_user_message},
            {"role": "assistant", "content": "Your name and zip code?"},
            {"role": "user", "content": f"I am {meta['name']}, zip {meta['zip']}."}]
    for call in task.gold_actions[:-1]:
        assert not session.step(call).error
        msgs += [tool_msg(call.name, call.arguments), {"role": "tool", "content": "..."}]
    hasty = {"order_id": meta["order_id"], "item_id": meta["item_id"], "new_item_id": meta["want"]["item_id"]}
    assert not session.step(ToolCall("modify_item", hasty)).error
    msgs += [tool_msg("modify_item", hasty), {"role": "tool", "content": "..."},
             {"role": "assistant", "content": "Done."}, {"role": "user", "content": "I prefer the other one."}]
    # The order is now modified and cannot be fixed: the user's real choice is out of reach.
    fix = dict(hasty, item_id=meta["want"]["item_id"], new_item_id=meta["switch_to"]["item_id"])
    obs = session.step(ToolCall("modify_item", fix))
    assert obs.error and "already modified" in obs.content
    msgs += [{"role": "assistant", "content": "Fixing."}, tool_msg("modify_item", fix)]
    ev = session.evaluate(msgs, communicate_info=False)
    assert ev.reward == 0.0 and ev.details["gold_writes_matched"] == 0
    assert ev.details["writes_confirmed"] == [False] and session.all_writes_confirmed() is False
    assert [w.confirmed for w in session.writes] == [False, False]
