"""The built-in shop domain: determinism, splits, reward, the scripted expert, database sizes.
(Tools and the confirmation rule: test_builtin_tools.py.)"""
from __future__ import annotations

import collections
import json

import pytest

from muajax.domains.base import Task, ToolCall, confirm_before_write_rate
from muajax.domains.builtin import CHANGE_OF_MIND_KINDS, KINDS, WRITE_TOOLS, BuiltinEnvironment
from muajax.domains.builtin.database import db_hash
from muajax.domains.builtin.expert import expert_conversation, expert_dataset
from tests.domains.builtin.builtin_support import all_tasks, first_of


@pytest.fixture(scope="module")
def env() -> BuiltinEnvironment:
    return BuiltinEnvironment()


# -- tasks and splits --------------------------------------------------------------------------

def test_splits_sizes_kinds_and_determinism(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (200, 50)
    for split in (train, test):
        assert set(collections.Counter(t.metadata["kind"] for t in split)) == set(KINDS)
    again = BuiltinEnvironment()
    assert [(t.task_id, t.first_user_message, t.gold_actions, t.metadata) for t in all_tasks(again)] == \
        [(t.task_id, t.first_user_message, t.gold_actions, t.metadata) for t in all_tasks(env)]
    assert db_hash(again.fresh_db()) == db_hash(env.fresh_db())
    assert db_hash(BuiltinEnvironment(seed=1).fresh_db()) != db_hash(env.fresh_db())
    assert len({t.task_id for t in all_tasks(env)}) == 250
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("valid")


def test_kind_weights_set_the_mix_of_both_splits():
    env = BuiltinEnvironment(kind_weights={"cancel": 2, "cancel_mind": 2, "info": 1, "modify": 0})
    for split, n in (("train", 200), ("test", 50)):
        counts = collections.Counter(t.metadata["kind"] for t in env.tasks(split))
        assert counts == {"cancel": 0.4 * n, "cancel_mind": 0.4 * n, "info": 0.2 * n}, counts
    cases = [({}, "non-empty mapping"), ({"refund": 1.0}, "unknown task kind 'refund'"),
             ({"cancel": -1.0}, "finite number >= 0"), ({"cancel": float("inf")}, "finite number >= 0"),
             ({"cancel": "lots"}, "finite number >= 0"), ({"cancel": 0.0}, "weight > 0")]
    for weights, message in cases:
        with pytest.raises(ValueError, match=message):
            BuiltinEnvironment(kind_weights=weights)


def test_train_and_test_are_disjoint(env):
    def footprint(tasks):
        users = {t.metadata["user_id"] for t in tasks}
        orders = {t.metadata["order_id"] for t in tasks if "order_id" in t.metadata}
        combos = {(t.first_user_message, t.metadata["name"]) for t in tasks}
        return users, orders, combos

    for a, b in zip(footprint(env.tasks("train")), footprint(env.tasks("test")), strict=True):
        assert a and b and not a & b
    assert not set(env.train_users) & set(env.test_users)


def test_change_of_mind_tasks_open_like_their_plain_twins(env):
    mind = first_of(env, "modify_mind")
    assert mind.first_user_message.startswith("Hi. I want to change the ")
    assert mind.metadata["switch_to"]["item_id"] != mind.metadata["want"]["item_id"]
    # The gold write follows the switched choice, not the first request.
    assert mind.gold_actions[-1].arguments["new_item_id"] == mind.metadata["switch_to"]["item_id"]
    assert not any(c.name in WRITE_TOOLS for c in first_of(env, "cancel_mind").gold_actions)


def test_bad_inputs_to_environment_are_rejected():
    with pytest.raises(ValueError, match="n_users"):
        BuiltinEnvironment(n_users=1, n_test_users=1)
    with pytest.raises(ValueError, match="n_test_users"):
        BuiltinEnvironment(n_users=10, n_test_users=10)
    with pytest.raises(ValueError, match="distinct"):
        BuiltinEnvironment(n_users=4, n_test_users=1, n_test_tasks=500)
    env = BuiltinEnvironment(n_users=10, n_test_users=2, n_train_tasks=20, n_test_tasks=5)
    with pytest.raises(ValueError, match="cannot run task"):
        env.reset(Task("x", "retail", "hi", "scenario"))


def test_shared_users_still_hold_out_every_test_task():
    env = BuiltinEnvironment(n_users=12, n_test_users=0, n_train_tasks=150, n_test_tasks=40)
    assert env.test_users == env.train_users == tuple(sorted(env.fresh_db()["users"]))

    def what(task):  # the scenario and gold calls pin down a task; ids differ by split
        return task.user_scenario, tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in task.gold_actions)

    train = {what(t) for t in env.tasks("train")}
    test = [what(t) for t in env.tasks("test")]
    assert len(set(test)) == 40 and not train & set(test)
    # with held-out users the same generator gives other tasks (the split no longer shares customers)
    split = BuiltinEnvironment(n_users=12, n_test_users=3, n_train_tasks=150, n_test_tasks=40)
    assert {t.metadata["user_id"] for t in split.tasks("test")} == set(split.test_users)


# -- reward ---------------------------------------------------------------------------------

def test_gold_replay_scores_one_on_every_task(env):
    for task in all_tasks(env):
        session = env.reset(task)
        for call in task.gold_actions:
            assert not session.step(call).error, (task.task_id, call)
        ev = session.evaluate([], communicate_info=False)
        assert (ev.reward, ev.partial) == (1.0, 1.0), task.task_id


def test_greeting_only_scores_zero_on_write_tasks(env):
    greeting = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello! How can I help?"}]
    write_tasks = [t for t in all_tasks(env) if any(c.name in WRITE_TOOLS for c in t.gold_actions)]
    assert len(write_tasks) > 100
    for task in write_tasks:
        for communicate_info in (False, True):
            ev = env.reset(task).evaluate(greeting, communicate_info=communicate_info)
            assert ev.reward == 0.0 and ev.partial < 1.0 and not ev.details["db_match"], task.task_id


def test_info_must_be_communicated_when_checked(env):
    task = first_of(env, "info")
    fact = task.metadata["outputs"][0]
    session = env.reset(task)
    for call in task.gold_actions:
        session.step(call)
    silent = [{"role": "assistant", "content": "Let me check."}]
    told = [{"role": "assistant", "content": f"It is {fact}."}]
    assert session.evaluate(silent, communicate_info=False).reward == 1.0
    ev = session.evaluate(silent, communicate_info=True)
    assert ev.reward == 0.0 and ev.details["info_ok"] is False and ev.partial == 0.5
    assert session.evaluate(told, communicate_info=True).reward == 1.0
    with pytest.raises(TypeError, match="list of message dicts"):
        session.evaluate("hello", communicate_info=True)


def test_extra_write_lowers_partial_and_reward(env):
    task = first_of(env, "address")
    session = env.reset(task)
    for call in task.gold_actions:
        session.step(call)
    other = next(o for o in session.db["orders"].values() if o["user_id"] == task.metadata["user_id"]
                 and o["status"] == "pending")
    order_id = next(k for k, v in session.db["orders"].items() if v is other)
    assert not session.step(ToolCall("cancel_order", {"order_id": order_id})).error
    ev = session.evaluate([], communicate_info=False)
    assert ev.reward == 0.0 and ev.details["extra_writes"] == 1 and ev.partial == 0.5


def test_concurrent_sessions_do_not_share_writes(env):
    task = first_of(env, "cancel")
    pristine = db_hash(env.fresh_db())
    a, b = env.reset(task), env.reset(task)
    for call in task.gold_actions:
        assert not a.step(call).error
    assert a.db["orders"][task.metadata["order_id"]]["status"] == "cancelled"
    assert b.db["orders"][task.metadata["order_id"]]["status"] == "pending"
    assert db_hash(b.db) == pristine == db_hash(env.reset(task).db)
    assert a.evaluate([], communicate_info=False).reward == 1.0
    assert b.evaluate([], communicate_info=False).reward == 0.0


# -- the scripted expert ------------------------------------------------------------------------

def test_careful_expert_solves_every_task_within_eight_agent_turns(env):
    for split in ("train", "test"):
        for task, (msgs, ev) in zip(env.tasks(split), expert_dataset(env, split, careless=0.0, seed=0), strict=True):
            assert ev.reward == 1.0 and ev.partial == 1.0, (task.task_id, msgs)
            assert ev.details["tool_errors"] == 0
            writes = ev.details["writes_confirmed"]
            assert writes == [True] * ev.details["gold_writes"], task.task_id
            assert 4 <= sum(m["role"] == "assistant" for m in msgs) <= 8
            assert msgs[0] == {"role": "user", "content": task.first_user_message}
            assert msgs[-1]["role"] == "user" and msgs[-1]["content"].endswith("###STOP###")


def test_careless_expert_fails_exactly_the_change_of_mind_tasks(env):
    rates = []
    for task, (_, ev) in zip(env.tasks("test"), expert_dataset(env, "test", careless=1.0, seed=0), strict=True):
        kind = task.metadata["kind"]
        expected = 0.0 if kind in CHANGE_OF_MIND_KINDS else 1.0
        assert ev.reward == expected, (task.task_id, kind)
        if kind != "info":
            assert ev.details["writes_confirmed"] == [False], task.task_id
        rates.append(ev.details["writes_confirmed"] or [])
    assert confirm_before_write_rate(rates) == 0.0


def test_expert_carelessness_is_seeded_and_validated(env):
    tasks = [t for t in env.tasks("train") if t.metadata["kind"] == "modify_mind"][:20]

    def rewards(seed):
        return [expert_conversation(env, t, careless=0.5, seed=seed)[1].reward for t in tasks]

    first = rewards(3)
    assert first == rewards(3) and 0 < sum(first) < len(first)
    msgs, _ = expert_conversation(env, tasks[0], careless=0.0, seed=0)
    call = next(m for m in msgs if m.get("tool_calls"))["tool_calls"][0]
    assert call["type"] == "function" and isinstance(call["function"]["arguments"], str)
    with pytest.raises(ValueError, match="careless"):
        expert_conversation(env, tasks[0], careless=1.5, seed=0)


def test_large_database_keeps_every_property_and_the_small_ones_ids():
    # The embedded default trains on 300 users (so a tiny model must copy names and ids
    # rather than memorise them); past 100 users the ids grow a digit, below they don't.
    big = BuiltinEnvironment(n_users=300, n_test_users=30, n_train_tasks=400, n_test_tasks=40)
    users = big.fresh_db()["users"]
    assert len(users) == 300 and all(len(u) == 4 for u in users)
    assert all(len(u) == 3 for u in BuiltinEnvironment().fresh_db()["users"])
    names = [u["name"] for u in users.values()]
    assert len(set(names)) == 300
    assert not {t.metadata["user_id"] for t in big.tasks("train")} & {t.metadata["user_id"] for t in big.tasks("test")}
    for task in big.tasks("train")[:60] + big.tasks("test"):
        session = big.reset(task)
        for call in task.gold_actions:
            assert not session.step(call).error, (task.task_id, call)
        assert session.evaluate([], communicate_info=False).reward == 1.0, task.task_id
    with pytest.raises(ValueError, match="n_users"):
        BuiltinEnvironment(n_users=301)
    # a session's database is a private copy
    first, second = big.reset(big.tasks("train")[0]), big.reset(big.tasks("train")[0])
    first.db["users"].clear()
    assert len(second.db["users"]) == 300


def test_a_validation_split_comes_from_the_train_users_and_leaves_train_and_test_as_they_were():
    weights = {"cancel": 0.4, "cancel_mind": 0.4, "info": 0.2}
    plain = BuiltinEnvironment(kind_weights=weights)
    with_val = BuiltinEnvironment(kind_weights=weights, n_validation_tasks=40)
    for split in ("train", "test"):
        assert [t.first_user_message for t in plain.tasks(split)] == [t.first_user_message for t in with_val.tasks(split)]
    validation = with_val.tasks("validation")
    assert len(validation) == 40 and all(t.split == "validation" for t in validation)
    assert {t.metadata["user_id"] for t in validation} <= set(with_val.train_users)
    train = {(t.first_user_message, t.user_scenario) for t in with_val.tasks("train")}
    assert not any((t.first_user_message, t.user_scenario) in train for t in validation)
    with pytest.raises(ValueError, match="builtin_validation_tasks"):
        plain.tasks("validation")


def test_the_never_write_floor_is_the_share_of_tasks_whose_right_outcome_is_no_change():
    env = BuiltinEnvironment(kind_weights={"cancel": 0.4, "cancel_mind": 0.4, "info": 0.2})
    tasks = env.tasks("test")
    kinds = [t.metadata["kind"] for t in tasks]
    unchanged = sum(k in ("cancel_mind", "info") for k in kinds) / len(kinds)
    assert env.never_write_floor(tasks, communicate_info=True) == pytest.approx(unchanged)
    only_writes = [t for t in tasks if t.metadata["kind"] == "cancel"]
    assert env.never_write_floor(only_writes, communicate_info=True) == 0.0
