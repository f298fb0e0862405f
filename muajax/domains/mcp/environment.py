"""Any MCP server (stdio or streamable HTTP) as a muajax `Environment`.

The tools are whatever the server lists (plus muajax's general think / calculate /
transfer_to_human_agents, unless the server has a tool of that name: then the server's
runs, and a successful `transfer_to_human_agents` still ends the episode). The MCP SDK
is async while `EnvSession.step()` is sync, so each `McpClient` runs its connection on
a private event-loop thread and `step()` blocks on the call, bounded by a per-call
timeout. By default every session opens its own connection: over stdio that is its own
server process (isolated state); over HTTP its own MCP session, whose state is isolated
only as far as the server keys it by session. `shared: true` makes all sessions of an
environment use one connection.

The scenario file format is in `muajax.domains.mcp.scenario`; a run config's `env.mcp`
section (`muajax.domains.mcp.config.McpConfig`) names servers and scenario files, and
`environment_from_config` builds the domain from it.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import threading
from collections.abc import Mapping
from typing import Any, Self

from muajax.domains.base import Environment, EnvSession, Evaluation, Observation, Task, ToolCall
from muajax.domains.combined import CombinedEnvironment
from muajax.domains.general_tools import GENERAL_TOOL_SCHEMAS, TRANSFER_TOOL, run_general_tool
from muajax.domains.mcp.client import McpClient
from muajax.domains.mcp.config import McpConfig
from muajax.domains.mcp.scenario import SPLITS, McpScenario, McpTaskSpec, load_scenario


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

    def __init__(self, scenario: McpScenario | str | os.PathLike, *, shared: bool | None = None,
                 servers: McpConfig | None = None):
        """`servers`: the named servers a scenario file may refer to (a run's env.mcp)."""
        self.scenario = scenario if isinstance(scenario, McpScenario) else load_scenario(scenario, servers)
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


def environment_from_config(cfg: McpConfig) -> Environment:
    """The MCP domain of a run config's `env.mcp`: one environment per scenario file, trained
    together when there are several (each task under its own scenario's policy and server)."""
    if not cfg.scenarios:
        raise ValueError("env.mcp.scenarios: list at least one scenario file")
    envs = [McpEnvironment(path, servers=cfg) for path in cfg.scenarios]
    return envs[0] if len(envs) == 1 else CombinedEnvironment(envs)
