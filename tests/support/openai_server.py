"""A real, scripted OpenAI-compatible HTTP server for tests.

It serves `POST /v1/chat/completions` (non-streaming, optional tools/tool_calls) and
`GET /v1/models` with uvicorn in a background thread, bound to 127.0.0.1 on a free port.
Replies come from a Python callable, `script(request_json) -> reply`, where a reply is

- a string: the assistant's text, or
- a dict: {"content": str | None, "tool_calls": [{"name": str, "arguments": dict | str}, ...]}.

Knobs (plain attributes, changeable while running) inject faults:

- `fail_first` / `fail_rate`: answer the first N requests / a random share with
  `fail_status` (500 by default; 503 and 429 work too);
- `retry_after`: a `Retry-After` header on those failures (a str as sent, e.g. an HTTP
  date, or seconds), as a rate-limited endpoint answers 429;
- `stall_first` / `stall_rate`: hold the response for `stall_s` seconds, to push clients
  past their timeout;
- `latency_s`, `latency_jitter`, `latency_distribution`: a normal delay for every request,
  which makes concurrency observable, drawn as the scripted users' is (a
  `muajax.domains.latency.ReplyDelay`: mean, standard deviation over the mean, uniform or
  lognormal) from its own stream seeded by `seed`, in order of arrival; `delays` keeps
  each request's draw.

Every request is recorded (`requests`, with its JSON body and headers) and the peak
number of requests in flight is kept in `max_in_flight`. The Authorization header is
recorded too, so a test can check which key a client sent; this is a test fixture and
keeps nothing beyond the process.

    with ScriptedOpenAIServer(lambda req: "hi") as server:
        client = openai.AsyncOpenAI(base_url=server.url, api_key="x")
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from muajax.domains.latency import ReplyDelay

Script = Callable[[dict[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    index: int  # order of arrival among chat-completion requests
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]
    received_at: float
    outcome: str  # "ok", "failed", "stalled", "bad_request", "script_error"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class ScriptedOpenAIServer:
    def __init__(
        self,
        script: Script | None = None,
        *,
        model: str = "scripted-user",
        fail_first: int = 0,
        fail_rate: float = 0.0,
        fail_status: int = 500,
        retry_after: str | float | None = None,
        stall_first: int = 0,
        stall_rate: float = 0.0,
        stall_s: float = 5.0,
        latency_s: float = 0.0,
        latency_jitter: float = 0.0,
        latency_distribution: str = "uniform",
        seed: int = 0,
    ):
        if not 0.0 <= fail_rate <= 1.0 or not 0.0 <= stall_rate <= 1.0:
            raise ValueError("fail_rate and stall_rate are shares in [0, 1]")
        self.script: Script = script or (lambda request: "OK")
        self.model = model
        self.fail_first, self.fail_rate, self.fail_status = fail_first, fail_rate, fail_status
        self.retry_after = retry_after
        self.stall_first, self.stall_rate, self.stall_s = stall_first, stall_rate, stall_s
        self.latency_s, self.latency_jitter, self.latency_distribution = latency_s, latency_jitter, latency_distribution
        ReplyDelay(latency_s, latency_jitter, latency_distribution)  # refuses a bad spec here, not per request
        self._rng = random.Random(seed)
        self._latency_rng = random.Random(f"latency/{seed}")  # the fault draws stay as they were
        self.delays: list[float] = []
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []
        self._chat_count = 0
        self._failed = 0
        self._stalled = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.script_errors: list[str] = []
        self._stopping = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """The OpenAI base URL (ends in /v1)."""
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 10.0) -> ScriptedOpenAIServer:
        if self._thread is not None:
            raise RuntimeError("server already started")
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ])
        # Binding the socket ourselves to port 0 avoids the race of probing for a free port.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        # log_config=None: uvicorn's own dictConfig would close every existing logging handler,
        # and absl's closes its stream, which under pytest's capsys is pytest's capture file.
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1, log_config=None,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"openai-server-{self.port}", daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"scripted OpenAI server did not start on 127.0.0.1:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                raise RuntimeError("scripted OpenAI server did not stop within 10 s")
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ inspection

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"chat": self._chat_count, "failed": self._failed, "stalled": self._stalled}

    # ------------------------------------------------------------------ handlers

    def _record(self, index: int, request: Request, body: Any, outcome: str) -> None:
        with self._lock:
            self._requests.append(RecordedRequest(
                index=index, path=request.url.path, body=body if isinstance(body, dict) else None,
                headers=dict(request.headers), received_at=time.time(), outcome=outcome,
            ))

    async def _models(self, request: Request) -> JSONResponse:
        self._record(-1, request, None, "ok")
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "tests"}]})

    def _decide(self) -> tuple[int, str]:
        with self._lock:
            index = self._chat_count
            self._chat_count += 1
            if index < self.fail_first:
                action = "failed"
            elif index < self.fail_first + self.stall_first:
                action = "stalled"
            elif self.fail_rate and self._rng.random() < self.fail_rate:
                action = "failed"
            elif self.stall_rate and self._rng.random() < self.stall_rate:
                action = "stalled"
            else:
                action = "ok"
            if action == "failed":
                self._failed += 1
            elif action == "stalled":
                self._stalled += 1
            return index, action

    async def _chat(self, request: Request) -> JSONResponse:
        self.in_flight += 1  # handlers all run on the server's one event loop
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._chat_inner(request)
        finally:
            self.in_flight -= 1

    async def _chat_inner(self, request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body.get("model"):
            self._record(-1, request, body, "bad_request")
            return _error(400, "expected a JSON body with 'model' and a 'messages' list", "invalid_request_error")
        if body.get("stream"):
            self._record(-1, request, body, "bad_request")
            return _error(400, "streaming is not supported by this test server", "invalid_request_error")
        index, action = self._decide()
        self._record(index, request, body, action)
        if self.latency_s:
            with self._lock:
                delay = ReplyDelay(self.latency_s, self.latency_jitter, self.latency_distribution).draw(self._latency_rng)
                self.delays.append(delay)
            await asyncio.sleep(delay)
        if action == "failed":
            response = _error(self.fail_status, f"injected failure on request {index}", "server_error")
            if self.retry_after is not None:
                response.headers["Retry-After"] = str(self.retry_after)
            return response
        if action == "stalled":
            end = time.monotonic() + self.stall_s
            while time.monotonic() < end and not self._stopping.is_set():
                await asyncio.sleep(0.02)
        try:
            reply = self.script(body)
            message, finish = self._message(reply, index)
        except Exception as e:  # noqa: BLE001 - a broken script must fail its test, not kill the server
            self.script_errors.append(f"{type(e).__name__}: {e}")
            return _error(500, f"script error: {type(e).__name__}: {e}", "server_error")
        return JSONResponse({
            "id": f"chatcmpl-{index}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })

    @staticmethod
    def _message(reply: Any, index: int) -> tuple[dict[str, Any], str]:
        if isinstance(reply, str):
            return {"role": "assistant", "content": reply}, "stop"
        if not isinstance(reply, dict):
            raise TypeError(f"script must return a str or a dict, got {type(reply).__name__}")
        calls = []
        for i, call in enumerate(reply.get("tool_calls") or []):
            args = call.get("arguments", {})
            calls.append({
                "id": call.get("id", f"call_{index}_{i}"), "type": "function",
                "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            })
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
        if calls:
            message["tool_calls"] = calls
        return message, "tool_calls" if calls else "stop"
