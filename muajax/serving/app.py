"""The HTTP side of `python -m muajax.serve`: an OpenAI-compatible Starlette app.

Routes: POST /v1/chat/completions (JSON or, with "stream": true, server-sent events),
GET /v1/models, GET /v1/models/{id}, GET /health. Every error is a JSON body
{"error": {"message", "type", "param", "code"}}: 400 for a bad request, 413 for a body
over the size limit, 401 / 404, and 503 with Retry-After when the wait queue is full.
Everything a request asks for is checked (size, nesting, every sampling field, prompt
length) before it reaches the engine, so one malformed request never affects the others.

A request's prompt is rendered with muajax's own chat functions (system + tools, every
message, then the generation prompt), exactly the token layout the policy was trained
on; its output is parsed with `parse_assistant`, as the rollout loop does.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from typing import Any, Self

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from muajax.agent.chat import generation_prompt_ids, im_end_id, render_messages_ids
from muajax.engine.engine import SamplingParams
from muajax.serving.protocol import (
    ApiError,
    ChatRequest,
    Limits,
    bad,
    build_output,
    chunk_body,
    clean_text,
    completion_body,
    new_id,
    parse_body,
    parse_request,
    streamable_prefix,
    usage,
)
from muajax.serving.scheduler import Job, Overloaded, Scheduler

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5
DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class ChatService:
    """Everything a request needs: the engine's scheduler, the tokenizer, the limits."""

    def __init__(self, engine, tokenizer, model_name: str, *, vocab_size: int, default_max_tokens: int = 1024,
                 max_queue: int = 256, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_json_depth: int = 128, retry_after_s: int = 1):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.max_len = engine.max_len
        self.limits = Limits(context=engine.max_len, vocab_size=vocab_size, max_json_depth=max_json_depth)
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.scheduler = Scheduler(engine, max_queue=max_queue)
        self._api_key = api_key.encode() if api_key else None  # compared, never logged
        self.im_end = im_end_id(tokenizer)
        self.started = int(time.time())

    # ------------------------------------------------------------------ helpers
    def check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].encode() if header.lower().startswith("bearer ") else b""
        if not hmac.compare_digest(token, self._api_key):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key",
                           kind="authentication_error")

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        try:
            ids, _ = render_messages_ids(self.tok, None, req.tools, req.messages)
        except (ValueError, TypeError) as e:
            raise bad(f"cannot render the messages: {e}", "messages") from None
        except RecursionError:  # the nesting checks should make this unreachable
            raise bad("the messages nest too deeply", "messages", "nesting_too_deep") from None
        return ids + generation_prompt_ids(self.tok)

    def text_of(self, tokens: list[int], finish_reason: str) -> str:
        if finish_reason == "stop" and tokens and tokens[-1] == self.im_end:
            tokens = tokens[:-1]
        return self.tok.decode(tokens, skip_special_tokens=False)

    @staticmethod
    def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        return (text[: min(hits)], True) if hits else (text, False)

    def make_job(self, req: ChatRequest) -> tuple[Job, int]:
        prompt = self.prompt_ids(req)
        if len(prompt) >= self.max_len:
            raise bad(f"the prompt is {len(prompt)} tokens; this server's context is {self.max_len} tokens "
                      "(prompt + completion)", "messages", "context_length_exceeded")
        room = self.max_len - len(prompt)
        max_new = min(req.max_tokens or self.default_max_tokens, room)
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                      max_new_tokens=max_new)
        except ValueError as e:
            raise bad(f"invalid sampling parameters: {e}") from None
        should_stop = None
        if req.stop:
            def should_stop(tokens, stops=req.stop):
                return self.cut_at_stop(self.tok.decode(tokens, skip_special_tokens=False), stops)[1]
        job = Job(prompt, sampling, req.seed, should_stop=should_stop, wants_progress=req.stream)
        try:
            self.scheduler.submit(job)
        except Overloaded as e:
            raise ApiError(503, f"server overloaded: {e}; retry later", code="overloaded",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), code="unavailable", headers={"Retry-After": str(self.retry_after_s)}) from None
        return job, len(prompt)

    def final_output(self, req: ChatRequest, tokens: list[int], finish_reason: str):
        text, stopped = self.cut_at_stop(self.text_of(tokens, finish_reason), req.stop)
        return build_output(text, finish_reason, stopped, tools=bool(req.tools))

    # ------------------------------------------------------------------ routes
    async def chat(self, request: Request) -> Response:
        self.check_auth(request)
        body = parse_body(await self.read_body(request), self.limits.max_json_depth)
        req = parse_request(body, self.model_name, self.limits)
        job, prompt_tokens = self.make_job(req)
        request_id = new_id("chatcmpl")
        if req.stream:
            return StreamingResponse(self._stream(req, job, request_id, prompt_tokens), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        event = await self._wait(job, request)
        if event[0] == "error":
            raise ApiError(500, f"generation failed: {event[1]}")
        _, tokens, finish_reason = event
        output = self.final_output(req, tokens, finish_reason)
        return JSONResponse(completion_body(request_id, self.model_name, output, prompt_tokens, len(tokens)))

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past `max_body_bytes`: by its declared length before
        reading any of it, else (chunked) as soon as the bytes read pass the limit."""
        too_large = ApiError(413, f"the request body exceeds this server's limit of {self.max_body_bytes} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _wait(self, job: Job, request: Request):
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise ApiError(499, "the client closed the connection") from None
                    continue
                if event[0] in ("done", "error"):
                    return event
        finally:
            self.scheduler.cancel(job)  # no-op once finished; frees the slot of an abandoned request

    async def _stream(self, req: ChatRequest, job: Job, request_id: str, prompt_tokens: int):
        created = int(time.time())
        sent = ""

        def sse(body: dict[str, Any]) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def chunk(delta, finish=None, usage_counts=None):
            return sse(chunk_body(request_id, self.model_name, created, delta, finish, usage_counts))

        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                event = await job.events.get()
                while event[0] == "tokens" and not job.events.empty():
                    event = job.events.get_nowait()  # only the newest progress matters
                if event[0] == "tokens":
                    text, _ = self.cut_at_stop(clean_text(self.tok.decode(event[1], skip_special_tokens=False)),
                                               req.stop)
                    safe = _hold_stop_prefix(streamable_prefix(text), req.stop)
                    if safe.startswith(sent) and len(safe) > len(sent):
                        yield chunk({"content": safe[len(sent):]})
                        sent = safe
                    continue
                if event[0] == "error":
                    yield sse(ApiError(500, f"generation failed: {event[1]}").body())
                    break
                _, tokens, finish_reason = event
                output = self.final_output(req, tokens, finish_reason)
                if output.content and output.content.startswith(sent) and len(output.content) > len(sent):
                    yield chunk({"content": output.content[len(sent):]})
                if output.tool_calls:
                    yield chunk({"tool_calls": [dict(call, index=i) for i, call in enumerate(output.tool_calls)]})
                yield chunk({}, output.finish_reason)
                if req.include_usage:
                    yield chunk(None, usage_counts=usage(prompt_tokens, len(tokens)))
                break
            yield "data: [DONE]\n\n"
        finally:
            self.scheduler.cancel(job)

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self.check_auth(request)
        name = request.path_params["model"]
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "muajax",
                "max_model_len": self.max_len}

    async def health(self, request: Request) -> Response:
        s = self.scheduler
        status = 200 if s.alive else 503
        return JSONResponse({"status": "ok" if s.alive else "down", "slots": self.engine.num_slots,
                             "running": len(s.running), "queued": len(s.pending), **s.stats}, status_code=status)


def _hold_stop_prefix(text: str, stops: tuple[str, ...]) -> str:
    """Hold back a tail that may be the start of a stop string (it must never be sent)."""
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                text = text[:-n]
                break
    return text


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(service: ChatService) -> Starlette:
    async def on_api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    async def on_http_error(request: Request, exc: HTTPException):
        return _error_response(ApiError(exc.status_code, str(exc.detail) or "error",
                                        code="not_found" if exc.status_code == 404 else None))

    async def on_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.scheduler.start()
        try:
            yield
        finally:
            await service.scheduler.stop()

    routes = [
        Route("/v1/chat/completions", service.chat, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, Exception: on_error})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port, read back from the socket: no probe race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class BackgroundServer:
    """Run the app with uvicorn in a daemon thread (tests, benchmarks); `url` ends in /v1."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host = app, host
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 60.0) -> Self:
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                        name=f"muajax-serve-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sock.close()
        self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
