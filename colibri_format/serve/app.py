"""The ASGI app of `colibri serve` (FastAPI): the OpenAI endpoints over a running `Scheduler`.

    GET  /v1/models              the one model served
    POST /v1/completions         text (or token ids) in, text out; `stream: true` for server-sent events
    POST /v1/chat/completions    messages through the file's chat template
    GET  /health                 200 while the scheduler runs, 503 once it stopped
    GET  /metrics                Prometheus text (metrics.py)

Each request is read (at most MAX_BODY_BYTES), parsed off the event loop (tokenizing and the chat template run
in the thread pool), queued on the scheduler, and answered from the events its job receives. A client that goes
away (a closed stream, a dropped connection while waiting) cancels its job at once, which frees its slot before
the next decode step. Every refusal is an OpenAI-style JSON error; an unexpected failure is a 500 with a one-line
message (the traceback goes to the server log only).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import (MAX_BODY_BYTES, ApiError, ModelInfo, ParsedRequest, Reply, parse_body, parse_chat,
                       parse_completion, sse)
from .scheduler import Delta, Done, Failed, Job, QueueFull, Scheduler, SchedulerClosed

log = logging.getLogger("colibri.serve")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(scheduler: Scheduler, info: ModelInfo) -> FastAPI:
    """The app serving `info`'s model through `scheduler` (already started)."""
    app = FastAPI(title="colibri serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = scheduler.metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 400:
            metrics.count("rejected_invalid")
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected failure on %s", request.url.path)
        return JSONResponse(ApiError(500, f"internal error ({type(exc).__name__}); see the server log",
                                     type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if scheduler.alive:
            snap = metrics.snapshot()
            return JSONResponse({"status": "ok", "running": scheduler.running, "waiting": len(scheduler.waiting),
                                 "decode": {"mode": snap["decode_mode"], "graphs": snap["decode_graphs"],
                                            "batch_steps": snap["decode_batches"]}})
        reason = "stopped" if scheduler.error is None else f"{type(scheduler.error).__name__}: {scheduler.error}"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [info.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != info.id:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {info.id!r}",
                           type="not_found_error", param="model", code="model_not_found")
        return info.card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(request, scheduler, info, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, scheduler, info, parse_chat)

    return app


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    pieces, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        pieces.append(piece)
    return b"".join(pieces)


async def _answer(request: Request, scheduler: Scheduler, info: ModelInfo,
                  parse: Callable[[dict[str, Any], ModelInfo], ParsedRequest]) -> Response:
    body = parse_body(await _read_body(request))
    req = await run_in_threadpool(parse, body, info)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(req.prompt_ids, req.params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    try:
        scheduler.submit(job)
    except QueueFull as exc:
        raise ApiError(429, f"the server is busy: {exc}; retry later", type="rate_limit_error",
                       code="rate_limit_exceeded") from None
    except SchedulerClosed as exc:
        raise ApiError(503, f"the server cannot take requests: {exc}", type="server_error") from None
    reply = Reply(req)
    if req.stream:
        return EventStream(_chunks(job, events, reply, info), on_close=lambda: scheduler.cancel(job))
    try:
        return await _until_disconnect(request, _whole(events, reply))
    except ClientGone:
        return Response(status_code=499)
    finally:
        scheduler.cancel(job)          # nothing if it finished; else its slot frees before the next step


async def _whole(events: asyncio.Queue, reply: Reply) -> JSONResponse:
    token_ids: list[int] = []
    while True:
        event = await events.get()
        if isinstance(event, Delta):
            token_ids += event.token_ids
        elif isinstance(event, Done):
            usage = reply.usage(event.prompt_tokens, event.completion_tokens)
            return JSONResponse(reply.whole(event.text, event.finish_reason, token_ids, usage))
        elif isinstance(event, Failed):
            raise ApiError(event.status, event.message, type="server_error")


async def _chunks(job: Job, events: asyncio.Queue, reply: Reply, info: ModelInfo):
    """The server-sent events of one streamed request, ending with `data: [DONE]`."""
    every_token = reply.req.return_token_ids or info.tokenizer is None
    if reply.chat:
        yield sse(reply.chunk("", role=True))
    pending: list[int] = []
    while True:
        event = await events.get()
        if isinstance(event, Delta):
            pending += event.token_ids
            if event.text or every_token:
                yield sse(reply.chunk(event.text, pending))
                pending = []
        elif isinstance(event, Done):
            if event.tail or (pending and reply.req.return_token_ids):
                yield sse(reply.chunk(event.tail, pending))
            yield sse(reply.chunk(None, finish_reason=event.finish_reason))
            if reply.req.include_usage:
                yield sse(reply.usage_chunk(reply.usage(event.prompt_tokens, event.completion_tokens)))
            yield sse("[DONE]")
            return
        elif isinstance(event, Failed):
            yield sse(ApiError(event.status, event.message, type="server_error").body())
            return


class EventStream(StreamingResponse):
    """A server-sent event stream that notices a client leaving while nothing is written (it listens for the
    disconnect whatever the ASGI version) and calls `on_close` when it ends, however it ends."""

    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(send)
                except OSError:                      # the client went away during a write
                    pass
                group.cancel_scope.cancel()
        finally:
            self.on_close()


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s result, or ClientGone as soon as the client disconnects."""
    result: list[Response] = []
    failed: list[Exception] = []
    async with anyio.create_task_group() as group:
        async def run() -> None:
            try:
                result.append(await work)
            except Exception as exc:  # noqa: BLE001 - raised below, outside the task group (no ExceptionGroup)
                failed.append(exc)
            group.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(run)
        group.start_soon(watch)
    if failed:
        raise failed[0]
    if not result:
        raise ClientGone()
    return result[0]
