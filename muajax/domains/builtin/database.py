"""The built-in shop database: generated from a seed, hashed for the reward.

Everything is deliberately small and formulaic (ids like `u07`, `#o123`, `v12`; integer
prices; short option strings such as "red M") so a tiny model trained for minutes on a
CPU can learn to copy ids and prices between tool results and messages.
"""
from __future__ import annotations

import hashlib
import json
import random
from typing import Any

FIRST_NAMES = ("Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jay",
               "Kim", "Liz", "Max", "Ned", "Oli", "Pam", "Ray", "Sam", "Tom", "Uma")
LAST_NAMES = ("Ng", "Fox", "Kay", "Day", "Cox", "Poe", "Roy", "Lin", "Wu", "Ito",
              "May", "Orr", "Rao", "Tan", "Yu", "Lee")
STREETS = ("Oak", "Pine", "Elm", "Maple", "Cedar", "Birch", "Lake", "Hill", "Park", "Main")
COLORS = ("red", "blue", "black", "white", "green", "gray")
SIZES = ("S", "M", "L")
# product -> whether its variants also come in sizes; four variants each keeps lists short.
PRODUCTS = (("shirt", True), ("shoes", True), ("hat", True), ("mug", False), ("lamp", False), ("bag", False))
VARIANTS_PER_PRODUCT = 4
ORDERS_PER_USER = 3
MAX_ORDER_NUMBERS = 900  # order ids are #o100..#o999
PENDING, DELIVERED, CANCELLED, MODIFIED = "pending", "delivered", "cancelled", "modified"


def _products(rng: random.Random) -> dict[str, dict[str, dict[str, Any]]]:
    n_variants = len(PRODUCTS) * VARIANTS_PER_PRODUCT
    item_numbers = rng.sample(range(10, 100), n_variants)
    products: dict[str, dict[str, dict[str, Any]]] = {}
    for p, (product, sized) in enumerate(PRODUCTS):
        if sized:
            combos = [f"{c} {s}" for c in COLORS for s in SIZES]
        else:
            combos = list(COLORS)
        options = rng.sample(combos, VARIANTS_PER_PRODUCT)
        variants = {}
        for v, opt in enumerate(options):
            item_id = f"v{item_numbers[p * VARIANTS_PER_PRODUCT + v]}"
            variants[item_id] = {"options": opt, "price": rng.randrange(10, 100)}
        products[product] = variants
    return products


def _order_items(rng: random.Random, products: dict[str, Any]) -> list[dict[str, Any]]:
    chosen = rng.sample(sorted(products), rng.choice((1, 1, 2)))
    items = []
    for product in chosen:
        item_id = rng.choice(sorted(products[product]))
        variant = products[product][item_id]
        items.append({"item_id": item_id, "product": product,
                      "options": variant["options"], "price": variant["price"]})
    return items


def generate_database(seed: int, n_users: int) -> dict[str, Any]:
    """A deterministic database: the same (seed, n_users) always gives the same JSON."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    max_users = min(len(FIRST_NAMES) * len(LAST_NAMES), MAX_ORDER_NUMBERS // ORDERS_PER_USER)
    if not isinstance(n_users, int) or not 2 <= n_users <= max_users:
        raise ValueError(f"n_users must be an int in [2, {max_users}], got {n_users!r}")
    rng = random.Random(seed)
    products = _products(rng)
    names = rng.sample([f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES], n_users)
    zips = rng.sample(range(10000, 100000), n_users)
    order_numbers = rng.sample(range(100, 100 + MAX_ORDER_NUMBERS), n_users * ORDERS_PER_USER)
    width = 2 if n_users <= 100 else 3  # u07 for the small default databases, u107 beyond 100 users
    users: dict[str, Any] = {}
    orders: dict[str, Any] = {}
    for u in range(n_users):
        user_id = f"u{u:0{width}d}"
        # Two pending orders per user guarantee every user can carry modify and cancel tasks.
        statuses = [PENDING, PENDING, rng.choice((DELIVERED, CANCELLED, PENDING))]
        rng.shuffle(statuses)
        order_ids = []
        for k, status in enumerate(statuses):
            order_id = f"#o{order_numbers[u * ORDERS_PER_USER + k]}"
            orders[order_id] = {"user_id": user_id, "status": status, "items": _order_items(rng, products)}
            order_ids.append(order_id)
        users[user_id] = {
            "name": names[u],
            "zip": str(zips[u]),
            "address": f"{rng.randrange(1, 100)} {rng.choice(STREETS)} St",
            "orders": order_ids,
        }
    return {"users": users, "products": products, "orders": orders}


def db_hash(db: dict[str, Any]) -> str:
    """sha256 of the sorted JSON: the reward compares these, as MUA-RL does."""
    return hashlib.sha256(json.dumps(db, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def order_total(order: dict[str, Any]) -> int:
    return sum(item["price"] for item in order["items"])
