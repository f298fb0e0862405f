"""A connection to one MCP server, over stdio or streamable HTTP, on a private event-loop
thread: the MCP SDK is async while `EnvSession.step()` is sync, so a call blocks on the
loop, bounded by a per-call timeout."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import tempfile
import threading
from typing import Any

import httpx2
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from muajax.domains.base import Observation
from muajax.domains.mcp.config import McpError, McpServerConfig


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
    """A sync handle on one MCP server (a process over stdio, or an HTTP endpoint), its
    connection on a private loop thread."""

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
            verb = "failed to start" if config.transport == "stdio" else "could not be reached"
            raise McpError(f"MCP server {config.describe()!r} {verb} ({reason})"
                           + (f"; its stderr ends with:\n{stderr}" if stderr else "")) from exc

    async def _connection(self, ready: concurrent.futures.Future) -> None:
        # stdio_client and ClientSession are anyio contexts: they must be entered and
        # left in one task, so this task holds them open until close() sets the stop
        # event. Startup is abandoned through that event too, never by cancelling this
        # task: a cancel landing while the SDK spawns the server would leak the process.
        try:
            async with (self._transport() as (read, write),
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

    @contextlib.asynccontextmanager
    async def _transport(self):
        c = self.config
        if c.transport == "stdio":
            params = StdioServerParameters(command=c.expanded_command(), args=c.expanded_args(),
                                           env=c.resolved_env(), cwd=c.cwd)
            async with stdio_client(params, errlog=self._errlog) as (read, write):
                yield read, write
            return
        # The read timeout bounds one HTTP response; tool calls have their own, shorter one.
        timeout = httpx2.Timeout(c.startup_timeout, read=max(c.startup_timeout, c.call_timeout) + 5.0)
        async with (httpx2.AsyncClient(headers=c.resolved_headers(), timeout=timeout) as http,
                    streamable_http_client(c.url, http_client=http) as (read, write)):
            yield read, write

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
        """End the connection (a stdio server is stopped: stdin closed, then SIGTERM/SIGKILL
        per the SDK; an HTTP session is terminated) and the loop thread."""
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
