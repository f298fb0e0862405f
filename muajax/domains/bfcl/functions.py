"""BFCL's functions for muajax: their docs as OpenAI tools, the call strings BFCL's
executor runs, and its ground-truth strings parsed into `ToolCall`s (the `bfcl` package
must be installed: `muajax.domains.bfcl.environment` checks that with a clear message)."""
from __future__ import annotations

import ast
import importlib
import inspect
import math
from functools import cache
from typing import Any

from bfcl.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl.model_handler.constant import GORILLA_TO_OPENAPI

from muajax.domains.base import ToolCall


def _openai_type(spec: dict[str, Any]) -> dict[str, Any]:
    """One BFCL (Gorilla) parameter schema as JSON schema: 'dict' -> object, 'float' ->
    number, 'tuple' -> array, unknown -> string (BFCL's own table), recursively."""
    out = dict(spec)
    out["type"] = GORILLA_TO_OPENAPI.get(spec.get("type"), "string")
    if isinstance(spec.get("properties"), dict):
        out["properties"] = {k: _openai_type(v) for k, v in spec["properties"].items()}
    if isinstance(spec.get("items"), dict):
        out["items"] = _openai_type(spec["items"])
    return out


def tool_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI tool; its `response` schema is kept (as BFCL's
    OpenAI handler does): it tells the agent what the function returns."""
    fn = {"name": doc["name"], "description": doc.get("description", ""), "parameters": _openai_type(doc["parameters"])}
    if isinstance(doc.get("response"), dict):
        fn["response"] = _openai_type(doc["response"])
    return {"type": "function", "function": fn}


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """The call string BFCL's function-calling handlers decode a call into."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


@cache
def api_class(class_name: str) -> type:
    return getattr(importlib.import_module(multi_turn_utils.CLASS_FILE_PATH_MAPPING[class_name]), class_name)


def parse_ground_truth_call(text: str, classes: list[str]) -> ToolCall:
    """A ground-truth string like "sort('a.pdf')" as a ToolCall with keyword arguments
    (positional ones named from the BFCL method's signature)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"cannot parse BFCL ground-truth call {text!r}: {exc}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        # a bad data string, not an argument of the wrong type
        raise ValueError(f"BFCL ground-truth {text!r} is not a plain function call")  # noqa: TRY004
    name = node.func.id
    method = next((getattr(api_class(c), name) for c in classes if hasattr(api_class(c), name)), None)
    if method is None:
        raise ValueError(f"BFCL ground-truth {text!r} calls {name!r}, which none of {classes} has")
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    if len(node.args) > len(params):
        raise ValueError(f"BFCL ground-truth {text!r} passes more positional arguments than {name} takes")
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return ToolCall(name, args)


def bad_value(value: Any) -> str | None:
    """Why `value` is not a finite JSON value (NaN, inf, a Python object), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if isinstance(value, dict):
        return next((p for v in value.values() if (p := bad_value(v))), None)
    if isinstance(value, list):
        return next((p for v in value if (p := bad_value(v))), None)
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{type(value).__name__} is not a JSON value"
