"""MUA-RL's general-purpose tools, added to every domain: think, calculate, transfer.

`calculate` parses arithmetic with a tiny recursive-descent parser: the expression is
never evaluated as Python code, so nothing the model writes can execute.
"""
from __future__ import annotations

from typing import Any

from muajax.domains.base import Observation, ToolCall

TRANSFER_TOOL = "transfer_to_human_agents"
_ALLOWED = set("0123456789+-*/(). ")
MAX_EXPRESSION_CHARS = 256


def _schema(name: str, description: str, param: str, param_description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {param: {"type": "string", "description": param_description}},
                "required": [param],
            },
        },
    }


GENERAL_TOOL_SCHEMAS: list[dict[str, Any]] = [
    _schema("think", "Use the tool to think about something. It will not obtain new information or change "
            "the database, but just append the thought to the log.", "thought", "A thought to think about."),
    _schema("calculate", "Calculate the result of a mathematical expression.", "expression",
            "The mathematical expression to calculate, such as '2 + 2'. The expression can contain numbers, "
            "operators (+, -, *, /), parentheses, and spaces."),
    _schema(TRANSFER_TOOL, "Transfer the user to a human agent, with a summary of the user's issue. Only transfer "
            "if the user explicitly asks for a human agent, or the issue cannot be solved within policy.",
            "summary", "A summary of the user's issue."),
]
GENERAL_TOOL_NAMES = frozenset(s["function"]["name"] for s in GENERAL_TOOL_SCHEMAS)


class _Arithmetic:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := ('+'|'-') factor | number | '(' expr ')'."""

    def __init__(self, text: str):
        self.tokens = self._lex(text)
        self.pos = 0

    @staticmethod
    def _lex(text: str) -> list[str]:
        tokens, i = [], 0
        while i < len(text):
            ch = text[i]
            if ch == " ":
                i += 1
            elif ch.isdigit() or ch == ".":
                j = i
                while j < len(text) and (text[j].isdigit() or text[j] == "."):
                    j += 1
                if text[i:j].count(".") > 1:
                    raise ValueError(f"malformed number {text[i:j]!r}")
                tokens.append(text[i:j])
                i = j
            else:
                tokens.append(ch)
                i += 1
        return tokens

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        tok = self._peek()
        if tok is None:
            raise ValueError("unexpected end of expression")
        self.pos += 1
        return tok

    def parse(self) -> float:
        value = self._expr(depth=0)
        if self._peek() is not None:
            raise ValueError(f"unexpected {self._peek()!r}")
        return value

    def _expr(self, depth: int) -> float:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self._term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self, depth: int) -> float:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self._take()
            rhs = self._factor(depth)
            if op == "/" and rhs == 0:
                raise ValueError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def _factor(self, depth: int) -> float:
        if depth > 64:
            raise ValueError("expression nested too deeply")
        tok = self._take()
        if tok in ("+", "-"):
            value = self._factor(depth + 1)
            return value if tok == "+" else -value
        if tok == "(":
            value = self._expr(depth + 1)
            if self._take() != ")":
                raise ValueError("missing ')'")
            return value
        if tok[0].isdigit() or tok[0] == ".":
            return float(tok)
        raise ValueError(f"unexpected {tok!r}")


def calculate(expression: str) -> str:
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    bad = sorted(set(expression) - _ALLOWED)
    if bad:
        raise ValueError(f"invalid characters in expression: {''.join(bad)!r}")
    value = _Arithmetic(expression).parse()
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("result is not a finite number")
    return str(round(value, 2))


def run_general_tool(call: ToolCall) -> Observation | None:
    """The observation for a general tool, or None if `call` names no general tool."""
    if call.name not in GENERAL_TOOL_NAMES:
        return None
    param = {"think": "thought", "calculate": "expression", TRANSFER_TOOL: "summary"}[call.name]
    extra = sorted(set(call.arguments) - {param})
    if param not in call.arguments or extra:
        return Observation(f"Error: {call.name} takes exactly one argument, {param!r}", error=True)
    if call.name == "think":
        return Observation("")
    if call.name == TRANSFER_TOOL:
        return Observation("Transfer successful", done=True)
    try:
        return Observation(calculate(call.arguments[param]))
    except ValueError as exc:
        return Observation(f"Error: {exc}", error=True)
