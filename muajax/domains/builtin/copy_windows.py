"""Warm-up windows: the built-in domain's argument copying, dense, for models trained from scratch.

A pretrained Qwen3 arrives able to copy a name, a zip code or an order id from the
conversation into a tool call. A tiny model trained from scratch on the cold-start data
alone does not learn that in minutes: the copied tokens are a few percent of the
assistant's tokens, each after a ~900-token system prompt, and a small model only learns
to attend by content when that signal is dense. These windows give it that signal: short
slices of scripted-expert conversations, each ending at one tool call, taken from *other*
shops (other database seeds: none of the run's own users, orders, item ids or prices
appear). They are the miniature of a base model's pretraining on other people's support
logs, not the run's tasks.

The expert is careful or careless with even odds here, so the windows carry no preference
on when to write; that preference comes from the cold-start data and from GRPO.
"""
from __future__ import annotations

import functools
from typing import Any

from muajax.domains.builtin.domain import BuiltinEnvironment
from muajax.domains.builtin.expert import expert_conversation

NEUTRAL_CARELESS = 0.5


def warmup_shop_seeds(run_seed: int, shops: int) -> list[int]:
    """Database seeds of the warm-up shops: never the run's own."""
    return [run_seed + 1 + i for i in range(shops)]


def tool_call_windows(messages: list[dict[str, Any]], context_messages: int) -> list[list[dict[str, Any]]]:
    """One window per assistant tool call: the conversation's opening request, then the
    call with at least `context_messages` messages before it (where the conversation has
    them), reaching back to the nearest user turn. The request holds the ids a call needs
    many turns later (the order, the product, the address); opening the recent part on a
    user turn found going forward instead would drop exactly the writes made straight after
    tool results (the careless ones) and keep only writes after a "yes"."""
    windows = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        users = [j for j in range(i) if messages[j]["role"] == "user"]
        if not users:
            continue
        reaching = [j for j in users if j <= i - context_messages]
        start = reaching[-1] if reaching else users[0]
        windows.append(messages[users[0]:users[0] + 1] * (start > users[0]) + messages[start:i + 1])
    return windows


@functools.lru_cache(maxsize=2)
def warmup_windows(run_seed: int, *, shops: int, n_users: int = 60, tasks_per_shop: int = 200,
                   context_messages: int = 4) -> tuple[list[dict[str, Any]], ...]:
    """Windows from `shops` other shops, `tasks_per_shop` expert conversations each;
    deterministic in its arguments, and kept: the vocabulary and the warm-up both read
    them (callers must not modify them)."""
    out: list[list[dict[str, Any]]] = []
    for seed in warmup_shop_seeds(run_seed, shops):
        shop = BuiltinEnvironment(seed=seed, n_users=n_users, n_test_users=0, n_train_tasks=tasks_per_shop,
                                  n_test_tasks=1)
        for task in shop.tasks("train"):
            messages, _ = expert_conversation(shop, task, careless=NEUTRAL_CARELESS, seed=seed, evaluate=False)
            out.extend(tool_call_windows(messages, context_messages))
    return tuple(out)
