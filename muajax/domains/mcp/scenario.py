"""MCP scenario files: the server to use, the tasks and how each is judged.

Scenario file (JSON, or YAML by a .yaml/.yml extension)::

    name: notes                          # the environment's name
    policy: "You manage the user's notes..."   # or policy_file: path (relative to this file)
    server:                              # or the name of a server in the run's env.mcp.servers
      command: "{python}"                # {python} = this interpreter
      args: ["{scenario_dir}/server.py"] # {scenario_dir} = this file's directory
      env: {API_TOKEN: "${API_TOKEN}"}   # ${NAME} is read from muajax's environment: the one way
                                         # to hand the server a secret (a literal one here, or a
                                         # credential in command/args/cwd, is refused)
      env_vars: [HOME]                   # muajax's variables passed on by name
      cwd: "{scenario_dir}"              # optional
      shared: false                      # one server for all sessions (state not isolated)
      call_timeout: 30                   # seconds per tool call
      startup_timeout: 60
    # or, over streamable HTTP: server: {url: "http://127.0.0.1:8000/mcp",
    #                                    headers_env: {Authorization: MCP_AUTH_HEADER}}
    tasks:
      - id: groceries
        split: train                     # or test
        first_user_message: "Hi, can you save my grocery list?"
        user_scenario: "You want a note titled 'groceries' with milk and eggs..."
        gold_actions:                    # optional: a reference solution
          - {name: add_note, arguments: {title: groceries, body: "milk, eggs"}}
        evaluation:
          expected_calls:                # each must have run without error in the session;
            - {name: add_note, arguments: {title: groceries}}   # arguments match as a subset
          state_checks:                  # read-tool calls run at evaluation time
            - call: {name: get_note, arguments: {title: groceries}}
              contains: [milk, eggs]     # case-insensitive substrings; also: not_contains,
                                         # equals (exact, stripped), json (parsed equality),
                                         # error (true: the call must fail; default false)
          communicate_info: ["2 items"]  # said by the agent; checked only with communicate_info

The server's fields are those of `muajax.domains.mcp.config.McpServerConfig`. The reward is
1 iff every criterion holds (each expected call, each state check, and, with
communicate_info on, each string); the partial score is the fraction that hold.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from muajax.settings.fields import ConfigError
from muajax.domains.base import Observation, Task, ToolCall
from muajax.domains.mcp.config import McpConfig, McpError, McpServerConfig, credential_problems

__all__ = ["SPLITS", "McpError", "McpServerConfig", "McpScenario", "McpTaskSpec", "StateCheck", "load_scenario"]

SPLITS = ("train", "test")
_CHECK_KEYS = ("equals", "contains", "not_contains", "json", "error")
_SERVER_KEYS = ("command", "args", "cwd", "env", "env_vars", "url", "headers_env", "shared", "call_timeout",
                "startup_timeout")


@dataclasses.dataclass(frozen=True)
class StateCheck:
    call: ToolCall
    expect: Mapping[str, Any]  # a subset of _CHECK_KEYS

    def holds(self, obs: Observation) -> bool:
        expect = self.expect
        if obs.error != bool(expect.get("error", False)):
            return False
        text = obs.content.lower()
        if any(s.lower() not in text for s in expect.get("contains", ())):
            return False
        if any(s.lower() in text for s in expect.get("not_contains", ())):
            return False
        if "equals" in expect and obs.content.strip() != expect["equals"].strip():
            return False
        if "json" in expect:
            try:
                return json.loads(obs.content) == expect["json"]
            except json.JSONDecodeError:
                return False
        return True


@dataclasses.dataclass(frozen=True)
class McpTaskSpec:
    task: Task
    expected_calls: tuple[ToolCall, ...]
    state_checks: tuple[StateCheck, ...]
    communicate_info: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class McpScenario:
    name: str
    policy: str
    server: McpServerConfig
    tasks: tuple[McpTaskSpec, ...]


# --- scenario loading ------------------------------------------------------------------
def _get(d: Mapping, key: str, kind: type | tuple, where: str, default: Any = ...) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise McpError(f"{where}: missing {key!r}")
        return default
    value = d[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float, (int, float)):
        raise McpError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _tool_call(d: Any, where: str) -> ToolCall:
    if not isinstance(d, dict):
        raise McpError(f"{where}: expected a mapping with 'name' and 'arguments'")
    return ToolCall(_get(d, "name", str, where), dict(_get(d, "arguments", dict, where, {})))


def _strings(value: Any, where: str) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise McpError(f"{where}: expected a string or a list of strings")
    return tuple(value)


def _state_check(d: Any, where: str) -> StateCheck:
    if not isinstance(d, dict):
        raise McpError(f"{where}: expected a mapping")
    unknown = sorted(set(d) - {"call", *_CHECK_KEYS})
    if unknown:
        raise McpError(f"{where}: unknown keys {unknown}; allowed: call, {', '.join(_CHECK_KEYS)}")
    expect: dict[str, Any] = {}
    for key in ("contains", "not_contains"):
        if key in d:
            expect[key] = _strings(d[key], f"{where}.{key}")
    if "equals" in d:
        expect["equals"] = _get(d, "equals", str, where)
    if "json" in d:
        expect["json"] = d["json"]
    if "error" in d:
        expect["error"] = _get(d, "error", bool, where)
    return StateCheck(_tool_call(d.get("call"), f"{where}.call"), expect)


def _expand(text: str, base: Path) -> str:
    return text.replace("{python}", sys.executable).replace("{scenario_dir}", str(base))


def _refuse_credentials(d: Mapping, where: str) -> None:
    """Secrets reach a server only through `env` as ${NAME}: a scenario file is shared, and
    a command line is visible to every process on the host and ends up in logs."""
    for field, what in credential_problems(d):
        raise McpError(f"{where}.{field} {what}")


def _string_map(d: Mapping, key: str, where: str) -> dict[str, str]:
    out = {}
    for name, value in _get(d, key, dict, where, {}).items():
        if not isinstance(value, str):
            raise McpError(f"{where}.{key}.{name}: expected a string")
        out[str(name)] = value
    return out


def _server_mapping(d: dict, base: Path) -> McpServerConfig:
    """A scenario's own `server:` mapping ({scenario_dir} and {python} expanded)."""
    where = "server"
    unknown = sorted(set(d) - set(_SERVER_KEYS))
    if unknown:
        raise McpError(f"{where}: unknown keys {unknown}; allowed: {', '.join(_SERVER_KEYS)}")
    _refuse_credentials(d, where)
    args = _get(d, "args", list, where, [])
    env_vars = _get(d, "env_vars", list, where, [])
    if not all(isinstance(a, str) for a in args + env_vars):
        raise McpError(f"{where}.args and {where}.env_vars: expected lists of strings")
    cwd = _get(d, "cwd", str, where, None)
    command = _get(d, "command", str, where, None)
    try:
        return McpServerConfig(
            command=_expand(command, base) if command is not None else None,
            args=tuple(_expand(a, base) for a in args), cwd=_expand(cwd, base) if cwd else None,
            env=_string_map(d, "env", where), env_vars=tuple(env_vars), url=_get(d, "url", str, where, None),
            headers_env=_string_map(d, "headers_env", where), shared=_get(d, "shared", bool, where, False),
            call_timeout=float(_get(d, "call_timeout", (int, float), where, 30.0)),
            startup_timeout=float(_get(d, "startup_timeout", (int, float), where, 60.0)))
    except ConfigError as exc:
        raise McpError(f"{where}: {exc}") from None


def _server_config(d: Any, base: Path, servers: McpConfig) -> McpServerConfig:
    """The scenario's server: its own mapping, a name from `env.mcp.servers`, or (none given)
    the only server there is."""
    if isinstance(d, str):
        server = servers.server(d, "server")
    elif isinstance(d, dict):
        server = _server_mapping(d, base)
    elif d is None and servers.default_server() is not None:
        server = servers.default_server()
    else:
        names = ", ".join(sorted(servers.servers)) or "none defined"
        raise McpError(f"server: expected a mapping (command or url) or the name of a server in "
                       f"env.mcp.servers ({names})")
    missing = server.missing_variables()
    if missing:
        raise McpError(f"server: the environment variable(s) {', '.join(missing)} it reads are not set")
    return server


def _task_spec(d: Any, index: int, env_name: str) -> McpTaskSpec:
    where = f"tasks[{index}]"
    if not isinstance(d, dict):
        raise McpError(f"{where}: expected a mapping")
    task_id = _get(d, "id", (str, int), where)
    split = _get(d, "split", str, where, "train")
    if split not in SPLITS:
        raise McpError(f"{where}.split: {split!r} is not one of {SPLITS}")
    ev = _get(d, "evaluation", dict, where)
    unknown = sorted(set(ev) - {"expected_calls", "state_checks", "communicate_info"})
    if unknown:
        raise McpError(f"{where}.evaluation: unknown keys {unknown}")
    expected = tuple(_tool_call(c, f"{where}.evaluation.expected_calls[{i}]")
                     for i, c in enumerate(_get(ev, "expected_calls", list, f"{where}.evaluation", [])))
    checks = tuple(_state_check(c, f"{where}.evaluation.state_checks[{i}]")
                   for i, c in enumerate(_get(ev, "state_checks", list, f"{where}.evaluation", [])))
    if not expected and not checks:
        raise McpError(f"{where}.evaluation: needs at least one expected_calls or state_checks entry")
    info = _strings(ev.get("communicate_info", []), f"{where}.evaluation.communicate_info")
    gold = tuple(_tool_call(c, f"{where}.gold_actions[{i}]")
                 for i, c in enumerate(_get(d, "gold_actions", list, where, [])))
    task = Task(task_id=str(task_id), domain=env_name,
                first_user_message=_get(d, "first_user_message", str, where),
                user_scenario=_get(d, "user_scenario", str, where),
                gold_actions=gold or expected, split=split,
                metadata={"communicate_info": info})
    return McpTaskSpec(task, expected, checks, info)


def load_scenario(path: str | os.PathLike, servers: McpConfig | None = None) -> McpScenario:
    """Parse and validate a scenario file (format in the module docstring); `servers` are the
    run config's named servers a scenario may refer to."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file name
        raise McpError(f"{path}: not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {exc}")
    if not isinstance(data, dict):
        raise McpError(f"{path}: the top level must be a mapping")
    base = path.resolve().parent
    name = _get(data, "name", str, "scenario")
    if "policy_file" in data:
        policy = (base / _get(data, "policy_file", str, "scenario")).read_text(encoding="utf-8")
    else:
        policy = _get(data, "policy", str, "scenario")
    specs = tuple(_task_spec(t, i, name) for i, t in enumerate(_get(data, "tasks", list, "scenario")))
    ids = [s.task.task_id for s in specs]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise McpError(f"{path}: duplicate task ids {dupes}")
    return McpScenario(name, policy, _server_config(data.get("server"), base, servers or McpConfig()), specs)
