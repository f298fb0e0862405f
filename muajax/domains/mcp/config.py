"""How to reach an MCP server, and the `env.mcp` section of a run config.

One `McpServerConfig` serves both a run config (`env.mcp.servers.NAME`) and a scenario
file's `server:` mapping. A server is either launched over stdio (`command`, `args`,
`cwd`, `env_vars`, `env`) or reached over streamable HTTP (`url`, `headers_env`).

Secrets never sit in a config: `env_vars` lists the NAMES of muajax's environment
variables handed to a stdio server (`NAME`, or `SERVER_NAME=NAME` to rename),
`headers_env` maps an HTTP header to the NAME of the variable holding its value, and a
value in `env` written `${NAME}` is read from muajax's environment. All are read when a
connection opens, so a config dump or a checkpoint never holds the values.
`{python}` in `command` or `args` is this interpreter.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import urllib.parse

from muajax.settings.fields import Checked, bounded, check
from muajax.settings.secrets import (argument_credentials, looks_secret_name, redact_arguments, redact_url,
                                   value_credentials)

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}\Z")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def credential_problems(server: dict) -> list[tuple[str, str]]:
    """(field, what) for every secret written into a server's description rather than read
    from muajax's environment: on a command line it is visible to every process on the host
    and ends up in logs, and a config or scenario file is shared."""
    hint = "pass it to the server through 'env' as \"${NAME}\", with the secret in muajax's environment"
    args = server.get("args")
    args = [a if isinstance(a, str) else "" for a in args] if isinstance(args, (list, tuple)) else []
    found = [(f"args[{i}]", f"holds a credential ({what}); {hint}") for i, what in argument_credentials(args)]
    for key in ("command", "cwd", "url"):
        value = server.get(key)
        where = value_credentials(value) if isinstance(value, str) else []
        if where:
            found.append((key, f"holds a credential ({'; '.join(where)}); {hint}"
                          if key != "url" else f"holds a credential ({'; '.join(where)}); send it as a header "
                                               "named in 'headers_env', with the secret in muajax's environment"))
    env = server.get("env")
    for key, value in (env.items() if isinstance(env, dict) else ()):
        literal = isinstance(value, str) and value and not ENV_REF.match(value)
        if literal and (looks_secret_name(str(key)) or value_credentials(value)):
            found.append((f"env.{key}", f"holds a literal secret; write \"${{{key}}}\" (or another variable's "
                                        "name) and set it in muajax's environment"))
    return found


class McpError(RuntimeError):
    """An MCP server could not be started or reached, or a scenario is invalid."""


def _read_env(name: str, where: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise McpError(f"{where}: the environment variable {name} is not set")
    return value


@dataclasses.dataclass(frozen=True)
class McpServerConfig(Checked):
    command: str | None = None  # stdio: the program that serves MCP on its stdin/stdout
    args: tuple[str, ...] = ()  # stdio: the program's arguments
    cwd: str | None = None  # stdio: the server's working directory; None: muajax's
    env_vars: tuple[str, ...] = ()  # NAME or SERVER_NAME=NAME: muajax's variables the server gets
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # stdio: extra variables, literal or "${NAME}"
    url: str | None = None  # streamable HTTP: the server's MCP endpoint (e.g. http://host:8000/mcp)
    headers_env: dict[str, str] = dataclasses.field(default_factory=dict)  # HTTP: header -> NAME of its value
    shared: bool = False  # one connection for every session (the server's state is then shared)
    call_timeout: float = bounded(30.0, gt=0)  # seconds per tool call
    startup_timeout: float = bounded(60.0, gt=0)  # seconds to start (stdio) or connect, and list the tools

    def __repr__(self) -> str:
        # env values may be literals; args and the URL are shown with any credential hidden
        where = f"url={redact_url(self.url)!r}" if self.url is not None else \
            f"command={self.command!r}, args={tuple(redact_arguments(self.args))!r}, cwd={self.cwd!r}"
        env = ", ".join(f"{k!r}: ***" for k in self.env)
        return f"McpServerConfig({where}, env={{{env}}}, env_vars={self.env_vars!r}, shared={self.shared})"

    def validate(self) -> None:
        for field, what in credential_problems(dataclasses.asdict(self)):
            check(False, field, what)
        check((self.command is not None) != (self.url is not None), "command",
              "conflicts with 'url': set exactly one of 'command' (a stdio server) or 'url' (streamable HTTP)"
              if self.command is not None else "or 'url' is required: how to start or reach the server")
        check(self.command != "", "command", "must be a non-empty program name")
        if self.url is not None:
            parsed = urllib.parse.urlsplit(self.url)
            check(parsed.scheme in ("http", "https") and bool(parsed.netloc), "url",
                  f"must be an http(s) URL, got {self.url!r}")
            for field in ("args", "cwd", "env_vars", "env"):
                check(not getattr(self, field), field, "applies only to a stdio server ('command')")
        else:
            check(not self.headers_env, "headers_env", "applies only to an HTTP server ('url')")
        for i, item in enumerate(self.env_vars):
            names = item.split("=", 1)
            check(all(ENV_NAME.match(n) for n in names), f"env_vars[{i}]",
                  f"must be NAME or SERVER_NAME=NAME (environment variable names), got {item!r}")
        for key in self.env:
            check(bool(ENV_NAME.match(key)), f"env.{key}", "is not an environment variable name")
        for header, name in self.headers_env.items():
            check(bool(_HEADER_NAME.match(header)), f"headers_env.{header}", "is not an HTTP header name")
            check(bool(ENV_NAME.match(name)), f"headers_env.{header}",
                  f"must be the NAME of an environment variable holding the header's value, got {name!r}")

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def describe(self) -> str:
        """The server for messages: its command line or URL (never a variable's value)."""
        if self.url is not None:
            return self.url
        return " ".join([self.expanded_command(), *self.expanded_args()])

    def expanded_command(self) -> str:
        return (self.command or "").replace("{python}", sys.executable)

    def expanded_args(self) -> list[str]:
        return [a.replace("{python}", sys.executable) for a in self.args]

    def missing_variables(self) -> list[str]:
        """The environment variables this server reads that are not set (checked up front,
        so a run stops before its first rollout rather than in one)."""
        names = [item.split("=", 1)[-1] for item in self.env_vars]
        names += [m.group(1) for m in map(ENV_REF.match, self.env.values()) if m]
        names += list(self.headers_env.values())
        return [n for n in names if n not in os.environ]

    def resolved_env(self) -> dict[str, str] | None:
        """The stdio server's extra environment (merged by the SDK over a safe default set)."""
        if not (self.env or self.env_vars):
            return None
        out = {}
        for key, value in self.env.items():
            ref = ENV_REF.match(value)
            out[key] = _read_env(ref.group(1), f"MCP server {self.describe()}: env.{key}") if ref else value
        for item in self.env_vars:
            target, _, source = item.rpartition("=")
            out[target or source] = _read_env(source, f"MCP server {self.describe()}: env_vars")
        return out

    def resolved_headers(self) -> dict[str, str]:
        return {header: _read_env(name, f"MCP server {self.url}: headers_env.{header}")
                for header, name in self.headers_env.items()}


@dataclasses.dataclass(frozen=True)
class McpConfig(Checked):
    """`env.mcp`: named servers and the scenario files (format: `muajax.domains.mcp.scenario`).
    A scenario's `server:` is a mapping of its own, or the name of one of `servers`; with
    one server here, a scenario that gives none uses it."""

    servers: dict[str, McpServerConfig] = dataclasses.field(default_factory=dict)  # by name (a scenario's `server:`)
    scenarios: tuple[str, ...] = ()  # scenario files (JSON or YAML): the server, tasks and checks

    def server(self, name: str, where: str) -> McpServerConfig:
        if name not in self.servers:
            known = ", ".join(sorted(self.servers)) or "none"
            raise McpError(f"{where}: server {name!r} is not one of env.mcp.servers ({known})")
        return self.servers[name]

    def default_server(self) -> McpServerConfig | None:
        return next(iter(self.servers.values())) if len(self.servers) == 1 else None

