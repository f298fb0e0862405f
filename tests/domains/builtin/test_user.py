"""The scripted user of the built-in domain: rules, change of mind, robustness, determinism."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from muajax.domains.base import Task
from muajax.domains.builtin import BuiltinEnvironment, is_affirmative
from muajax.domains.base import STOP, UserTurn, find_end_token
from muajax.domains.builtin.user import ScriptedUser


@pytest.fixture(scope="module")
def env() -> BuiltinEnvironment:
    return BuiltinEnvironment(n_users=20, n_test_users=4, n_train_tasks=60, n_test_tasks=15)


def task_of(env, kind):
    return next(t for t in env.tasks("train") if t.metadata["kind"] == kind)


def start(task, **kw):
    return ScriptedUser(**kw).start(task)


def test_rejects_tasks_it_cannot_script(env):
    with pytest.raises(ValueError, match="only play built-in tasks"):
        ScriptedUser().start(Task("t1", "retail", "hi", "a scenario"))
    task = task_of(env, "modify")
    with pytest.raises(ValueError, match="only play built-in tasks"):
        ScriptedUser().start(dataclasses.replace(task, metadata={**task.metadata, "kind": "refund"}))
    with pytest.raises(ValueError, match="lacks scenario fields"):
        ScriptedUser().start(dataclasses.replace(task, metadata={**task.metadata, "want": None}))
    with pytest.raises(TypeError):
        ScriptedUser().start("not a task")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_turns"):
        ScriptedUser(max_turns=0)


def test_gives_identity_when_asked_and_reply_is_async(env):
    task = task_of(env, "cancel")
    user = start(task)
    turn = asyncio.run(user.reply("Sure. Please tell me your full name and zip code."))
    assert isinstance(turn, UserTurn) and turn.end is None
    assert turn.text == f"I am {task.metadata['name']}, zip {task.metadata['zip']}."


def test_change_of_mind_after_options_then_confirms_the_new_choice(env):
    task = task_of(env, "modify_mind")
    want, other = task.metadata["want"], task.metadata["switch_to"]
    user = start(task)
    listing = (f"The options are: {want['options']} ${want['price']}, {other['options']} ${other['price']}. "
               f"Change to {want['options']}? Reply yes to confirm.")
    assert user.respond(listing).text == f"Hmm, I prefer {other['options']} instead."
    assert user.respond(f"Change to {want['options']}? Reply yes to confirm.").text == \
        f"No, I want {other['options']}."
    yes = user.respond(f"Change to {other['options']} for ${other['price']}? Reply yes to confirm.")
    assert yes.text == "Yes." and is_affirmative(yes.text)
    bye = user.respond("Done. Anything else?")
    assert bye.end == STOP and bye.text.endswith(STOP)


def test_plain_user_confirms_its_request_and_refuses_others(env):
    task = task_of(env, "modify")
    want = task.metadata["want"]
    user = start(task)
    assert user.respond("Which one would you like? The options are listed above.").text == \
        f"I want {want['options']}."
    assert user.respond(f"Change to {want['item_id']}? Reply yes to confirm.").text == "Yes."


def test_cancel_mind_user_withdraws_and_cancel_user_confirms(env):
    mind = start(task_of(env, "cancel_mind"))
    turn = mind.respond("Cancel order? Reply yes to confirm.")
    assert turn.end == STOP and "keep" in turn.text and not is_affirmative(turn.text)
    plain_task = task_of(env, "cancel")
    plain = start(plain_task)
    assert plain.respond("Shall I modify it?").text.startswith("I mean: cancel order")
    assert plain.respond(f"Cancel order {plain_task.metadata['order_id']}? Reply yes to confirm.").text == "Yes."


def test_address_user_insists_on_the_exact_address(env):
    task = task_of(env, "address")
    user = start(task)
    assert user.respond("Change your address to 1 Nowhere Rd? Reply yes to confirm.").text == \
        f"No, my new address is {task.metadata['address']}."
    assert user.respond(f"Change your address to {task.metadata['address']}? Reply yes to confirm.").text == "Yes."


def test_info_user_stops_once_answered(env):
    task = task_of(env, "info")
    fact = task.metadata["outputs"][0]
    user = start(task)
    restated = user.respond("Let me look into that for you.")
    assert restated.end is None and task.metadata["order_id"] in restated.text
    assert user.respond(f"Order {task.metadata['order_id']} is {fact}. Anything else?").end == STOP


def test_gives_up_after_stalls_and_turn_limit(env):
    task = task_of(env, "modify")
    user = start(task, max_stalls=3)
    turns = [user.respond("Lovely weather today.") for _ in range(3)]
    assert [t.end for t in turns] == [None, None, STOP]
    assert turns[0].text.startswith("I want to change the")
    assert user.respond("name and zip?").end == STOP  # a finished user stays finished
    chatty = start(task, max_turns=4, max_stalls=100)
    ends = [chatty.respond("Please tell me your name and zip code.").end for _ in range(5)]
    assert ends[:3] == [None, None, None] and STOP in ends


def _random_message(rng: random.Random, task: Task) -> str:
    meta = task.metadata
    words = ["yes", "no", "confirm", "name", "zip", "options", "done", "cancelled", "order", "anything else",
             "?", "$", "Reply yes to confirm.", "which order", "variant", "\n", "😀", "\x00", "  ",
             str(meta.get("order_id")), str(meta.get("address")), str(meta.get("outputs")),
             str((meta.get("want") or {}).get("options")), str((meta.get("switch_to") or {}).get("options"))]
    kind = rng.randrange(20)
    if kind < 4:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(0, 200)))
    if kind == 4:
        return "x" * rng.randrange(0, 50_000)
    return " ".join(rng.choice(words) for _ in range(rng.randrange(0, 40)))


def test_never_raises_and_is_deterministic_on_random_agent_text(env):
    tasks = [task_of(env, k) for k in ("modify", "modify_mind", "cancel", "cancel_mind", "address", "info")]
    rng = random.Random(0)
    messages = [_random_message(rng, tasks[i % len(tasks)]) for i in range(1000)]
    messages += [None, 42, b"bytes", ["list"]]  # type: ignore[list-item]
    ended = 0
    for task in tasks:
        runs = []
        for _ in range(2):
            # Fresh users every few messages, so the replies cover every state, not just "finished".
            turns = []
            for i in range(0, len(messages), 5):
                user = start(task)
                turns += [user.respond(m) for m in messages[i:i + 5]]
            runs.append(turns)
        assert runs[0] == runs[1]
        for turn in runs[0]:
            assert isinstance(turn, UserTurn) and isinstance(turn.text, str) and turn.text
            assert turn.end == find_end_token(turn.text)
            assert len(turn.text) < 200
        ended += sum(t.end is not None for t in runs[0])
        assert len({t.text for t in runs[0]}) >= 3  # the rules fired, not one canned answer
    assert 0 < ended < 6 * len(messages)
