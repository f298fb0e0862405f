"""Helpers shared by the built-in shop domain's tests (test_builtin*.py)."""
from __future__ import annotations

import json


def all_tasks(env):
    return env.tasks("train") + env.tasks("test")


def first_of(env, kind, split="train"):
    return next(t for t in env.tasks(split) if t.metadata["kind"] == kind)


def tool_msg(name, args):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
