"""The built-in domain's tools: schemas, argument validation, and the shop logic.

`Shop.call` raises `ToolError` with a short, model-readable message for every bad call;
the session turns that into an error observation, so `step` itself never raises.
Gold-action replay goes through the same `Shop.call`, so gold and agent writes are
judged by one implementation.
"""
from __future__ import annotations

import json
import re
from typing import Any

from muajax.domains.builtin.database import CANCELLED, MODIFIED, PENDING, order_total

MAX_ARG_CHARS = 100
WRITE_TOOLS = frozenset({"modify_item", "cancel_order", "update_address"})

# name -> (description, {parameter: description}); every parameter is a required string.
_SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "find_user": ("Authenticate the user: find their user id by full name and zip code.",
                  {"name": "Full name, e.g. 'Ann Ng'.", "zip": "Zip code, e.g. '12345'."}),
    "get_order": ("Get an order's status, items and total. Needs an authenticated user.",
                  {"order_id": "Order id, e.g. '#o123'."}),
    "list_variants": ("List all variants of a product with item ids, options and prices.",
                      {"product": "Product name, e.g. 'shirt'."}),
    "modify_item": ("Swap one item of a pending order for another variant of the same product. "
                    "An order can be modified only once. Only after the user said yes.",
                    {"order_id": "Order id.", "item_id": "Item id now in the order.",
                     "new_item_id": "Item id of the new variant."}),
    "cancel_order": ("Cancel a pending order. Only after the user said yes.",
                     {"order_id": "Order id."}),
    "update_address": ("Change the user's address. Only after the user said yes.",
                       {"user_id": "User id, e.g. 'u07'.", "address": "New address, e.g. '12 Oak St'."}),
}
TOOL_NAMES = tuple(_SPECS)


class ToolError(Exception):
    """A bad tool call; the message is shown to the agent."""


def tool_schemas() -> list[dict[str, Any]]:
    """OpenAI function schemas for the domain tools (fresh dicts: callers may mutate them)."""
    schemas = []
    for name, (description, params) in _SPECS.items():
        schemas.append({
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                    "required": list(params),
                },
            },
        })
    return schemas


def short(value: Any, limit: int = 30) -> str:
    """A bounded repr, so huge or hostile arguments never flood an observation."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def _squash(text: str) -> str:
    return " ".join(text.split())


def _canonical_order_id(text: str) -> str:
    # Small models often drop the '#' or change case; accepting that keeps errors for real mistakes.
    match = re.fullmatch(r"#?o(\d+)", text.strip(), flags=re.IGNORECASE)
    return f"#o{match.group(1)}" if match else text.strip()


_CANON = {
    "name": _squash, "zip": str.strip, "order_id": _canonical_order_id, "product": lambda s: s.strip().lower(),
    "item_id": lambda s: s.strip().lower(), "new_item_id": lambda s: s.strip().lower(),
    "user_id": lambda s: s.strip().lower(), "address": _squash,
}


def validate_arguments(name: str, arguments: Any) -> dict[str, str]:
    """The canonical arguments of a call, or ToolError naming exactly what is wrong."""
    if not isinstance(name, str) or name not in _SPECS:
        raise ToolError(f"unknown tool {short(name)}. Tools: {', '.join(TOOL_NAMES)}")
    if not isinstance(arguments, dict):
        raise ToolError(f"{name} arguments must be a JSON object, got {type(arguments).__name__}")
    params = _SPECS[name][1]
    missing = [p for p in params if p not in arguments]
    if missing:
        raise ToolError(f"{name} is missing argument {missing[0]!r}")
    extra = sorted((k for k in arguments if k not in params), key=str)
    if extra:
        raise ToolError(f"{name} got unexpected argument {short(extra[0])}")
    canonical = {}
    for p in params:
        value = arguments[p]
        if not isinstance(value, str):
            raise ToolError(f"argument {p!r} of {name} must be a string, got {type(value).__name__}")
        if len(value) > MAX_ARG_CHARS:
            raise ToolError(f"argument {p!r} of {name} is too long (max {MAX_ARG_CHARS} characters)")
        canonical[p] = _CANON[p](value)
        if not canonical[p]:
            raise ToolError(f"argument {p!r} of {name} is empty")
    return canonical


def dump(obj: Any) -> str:
    """Compact JSON: tool outputs stay short for a tiny model's context."""
    return json.dumps(obj, separators=(",", ":"))


class Shop:
    """The tool logic over one database copy plus the session's authenticated user."""

    def __init__(self, db: dict[str, Any]):
        self.db = db
        self.user_id: str | None = None

    def call(self, name: str, arguments: Any) -> tuple[str, dict[str, str]]:
        """(observation text, canonical arguments); raises ToolError for bad calls."""
        args = validate_arguments(name, arguments)
        return getattr(self, "_" + name)(**args), args

    def _need_auth(self) -> str:
        if self.user_id is None:
            raise ToolError("authenticate the user first with find_user")
        return self.user_id

    def _own_order(self, order_id: str) -> dict[str, Any]:
        user_id = self._need_auth()
        order = self.db["orders"].get(order_id)
        if order is None:
            raise ToolError(f"order {short(order_id)} not found")
        if order["user_id"] != user_id:
            raise ToolError(f"order {order_id} does not belong to the authenticated user")
        return order

    def _find_user(self, name: str, zip: str) -> str:  # noqa: A002 - the schema's parameter name
        for user_id, user in self.db["users"].items():
            if user["name"].lower() == name.lower() and user["zip"] == zip:
                self.user_id = user_id
                return dump({"user_id": user_id})
        raise ToolError(f"no user named {short(name)} with zip {short(zip)}")

    def _get_order(self, order_id: str) -> str:
        order = self._own_order(order_id)
        return dump({"order_id": order_id, "status": order["status"], "items": order["items"],
                     "total": order_total(order)})

    def _list_variants(self, product: str) -> str:
        variants = self.db["products"].get(product)
        if variants is None:
            raise ToolError(f"product {short(product)} not found. Products: {', '.join(sorted(self.db['products']))}")
        listed = [{"item_id": item_id, "options": v["options"], "price": v["price"]} for item_id, v in variants.items()]
        return dump({"product": product, "variants": listed})

    def _pending(self, order_id: str, action: str) -> dict[str, Any]:
        order = self._own_order(order_id)
        if order["status"] == MODIFIED:
            raise ToolError(f"order {order_id} was already modified; it cannot be {action} again or cancelled")
        if order["status"] != PENDING:
            raise ToolError(f"order {order_id} is {order['status']}; only pending orders can be {action}")
        return order

    def _modify_item(self, order_id: str, item_id: str, new_item_id: str) -> str:
        order = self._pending(order_id, "modified")
        item = next((it for it in order["items"] if it["item_id"] == item_id), None)
        if item is None:
            raise ToolError(f"item {short(item_id)} is not in order {order_id}")
        variants = self.db["products"][item["product"]]
        if new_item_id not in variants:
            raise ToolError(f"{short(new_item_id)} is not a variant of {item['product']}")
        if new_item_id == item_id:
            raise ToolError(f"order {order_id} already has {item_id}")
        new = variants[new_item_id]
        item.update({"item_id": new_item_id, "options": new["options"], "price": new["price"]})
        order["status"] = MODIFIED
        return dump({"order_id": order_id, "status": MODIFIED, "items": order["items"], "total": order_total(order)})

    def _cancel_order(self, order_id: str) -> str:
        order = self._pending(order_id, "cancelled")
        order["status"] = CANCELLED
        return dump({"order_id": order_id, "status": CANCELLED})

    def _update_address(self, user_id: str, address: str) -> str:
        if user_id != self._need_auth():
            raise ToolError(f"user {short(user_id)} is not the authenticated user")
        self.db["users"][user_id]["address"] = address
        return dump({"user_id": user_id, "address": address})
