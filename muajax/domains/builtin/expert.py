"""A scripted expert agent for the built-in domain: the cold-start SFT data source.

The expert plays the agent side against the scripted user and a fresh env session. It
reads only what an agent could see (the user's words and tool results) and never peeks
at the task's scenario, so its conversations are ones a model can learn to reproduce.
With probability `careless` per task it writes as soon as it has the facts, before asking
for confirmation, as real cold-start data sometimes does: harmless on plain tasks,
fatal on change-of-mind tasks.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

from muajax.domains.base import Environment, EnvSession, Evaluation, Task, ToolCall, UserSession, sft_record
from muajax.domains.builtin.confirm import is_affirmative
from muajax.domains.builtin.tools import WRITE_TOOLS
from muajax.domains.builtin.user import ScriptedUser

_MODIFY = re.compile(r"change the (\w+) in order (#o\d+) to (.+?)\.?$", re.IGNORECASE)
_CANCEL = re.compile(r"cancel my order (#o\d+)", re.IGNORECASE)
_ADDRESS = re.compile(r"change my address to (.+?)\.?$", re.IGNORECASE)
_INFO = re.compile(r"what is the (status|total) of my order (#o\d+)", re.IGNORECASE)
_IDENTITY = re.compile(r"I am (.+?), zip (\d+)", re.IGNORECASE)
MAX_CONFIRM_ROUNDS = 3


class _Ended(Exception):
    """The user or a tool ended the episode."""


def _named(text: str, options: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(options)}(?!\w)", text, re.IGNORECASE) is not None


class _Expert:
    def __init__(self, task: Task, session: EnvSession, user: UserSession, careless: bool, never_write: bool = False):
        self.task = task
        self.session = session
        self.user = user
        self.careless = careless
        self.never_write = never_write
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task.first_user_message}]

    async def say(self, text: str) -> str:
        self.messages.append({"role": "assistant", "content": text})
        turn = await self.user.reply(text)
        self.messages.append({"role": "user", "content": turn.text})
        if turn.end or turn.failed:
            raise _Ended
        return turn.text

    def call(self, name: str, arguments: dict[str, str]) -> Any:
        if self.never_write and name in WRITE_TOOLS:
            return {}  # the floor: everything but the write
        call_id = f"call_{sum(1 for m in self.messages if m['role'] == 'tool')}"
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        obs = self.session.step(ToolCall(name, arguments, call_id))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": obs.content})
        if obs.error:
            raise RuntimeError(f"expert tool call {name}({arguments}) failed on {self.task.task_id}: {obs.content}")
        if obs.done:
            raise _Ended
        return json.loads(obs.content)

    async def authenticate(self) -> str:
        reply = await self.say("Sure. Please tell me your full name and zip code.")
        match = _IDENTITY.search(reply)
        if match is None:
            raise RuntimeError(f"expert could not read name and zip from {reply!r} on {self.task.task_id}")
        return self.call("find_user", {"name": match.group(1), "zip": match.group(2)})["user_id"]

    async def play(self) -> None:
        first = self.task.first_user_message
        try:
            if m := _MODIFY.search(first):
                await self.modify(m.group(1).lower(), m.group(2), m.group(3))
            elif m := _CANCEL.search(first):
                await self.cancel(m.group(1))
            elif m := _ADDRESS.search(first):
                await self.address(m.group(1))
            elif m := _INFO.search(first):
                await self.info(m.group(2))
            else:
                raise ValueError(f"the expert does not know the request {first!r} of task {self.task.task_id}")
        except _Ended:
            pass

    async def modify(self, product: str, order_id: str, wanted: str) -> None:
        await self.authenticate()
        order = self.call("get_order", {"order_id": order_id})
        item = next(it for it in order["items"] if it["product"] == product)
        variants = self.call("list_variants", {"product": product})["variants"]
        target = next(v for v in variants if v["options"].lower() == wanted.lower())
        if not self.careless:
            others = ", ".join(f"{v['options']} ${v['price']}" for v in variants if v["item_id"] != item["item_id"])
            question = f"Change your {product} {item['options']} to {{}} for ${{}}? Reply yes to confirm."
            reply = await self.say(f"The {product} options are: {others}. "
                                   + question.format(target["options"], target["price"]))
            for _ in range(MAX_CONFIRM_ROUNDS):
                if is_affirmative(reply):
                    break
                # Longest match first, so "red L" wins over a bare "red" if both were options.
                named = [v for v in variants if _named(reply, v["options"]) and v["item_id"] != item["item_id"]]
                target = max(named, key=lambda v: len(v["options"])) if named else target
                reply = await self.say(question.format(target["options"], target["price"]))
            else:
                await self.say("Sorry, I could not confirm the change. Anything else?")
                return
        self.call("modify_item", {"order_id": order_id, "item_id": item["item_id"], "new_item_id": target["item_id"]})
        await self.say(f"Done. Order {order_id} now has {product} {target['options']} for ${target['price']}. "
                       "Anything else?")

    async def cancel(self, order_id: str) -> None:
        await self.authenticate()
        order = self.call("get_order", {"order_id": order_id})
        if not self.careless:
            items = ", ".join(f"{it['product']} {it['options']} ${it['price']}" for it in order["items"])
            reply = await self.say(f"Order {order_id} has {items}, total ${order['total']}. "
                                   f"Cancel order {order_id}? Reply yes to confirm.")
            if not is_affirmative(reply):
                await self.say(f"OK, order {order_id} stays as it is. Anything else?")
                return
        self.call("cancel_order", {"order_id": order_id})
        await self.say(f"Done. Order {order_id} is cancelled. Anything else?")

    async def address(self, address: str) -> None:
        user_id = await self.authenticate()
        if not self.careless:
            reply = await self.say(f"Change your address to {address}? Reply yes to confirm.")
            if not is_affirmative(reply):
                await self.say("OK, your address stays as it is. Anything else?")
                return
        self.call("update_address", {"user_id": user_id, "address": address})
        await self.say(f"Done. Your address is now {address}. Anything else?")

    async def info(self, order_id: str) -> None:
        await self.authenticate()
        order = self.call("get_order", {"order_id": order_id})
        await self.say(f"Order {order_id} is {order['status']}. The total is ${order['total']}. Anything else?")


def _is_careless(careless: float, seed: int, task: Task) -> bool:
    if not isinstance(careless, (int, float)) or not 0.0 <= careless <= 1.0:
        raise ValueError(f"careless must be a probability in [0, 1], got {careless!r}")
    # Keyed by (seed, task) rather than a shared stream, so one task's draw never depends on
    # which other tasks were generated before it.
    return random.Random(f"{seed}:{task.task_id}").random() < careless


async def expert_conversation_async(env: Environment, task: Task, *, careless: float, seed: int,
                                    communicate_info: bool = True, evaluate: bool = True,
                                    never_write: bool = False) -> tuple[list[dict[str, Any]], Evaluation | None]:
    """`expert_conversation` for callers already inside an event loop; `evaluate=False`
    skips the scoring (its database hash is most of the cost) and returns None for it.
    `never_write` plays the expert without its write calls (the floor a policy that never
    writes would reach)."""
    sloppy = _is_careless(careless, seed, task)
    session = env.reset(task)
    try:
        expert = _Expert(task, session, ScriptedUser().start(task, session), sloppy, never_write)
        await expert.play()
        if not evaluate:
            return expert.messages, None
        return expert.messages, session.evaluate(expert.messages, communicate_info=communicate_info)
    finally:
        session.close()


def expert_conversation(env: Environment, task: Task, *, careless: float, seed: int, communicate_info: bool = True,
                        evaluate: bool = True) -> tuple[list[dict[str, Any]], Evaluation | None]:
    """One expert conversation (OpenAI-style messages, system omitted) and its evaluation
    (None with `evaluate=False`)."""
    return asyncio.run(expert_conversation_async(env, task, careless=careless, seed=seed,
                                                 communicate_info=communicate_info, evaluate=evaluate))


def expert_dataset(env: Environment, split: str, *, careless: float, seed: int,
                   only_successful: bool = False) -> list[tuple[list[dict[str, Any]], Evaluation]]:
    """Expert conversations for every task of a split; `only_successful` keeps reward-1 ones
    (the cold-start filter)."""
    async def run_all():
        return [await expert_conversation_async(env, t, careless=careless, seed=seed) for t in env.tasks(split)]

    pairs = asyncio.run(run_all())
    return [p for p in pairs if p[1].reward == 1.0] if only_successful else pairs


def expert_records(env: Environment, tasks: list[Task], *, careless: float, seed: int) -> list[dict[str, Any]]:
    """SFT records (`muajax.domains.base.sft_record`) of the expert on every task, kept or not."""
    async def run_all():
        return [await expert_conversation_async(env, t, careless=careless, seed=seed) for t in tasks]

    return [sft_record(env, task, messages, evaluation)
            for task, (messages, evaluation) in zip(tasks, asyncio.run(run_all()))]


def never_write_floor(env: Environment, tasks: list[Task], *, communicate_info: bool = True) -> float:
    """Success of a careful agent that never writes: authenticates, reads, asks, answers,
    and leaves the database as it found it. The score a policy gets for free on tasks whose
    right outcome is no change (a user who changes their mind, a question); a lesson about
    when to write is worth what it adds above this."""
    async def run_all():
        return [(await expert_conversation_async(env, t, careless=0.0, seed=0, never_write=True,
                                                 communicate_info=communicate_info))[1] for t in tasks]

    evaluations = asyncio.run(run_all())
    return sum(e.reward for e in evaluations) / max(len(evaluations), 1)
