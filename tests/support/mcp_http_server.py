"""The demo notes server (mcp_demo_server.py) over streamable HTTP, in a background thread of
the test process: uvicorn on 127.0.0.1, on a socket bound to a free port. With `api_key`,
every request must carry `X-Api-Key: <api_key>` (else 401), so a test can check that
headers reach the server."""
from __future__ import annotations

import socket
import threading
import time
from typing import Self

import uvicorn
from starlette.responses import JSONResponse

from tests.support.workers import mcp_demo_server


class _RequireKey:
    """ASGI middleware: HTTP requests without the right X-Api-Key header get 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key
        self.rejected = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and dict(scope["headers"]).get(b"x-api-key", b"").decode() != self.key:
            self.rejected += 1
            await JSONResponse({"error": "bad or missing X-Api-Key"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class NotesHttpServer:
    def __init__(self, api_key: str | None = None):
        app = mcp_demo_server.server.streamable_http_app()
        self.app = _RequireKey(app, api_key) if api_key is not None else app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     lifespan="on", timeout_graceful_shutdown=1,
                                                     log_config=None))  # see tests/support/openai_server.py
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"mcp-http-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def __enter__(self) -> Self:
        mcp_demo_server._notes.clear()  # the store lives in this process: start each server empty
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the MCP HTTP test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
