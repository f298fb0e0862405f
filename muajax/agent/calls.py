"""Where one assistant message goes: parse it, check its tool call against the tools the
agent was shown, and route it to the environment, the user, or the end of the episode.

Routing (`route_assistant`) is a pure function of the sampled text: a message with a tool
call, or a failed attempt at one, goes to the environment; plain text goes to the
simulated user. Of a message's calls only the first runs (MUA-RL's training rollout), or
with `execute_all_calls` every one, in order (τ2's orchestrator, BFCL's parallel calls).
A malformed call (unparseable, unknown tool, arguments that break the tool's schema) is
counted; with `end_on_malformed_call` it ends the episode unexecuted, otherwise a parse
error gets `format_tool_error` as its observation and a schema violation runs through the
environment, whose own error the agent sees. The message's `tool_calls` list every
parsed call; only the ones that ran get a tool message, which is how evaluators that
replay calls (τ2's) tell them apart.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from muajax.agent import trajectory as tr
from muajax.agent.assistant_format import parse_assistant
from muajax.agent.chat import format_tool_error
from muajax.domains.base import EnvSession, Observation, ToolCall
from muajax.models.tokenizer import strip_control_tokens

log = logging.getLogger(__name__)

TOOL, USER, END = "tool", "user", "end"
UNKNOWN_TOOL = "<unknown>"  # one counter bucket for invented names, so garbage cannot grow the Counter


def safe_text(text: Any) -> str:
    """Text that is safe to tokenize as a turn: a str, no chat control tokens, valid UTF-8."""
    text = text if isinstance(text, str) else str(text)
    return strip_control_tokens(text.encode("utf-8", "replace").decode("utf-8"))


def tool_schemas(session: EnvSession) -> dict[str, dict[str, Any]]:
    """{name: function schema} of the agent's tools."""
    fns = (schema.get("function", schema) for schema in session.tools() if isinstance(schema, dict))
    return {fn["name"]: fn for fn in fns if isinstance(fn, dict) and isinstance(fn.get("name"), str)}


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _is(value: Any, name: str) -> bool:
    # JSON true is not a number, although Python's bool is an int
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES[name]) or (name == "integer" and isinstance(value, float)
                                                     and value.is_integer())


def _type_ok(value: Any, spec: Any) -> bool:
    kind = spec.get("type") if isinstance(spec, dict) else None
    names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if not names or any(n not in _JSON_TYPES for n in names):
        return True  # anyOf / $ref / untyped / exotic: not judged here, the environment will
    return any(_is(value, n) for n in names)


def _json_type(value: Any) -> str:
    return next((name for name in _JSON_TYPES if _is(value, name)), type(value).__name__)


def _short(text: str, limit: int = 60) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def check_call(call: ToolCall, schemas: Mapping[str, dict[str, Any]]) -> str | None:
    """Why `call` breaks the contract the agent was shown (unknown tool, a missing or
    unexpected argument, a wrong JSON type), or None. Conservative: only plain JSON-schema
    `type`s are checked, anything fancier is left to the environment."""
    fn = schemas.get(call.name)
    if fn is None:
        names = ", ".join(sorted(schemas)[:30])
        return f"unknown tool {_short(call.name)}; the tools are: {names}"
    params = fn.get("parameters")
    if not isinstance(params, dict):
        return None
    props = params.get("properties")
    props = props if isinstance(props, dict) else None
    required = params.get("required") if isinstance(params.get("required"), list) else []
    missing = [r for r in required if isinstance(r, str) and r not in call.arguments]
    if missing:
        return f"{call.name}: missing required argument(s) {', '.join(map(repr, missing))}"
    if props is not None:
        if params.get("additionalProperties", False) is False:
            extra = sorted(k for k in call.arguments if k not in props)
            if extra:
                return f"{call.name}: unexpected argument(s) {', '.join(_short(k, 40) for k in extra[:5])}"
        for key, value in call.arguments.items():
            if key in props and not _type_ok(value, props[key]):
                return (f"{call.name}: argument {key!r} must be {props[key].get('type')}, "
                        f"got {_json_type(value)}")
    return None


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one assistant message goes. kind TOOL: run `calls` in order, or (none) answer
    with `error_observation`; USER: send `user_text`; END: the episode is over (`termination`)."""

    kind: str
    message: dict[str, Any]  # the assistant message for the transcript
    calls: tuple[ToolCall, ...] = ()  # the calls to run, in order
    call_ids: tuple[str, ...] = ()  # their ids in `message["tool_calls"]`
    error_observation: str | None = None
    user_text: str | None = None
    malformed: str | None = None  # why the (first) malformed call was malformed (counted either way)
    malformed_count: int = 0
    termination: str | None = None

    @property
    def call(self) -> ToolCall | None:
        return self.calls[0] if self.calls else None

    @property
    def call_id(self) -> str | None:
        return self.call_ids[0] if self.call_ids else None


def _assistant_message(content: str, calls: Sequence[ToolCall] = (), id_prefix: str = "call") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"{id_prefix}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]
    return message


def route_assistant(text: str, finish_reason: str, schemas: Mapping[str, dict[str, Any]], *,
                    end_on_malformed_call: bool = False, id_prefix: str = "call",
                    execute_all_calls: bool = False) -> Route:
    """Route one decoded assistant message (without its `<|im_end|>`). Never raises."""
    parsed = parse_assistant(text)
    content = parsed.content
    if finish_reason == "context":
        return Route(END, _assistant_message(content), termination=tr.CONTEXT)
    if parsed.error is not None:
        if end_on_malformed_call:
            return Route(END, _assistant_message(content), malformed=parsed.error, malformed_count=1,
                         termination=tr.MALFORMED_CALL)
        return Route(TOOL, _assistant_message(content), error_observation=format_tool_error(parsed.error),
                     malformed=parsed.error, malformed_count=1)
    if parsed.tool_calls:
        calls = tuple(parsed.tool_calls if execute_all_calls else parsed.tool_calls[:1])
        problems = [p for p in (check_call(c, schemas) for c in calls) if p is not None]
        problem = problems[0] if problems else None
        if problem is not None and end_on_malformed_call:
            return Route(END, _assistant_message(content), malformed=problem, malformed_count=len(problems),
                         termination=tr.MALFORMED_CALL)
        message = _assistant_message(content, parsed.tool_calls, id_prefix)
        ids = tuple(c["id"] for c in message["tool_calls"][: len(calls)])
        return Route(TOOL, message, calls=calls, call_ids=ids, malformed=problem, malformed_count=len(problems))
    return Route(USER, _assistant_message(content), user_text=content)


def execute_tool(session: EnvSession, call: ToolCall) -> Observation:
    """`session.step(call)`; an environment that raises (a bug: step must not) gets its error
    turned into an observation, so one broken tool cannot take down a batch."""
    try:
        obs = session.step(call)
        if not isinstance(obs, Observation):
            raise TypeError(f"step returned {type(obs).__name__}, not an Observation")
        return obs
    except Exception as e:
        log.exception("tool %r raised", call.name)
        return Observation(f"Error: tool {call.name} failed: {type(e).__name__}: {e}", error=True)



def execute_tools(session: EnvSession, calls: Sequence[ToolCall]) -> list[Observation]:
    """`session.step_calls(calls)`: one observation per call that ran, in order (at least
    one). An environment that raises gets its error turned into one observation, as in
    `execute_tool`."""
    names = ", ".join(c.name for c in calls)
    try:
        observations = session.step_calls(list(calls))
        if not isinstance(observations, list) or not 1 <= len(observations) <= len(calls) or not all(
                isinstance(obs, Observation) for obs in observations):
            raise TypeError(f"step_calls must return 1 to {len(calls)} Observations, got {observations!r:.200}")
        return observations
    except Exception as e:
        log.exception("tools %s raised", names)
        return [Observation(f"Error: tool {names} failed: {type(e).__name__}: {e}", error=True)]
