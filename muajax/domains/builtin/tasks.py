"""Deterministic train/test tasks for the built-in domain.

Test tasks use held-out users (hence held-out orders), so no test user, order or
(user, order, variant) combination ever appears in training. A domain may instead share
its users between the splits; then `exclude` carries the training tasks' signatures, so a
test task is still one that training never saw (the same user, another order, action,
variant or address). Change-of-mind kinds open
with exactly the same first message as their plain twins: an agent can only tell them
apart by listing the options and waiting for the user's explicit yes.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from muajax.domains.base import Task, ToolCall
from muajax.domains.builtin.database import PENDING, STREETS, order_total

DOMAIN = "builtin"
KINDS = ("modify", "modify_mind", "cancel", "cancel_mind", "address", "info")
CHANGE_OF_MIND_KINDS = frozenset({"modify_mind", "cancel_mind"})
KIND_WEIGHTS = {"modify": 0.25, "modify_mind": 0.25, "cancel": 0.15, "cancel_mind": 0.10,
                "address": 0.10, "info": 0.15}


def _variant(db: dict[str, Any], product: str, item_id: str) -> dict[str, Any]:
    v = db["products"][product][item_id]
    return {"item_id": item_id, "options": v["options"], "price": v["price"]}


def _base(db: dict[str, Any], user_id: str, kind: str) -> dict[str, Any]:
    user = db["users"][user_id]
    return {"kind": kind, "user_id": user_id, "name": user["name"], "zip": user["zip"], "outputs": []}


def _identity(meta: dict[str, Any]) -> str:
    return f"You are {meta['name']}, zip {meta['zip']}. Give your name and zip when asked."


def _find_user(meta: dict[str, Any]) -> ToolCall:
    return ToolCall("find_user", {"name": meta["name"], "zip": meta["zip"]})


def _pending_orders(db: dict[str, Any], user_id: str) -> list[str]:
    return [o for o in db["users"][user_id]["orders"] if db["orders"][o]["status"] == PENDING]


def _modify(db, user_id, rng, mind: bool):
    meta = _base(db, user_id, "modify_mind" if mind else "modify")
    order_id = rng.choice(_pending_orders(db, user_id))
    item = rng.choice(db["orders"][order_id]["items"])
    product = item["product"]
    others = [v for v in sorted(db["products"][product]) if v != item["item_id"]]
    want, switch = rng.sample(others, 2)
    meta.update(order_id=order_id, product=product, item_id=item["item_id"], current=item["options"],
                want=_variant(db, product, want), switch_to=_variant(db, product, switch) if mind else None)
    final = meta["switch_to"] if mind else meta["want"]
    first = f"Hi. I want to change the {product} in order {order_id} to {meta['want']['options']}."
    scenario = (f"{_identity(meta)} You want to change the {product} ({item['options']}) in order {order_id} "
                f"to {meta['want']['options']}. ")
    if mind:
        scenario += (f"When the agent tells you the options, change your mind: you want {final['options']} "
                     f"(${final['price']}) instead. ")
    scenario += f"Say yes only when the agent proposes exactly {final['options']}."
    gold = (_find_user(meta), ToolCall("get_order", {"order_id": order_id}),
            ToolCall("list_variants", {"product": product}),
            ToolCall("modify_item", {"order_id": order_id, "item_id": item["item_id"],
                                     "new_item_id": final["item_id"]}))
    signature = ("modify", mind, order_id, item["item_id"], want, meta["switch_to"] and switch)
    return signature, first, scenario, gold, meta


def _cancel(db, user_id, rng, mind: bool):
    meta = _base(db, user_id, "cancel_mind" if mind else "cancel")
    order_id = rng.choice(_pending_orders(db, user_id))
    meta["order_id"] = order_id
    first = f"Hi. Please cancel my order {order_id}."
    scenario = f"{_identity(meta)} You want to cancel order {order_id}. "
    gold = [_find_user(meta), ToolCall("get_order", {"order_id": order_id})]
    if mind:
        scenario += "When the agent asks you to confirm, change your mind: say no, you keep the order, and end."
    else:
        scenario += "Say yes when the agent asks to confirm cancelling this order."
        gold.append(ToolCall("cancel_order", {"order_id": order_id}))
    return ("cancel", mind, order_id), first, scenario, tuple(gold), meta


def _address(db, user_id, rng):
    meta = _base(db, user_id, "address")
    current = db["users"][user_id]["address"]
    address = current
    while address == current:
        address = f"{rng.randrange(1, 100)} {rng.choice(STREETS)} St"
    meta["address"] = address
    first = f"Hi. Please change my address to {address}."
    scenario = f"{_identity(meta)} You moved to {address}. Say yes when the agent proposes exactly that address."
    gold = (_find_user(meta), ToolCall("update_address", {"user_id": user_id, "address": address}))
    return ("address", user_id, address), first, scenario, gold, meta


def _info(db, user_id, rng):
    meta = _base(db, user_id, "info")
    order_id = rng.choice(db["users"][user_id]["orders"])
    order = db["orders"][order_id]
    ask = rng.choice(("status", "total"))
    answer = order["status"] if ask == "status" else str(order_total(order))
    meta.update(order_id=order_id, ask=ask, outputs=[answer])
    first = f"Hi. What is the {ask} of my order {order_id}?"
    scenario = f"{_identity(meta)} You want to know the {ask} of order {order_id}. You do not want any change."
    gold = (_find_user(meta), ToolCall("get_order", {"order_id": order_id}))
    return ("info", order_id, ask), first, scenario, gold, meta


_BUILDERS: dict[str, Callable] = {
    "modify": lambda db, u, rng: _modify(db, u, rng, mind=False),
    "modify_mind": lambda db, u, rng: _modify(db, u, rng, mind=True),
    "cancel": lambda db, u, rng: _cancel(db, u, rng, mind=False),
    "cancel_mind": lambda db, u, rng: _cancel(db, u, rng, mind=True),
    "address": _address,
    "info": _info,
}


def check_kind_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """The weights normalised to sum to 1, or ValueError naming what is wrong."""
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"kind weights must be a non-empty mapping of kind -> weight, got {weights!r}")
    unknown = sorted(str(k) for k in weights if k not in KINDS)
    if unknown:
        raise ValueError(f"unknown task kind {unknown[0]!r}; the kinds are {', '.join(KINDS)}")
    bad = [k for k, w in weights.items() if not isinstance(w, (int, float)) or not 0 <= w < float("inf")]
    if bad:
        raise ValueError(f"the weight of kind {bad[0]!r} must be a finite number >= 0, got {weights[bad[0]]!r}")
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError("at least one task kind needs a weight > 0")
    return {k: weights[k] / total for k in KINDS if weights.get(k, 0) > 0}


def kind_counts(n: int, weights: Mapping[str, float] = KIND_WEIGHTS) -> dict[str, int]:
    """Split n tasks over the kinds by `weights` (largest remainder, so they sum to n)."""
    raw = {k: n * w for k, w in check_kind_weights(weights).items()}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: (counts[k] - raw[k], KINDS.index(k)))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def generate_tasks(db: dict[str, Any], user_ids: Sequence[str], split: str, n: int, seed: int,
                   seen: set[tuple] | None = None, kind_weights: Mapping[str, float] = KIND_WEIGHTS) -> list[Task]:
    """n distinct tasks over `user_ids`, spread round-robin so every user is used, their kinds
    split by `kind_weights`.

    `seen` holds the signatures of tasks to avoid; it is updated with the new ones, so one
    set passed to the train then the test split keeps the two disjoint."""
    if n < 1:
        raise ValueError(f"a split needs at least one task, got n={n}")
    rng = random.Random(f"{seed}:{split}")
    kinds = [k for k, c in kind_counts(n, kind_weights).items() for _ in range(c)]
    rng.shuffle(kinds)
    seen = set() if seen is None else seen
    tasks: list[Task] = []
    for i, kind in enumerate(kinds):
        for attempt in range(200):
            user_id = user_ids[(i + attempt // 10) % len(user_ids)]
            signature, first, scenario, gold, meta = _BUILDERS[kind](db, user_id, rng)
            if signature not in seen:
                break
        else:
            raise ValueError(f"cannot find {n} distinct {split} tasks over {len(user_ids)} users; use more users")
        seen.add(signature)
        tasks.append(Task(task_id=f"{DOMAIN}-{split}-{i:03d}", domain=DOMAIN, first_user_message=first,
                          user_scenario=scenario, gold_actions=gold, split=split, metadata=meta))
    return tasks
