"""Any MCP server (stdio transport) as a muajax `Environment`.

The tools are whatever the server lists (plus muajax's general think / calculate /
transfer_to_human_agents, unless the server has a tool of that name: then the server's
runs, and a successful `transfer_to_human_agents` still ends the episode). The MCP SDK
is async while `EnvSession.step()` is sync, so each `McpClient` runs its connection on
a private event-loop thread and `step()` blocks on the call, bounded by a per-call
timeout. By default every session starts its own server process (isolated state);
`shared: true` makes all sessions of an environment use one process.

Scenario file (JSON, or YAML by a .yaml/.yml extension)::

    name: notes                          # the environment's name
    policy: "You manage the user's notes..."   # or policy_file: path (relative to this file)
    server:
      command: "{python}"                # {python} = this interpreter
      args: ["{scenario_dir}/server.py"] # {scenario_dir} = this file's directory
      env: {API_TOKEN: "${API_TOKEN}"}   # ${NAME} is read from muajax's environment
      cwd: "{scenario_dir}"              # optional
      shared: false                      # one server for all sessions (state not isolated)
      call_timeout: 30                   # seconds per tool call
      startup_timeout: 60
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

The reward is 1 iff every criterion holds (each expected call, each state check, and,
with communicate_info on, each string); the partial score is the fraction that hold.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from mcp import ClientSession, StdioServerParameters, stdio_client

from muajax.envs.base import Environment, EnvSession, Evaluation, Observation, Task, ToolCall
from muajax.envs.general_tools import GENERAL_TOOL_SCHEMAS, TRANSFER_TOOL, run_general_tool

SPLITS = ("train", "test")
_CHECK_KEYS = ("equals", "contains", "not_contains", "json", "error")
_ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class McpError(RuntimeError):
    """An MCP server could not be started or a scenario is invalid."""


@dataclasses.dataclass(frozen=True)
class McpServerConfig:
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    shared: bool = False
    call_timeout: float = 30.0
    startup_timeout: float = 60.0

    def __post_init__(self):
        if not self.command:
            raise ValueError("server.command must be a non-empty string")
        if self.call_timeout <= 0 or self.startup_timeout <= 0:
            raise ValueError("server.call_timeout and server.startup_timeout must be positive")


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


def _server_config(d: Any, base: Path) -> McpServerConfig:
    where = "server"
    if not isinstance(d, dict):
        raise McpError(f"{where}: expected a mapping")
    env = {}
    for key, value in _get(d, "env", dict, where, {}).items():
        if not isinstance(value, str):
            raise McpError(f"{where}.env.{key}: expected a string")
        ref = _ENV_REF.match(value)
        if ref:
            if ref.group(1) not in os.environ:
                raise McpError(f"{where}.env.{key}: ${{{ref.group(1)}}} is not set in the environment")
            value = os.environ[ref.group(1)]
        env[str(key)] = value
    args = _get(d, "args", list, where, [])
    if not all(isinstance(a, str) for a in args):
        raise McpError(f"{where}.args: expected a list of strings")
    cwd = _get(d, "cwd", str, where, None)
    try:
        return McpServerConfig(
            command=_expand(_get(d, "command", str, where), base),
            args=tuple(_expand(a, base) for a in args),
            env=env,
            cwd=_expand(cwd, base) if cwd else None,
            shared=_get(d, "shared", bool, where, False),
            call_timeout=float(_get(d, "call_timeout", (int, float), where, 30.0)),
            startup_timeout=float(_get(d, "startup_timeout", (int, float), where, 60.0)),
        )
    except ValueError as exc:
        raise McpError(str(exc)) from exc


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


def load_scenario(path: str | os.PathLike) -> McpScenario:
    """Parse and validate a scenario file (format in the module docstring)."""
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
    return McpScenario(name, policy, _server_config(data.get("server"), base), specs)


# --- the client --------------------------------------------------------------------------
def _observation(result: Any) -> Observation:
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and getattr(block.resource, "text", None) is not None:
            parts.append(block.resource.text)
        elif kind in ("resource", "resource_link"):
            parts.append(f"[resource {getattr(block, 'uri', None) or getattr(block.resource, 'uri', '')}]")
        else:
            parts.append(f"[{kind} content: {getattr(block, 'mime_type', 'unknown type')}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    content = "\n".join(parts)
    if result.is_error and not content.startswith("Error"):
        content = f"Error: {content}"
    return Observation(content, error=bool(result.is_error))


class McpClient:
    """A sync handle on one MCP server process, its connection on a private loop thread."""

    def __init__(self, config: McpServerConfig):
        self.config = config
        self._closed = False
        self._close_lock = threading.Lock()
        self._session: ClientSession | None = None
        # The server's stderr goes to a temp file: quoted when the server fails to start.
        self._errlog = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self._stop = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="muajax-mcp", daemon=True)
        self._thread.start()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._main = asyncio.run_coroutine_threadsafe(self._connection(ready), self._loop)
        try:
            self.tools = ready.result(timeout=config.startup_timeout)
        except BaseException as exc:
            reason = "timed out" if isinstance(exc, concurrent.futures.TimeoutError) else f"{type(exc).__name__}: {exc}"
            stderr = self._stderr_tail()
            self.close()
            raise McpError(f"MCP server {config.command!r} failed to start ({reason})"
                           + (f"; its stderr ends with:\n{stderr}" if stderr else "")) from exc

    async def _connection(self, ready: concurrent.futures.Future) -> None:
        # stdio_client and ClientSession are anyio contexts: they must be entered and
        # left in one task, so this task holds them open until close() sets the stop
        # event. Startup is abandoned through that event too, never by cancelling this
        # task: a cancel landing while the SDK spawns the server would leak the process.
        params = StdioServerParameters(command=self.config.command, args=list(self.config.args),
                                       env=dict(self.config.env) or None, cwd=self.config.cwd)
        try:
            async with (stdio_client(params, errlog=self._errlog) as (read, write),
                        ClientSession(read, write, read_timeout_seconds=self.config.startup_timeout) as session):
                handshake = asyncio.ensure_future(_handshake(session))
                stopping = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait({handshake, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not handshake.done():
                    handshake.cancel()
                    await asyncio.gather(handshake, return_exceptions=True)
                    raise McpError("closed before the server finished starting")
                self._session = session
                ready.set_result(handshake.result())
                await stopping
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise
        finally:
            self._session = None

    def _stderr_tail(self, limit: int = 2000) -> str:
        try:
            self._errlog.flush()
            self._errlog.seek(0)
            return self._errlog.read()[-limit:].strip()
        except (OSError, ValueError):
            return ""

    def call(self, name: str, arguments: dict[str, Any], timeout: float | None = None) -> Observation:
        """Run one tool; every failure (timeout, dead server, protocol error) is an error Observation."""
        timeout = self.config.call_timeout if timeout is None else timeout
        session = self._session
        if self._closed or session is None:
            return Observation("Error: the MCP server connection is closed", error=True)
        future = asyncio.run_coroutine_threadsafe(
            session.call_tool(name, arguments, read_timeout_seconds=timeout), self._loop)
        try:
            # The SDK enforces the timeout itself; the margin only guards a wedged loop.
            result = future.result(timeout=timeout + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return Observation(f"Error: tool {name!r} timed out after {timeout:g} s", error=True)
        except Exception as exc:  # noqa: BLE001 - step() must never raise
            message = str(exc) or type(exc).__name__
            if "timed out" in message.lower() or "timeout" in message.lower():
                return Observation(f"Error: tool {name!r} timed out after {timeout:g} s", error=True)
            return Observation(f"Error: {message}", error=True)
        return _observation(result)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the server (stdin closed, then SIGTERM/SIGKILL per the SDK) and the loop thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._main.result(timeout=20.0)  # the SDK's own shutdown is bounded by ~6 s
        except BaseException:  # noqa: BLE001 - a failed connection ends here too
            self._main.cancel()
        try:
            asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(timeout=10.0)
        except BaseException:  # noqa: BLE001 - best effort: the loop is being torn down
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._errlog.close()


async def _handshake(session: ClientSession) -> list[Any]:
    await session.initialize()
    tools, cursor = [], None
    while True:
        page = await session.list_tools(params=None if cursor is None else _page(cursor))
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


def _page(cursor: str) -> Any:
    from mcp.types import PaginatedRequestParams
    return PaginatedRequestParams(cursor=cursor)


async def _cancel_pending() -> None:
    current = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _argument_error(schema: Mapping[str, Any], arguments: dict[str, Any]) -> str | None:
    """Missing required or undeclared arguments. Undeclared ones are rejected (unlike
    JSON Schema's default) as τ2's Python tools reject them: a model inventing
    parameters should learn that it did."""
    missing = [k for k in schema.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    props = schema.get("properties")
    if isinstance(props, dict) and not schema.get("additionalProperties"):
        extra = sorted(set(arguments) - set(props))
        if extra:
            return f"unexpected argument(s): {', '.join(extra)}; expected: {', '.join(props) or 'none'}"
    return None


# --- environment and sessions ------------------------------------------------------------
class McpSession(EnvSession):
    """One rollout against an MCP server: its own process unless the server is shared."""

    def __init__(self, spec: McpTaskSpec, client: McpClient, *, owns_client: bool):
        self.task = spec.task
        self._spec = spec
        self._client = client
        self._owns_client = owns_client
        self._server_tools = {t.name: t for t in client.tools}
        self._lock = threading.Lock()
        self._executed: list[tuple[ToolCall, bool]] = []  # (call, ran without error)

    def tools(self) -> list[dict[str, Any]]:
        schemas = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                     "parameters": copy.deepcopy(t.input_schema)}}
                   for t in self._server_tools.values()]
        return schemas + [copy.deepcopy(s) for s in GENERAL_TOOL_SCHEMAS
                          if s["function"]["name"] not in self._server_tools]

    def step(self, call: ToolCall) -> Observation:
        if not isinstance(call, ToolCall) or not isinstance(call.name, str):
            return Observation("Error: expected a ToolCall with a name", error=True)
        if not isinstance(call.arguments, dict):
            return Observation(f"Error: arguments of {call.name!r} must be a JSON object", error=True)
        tool = self._server_tools.get(call.name)
        if tool is None:
            general = run_general_tool(call)
            if general is not None:
                return general
            names = sorted(self._server_tools) + [s["function"]["name"] for s in GENERAL_TOOL_SCHEMAS
                                                  if s["function"]["name"] not in self._server_tools]
            return Observation(f"Error: unknown tool {call.name!r}. Available tools: {', '.join(names)}", error=True)
        problem = _argument_error(tool.input_schema or {}, call.arguments)
        if problem:
            return Observation(f"Error: {call.name}: {problem}", error=True)
        obs = self._client.call(call.name, copy.deepcopy(call.arguments))
        with self._lock:
            self._executed.append((ToolCall(call.name, copy.deepcopy(call.arguments), call.call_id), not obs.error))
        if call.name == TRANSFER_TOOL and not obs.error:
            return Observation(obs.content, done=True)
        return obs

    def evaluate(self, messages: list[dict[str, Any]], *, communicate_info: bool) -> Evaluation:
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        if self._spec.state_checks and self._client.closed:
            raise RuntimeError("evaluate() runs state checks on the live server: call it before close()")
        with self._lock:
            executed = list(self._executed)
        details: dict[str, Any] = {}
        expected = [any(ok and c.name == e.name and all(k in c.arguments and c.arguments[k] == v
                                                        for k, v in e.arguments.items())
                        for c, ok in executed)
                    for e in self._spec.expected_calls]
        details["expected_calls_met"] = expected
        states = []
        for check in self._spec.state_checks:
            obs = self._client.call(check.call.name, dict(check.call.arguments))
            states.append(check.holds(obs))
        details["state_checks_met"] = states
        criteria = expected + states
        if communicate_info:
            said = " ".join(_assistant_text(messages)).lower().replace(",", "")
            communicated = [info.lower() in said for info in self._spec.communicate_info]
            details["communicated"] = communicated
            criteria += communicated
        reward = 1.0 if all(criteria) else 0.0
        partial = sum(criteria) / len(criteria) if criteria else 1.0
        return Evaluation(reward, partial, details)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


def _assistant_text(messages: list[dict[str, Any]]) -> list[str]:
    """Assistant text, matched the way τ2's communicate check does (commas ignored)."""
    texts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict")
        content = message.get("content")
        if message.get("role") != "assistant" or content is None:
            continue
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        texts.append(str(content))
    return texts


class McpEnvironment(Environment):
    """Tasks from a scenario file; tools from its MCP server. Call close() when done."""

    def __init__(self, scenario: McpScenario | str | os.PathLike, *, shared: bool | None = None):
        self.scenario = scenario if isinstance(scenario, McpScenario) else load_scenario(scenario)
        if shared is not None:
            self.scenario = dataclasses.replace(
                self.scenario, server=dataclasses.replace(self.scenario.server, shared=shared))
        self.name = self.scenario.name
        self._specs = {s.task.task_id: s for s in self.scenario.tasks}
        self._shared: McpClient | None = None
        self._lock = threading.Lock()

    def policy(self) -> str:
        return self.scenario.policy

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [s.task for s in self.scenario.tasks if s.task.split == split]

    def reset(self, task: Task) -> McpSession:
        spec = self._specs.get(task.task_id) if isinstance(task, Task) else None
        if spec is None or task.domain != self.name:
            raise ValueError(f"task {getattr(task, 'task_id', task)!r} is not a task of MCP scenario {self.name!r}")
        if not self.scenario.server.shared:
            return McpSession(spec, McpClient(self.scenario.server), owns_client=True)
        with self._lock:
            if self._shared is None or self._shared.closed:
                self._shared = McpClient(self.scenario.server)
            return McpSession(spec, self._shared, owns_client=False)

    def close(self) -> None:
        """Stop the shared server, if one was started (per-session servers stop with their session)."""
        with self._lock:
            if self._shared is not None:
                self._shared.close()
                self._shared = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
