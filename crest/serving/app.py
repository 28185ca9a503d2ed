"""The HTTP layer: a thin FastAPI app speaking OpenAI's completions and chat completions over the engine.

Handlers check and encode a request, build its drafter (`Engine.request`), submit it to the scheduler and
await its future; streamed text arrives from the scheduler thread through `loop.call_soon_threadsafe` into an
asyncio queue and leaves as server-sent events ending in `data: [DONE]`. Stop strings are cut from the text
(held back while they may still be completing), as OpenAI does. User errors are 400/401/404/429 responses
with OpenAI-style error objects and are never logged as tracebacks; a client that goes away cancels its row.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from crest_client.errors import CrestClientError, StoreNotFound
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from crest.serving.engine import Engine
from crest.serving.metrics import CONTENT_TYPE, ServerMetrics
from crest.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    error_body,
    finish_reason,
    model_card,
    new_id,
    usage,
)
from crest.serving.scheduler import Outcome, QueueFull, ShuttingDown
from crest.serving.scheduler import Request as Job

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256

_END = object()  # the stream's end marker, queued after the last text piece


class ApiError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: Any = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers


class StopText:
    """Cuts streamed text at the first stop string, holding back a tail that may still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.done = stops, "", False

    def feed(self, piece: str) -> str:
        """Return the text that can be sent now."""
        if self.done:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.done, self.held = True, ""
            return text[: min(hits)]
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Return the held-back text at the end of the output."""
        text, self.held = ("" if self.done else self.held), ""
        return text


def create_app(engine: Engine, *, metrics: ServerMetrics | None = None, api_key: str | None = None) -> FastAPI:
    """Return the FastAPI app serving `engine` (started with the app, drained when it stops)."""
    metrics = metrics or ServerMetrics()
    if engine.scheduler.metrics is None:  # steps, tokens, batch size and queue depth are observed by the scheduler
        engine.scheduler.metrics = metrics
    metrics.watch_stores(engine.store_stats)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        yield
        await run_in_threadpool(engine.stop)

    app = FastAPI(title="crest", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = request.url.path
        if api_key and path != "/health" and request.headers.get("authorization", "") != f"Bearer {api_key}":
            response: Response = _error(ApiError(401, "invalid or missing API key (Authorization: Bearer ...)"))
        else:
            response = await call_next(request)
        metrics.count_request(path, response.status_code)
        return response

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(ApiError(400, _bad_json(exc.body, first)))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = (
            f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid request"))
        )
        return _error(ApiError(400, message))

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "down"}, status_code=503)
        return JSONResponse({"status": "ok", "active": engine.scheduler.active, "queued": engine.scheduler.queued})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card(engine.model_name)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        _check_model(engine, model)
        return JSONResponse(model_card(engine.model_name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(engine, body.model)
        prompt = await _user_call(engine.encode, body.prompt)
        return await _serve(engine, body, prompt, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        _check_model(engine, body.model)
        messages = await _user_call(lambda: [(m.role, m.text()) for m in body.messages])
        prompt = await _user_call(engine.encode_chat, messages)
        return await _serve(engine, body, prompt, request, chat=True)

    return app


def _check_model(engine: Engine, name: str | None) -> None:
    """Raise a 404 (OpenAI's model_not_found) unless `name` is the served model or not given."""
    if name is not None and name != engine.model_name:
        raise ApiError(
            404,
            f"The model {name!r} does not exist: this server serves {engine.model_name!r} (GET /v1/models)",
            code="model_not_found",
        )


async def _user_call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a worker thread; crest's errors become 400s (404 for a missing store)."""
    try:
        return await run_in_threadpool(fn, *args)
    except StoreNotFound as exc:
        raise ApiError(404, str(exc), kind="not_found_error") from None
    except CrestClientError as exc:
        raise ApiError(400, str(exc)) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ApiError(400, f"cannot encode the request: {exc}") from None


async def _serve(engine: Engine, body: Any, prompt: list[int], request: Request, *, chat: bool) -> Response:
    """Submit one request and answer it whole or as a stream."""
    await _user_call(body.check)
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[Any] = asyncio.Queue()
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens or DEFAULT_MAX_TOKENS
    job: Job = await _user_call(
        lambda: engine.request(
            prompt,
            drafter=body.drafter,
            store=body.store_name(),
            prediction=body.prediction.text() if body.prediction else None,
            max_tokens=limit,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stops(),
            on_text=(lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece)) if body.stream else None,
        )
    )
    try:
        future = engine.submit(job, learn=body.learn)
    except QueueFull as exc:
        raise ApiError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
    except ShuttingDown as exc:
        raise ApiError(503, str(exc), kind="server_error") from None
    except CrestClientError as exc:
        raise ApiError(400, str(exc)) from None
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, _END))
    rid, model, predicted = new_id("chatcmpl" if chat else "cmpl"), engine.model_name, body.prediction is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _events(
            job,
            future,
            pieces,
            body.stops(),
            chat=chat,
            rid=rid,
            model=model,
            include_usage=include_usage,
            predicted=predicted,
        )
        return StreamingResponse(stream, media_type="text/event-stream")
    waiter = asyncio.wrap_future(future)
    while not (await asyncio.wait({waiter}, timeout=0.25))[0]:
        if await request.is_disconnected():
            job.cancelled.set()
            raise ApiError(499, "client closed the request")
    outcome = _outcome(future)
    cut = StopText(body.stops())
    text = cut.feed(outcome.result.text) + cut.flush()
    return JSONResponse(
        completion_body(
            chat=chat,
            rid=rid,
            model=model,
            text=text,
            reason=_reason(outcome, cut),
            usage_=_usage(outcome, predicted=predicted),
        )
    )


async def _events(job: Job, future: Any, pieces: asyncio.Queue[Any], stops: list[str], **kw: Any) -> AsyncIterator[str]:
    """Yield the request's server-sent events; a client that goes away cancels the row."""
    chat, rid, model, include_usage = kw["chat"], kw["rid"], kw["model"], kw["include_usage"]
    cut, first = StopText(stops), True
    try:
        while True:
            piece = await pieces.get()
            if piece is _END:
                break
            text = cut.feed(piece)
            if text:
                yield _sse(chunk_body(chat=chat, rid=rid, model=model, text=text, reason=None, first=first))
                first = False
        try:
            outcome = _outcome(future)
        except ApiError as exc:
            yield _sse(error_body(str(exc), kind=exc.kind))
            yield "data: [DONE]\n\n"
            return
        tail = cut.flush()
        last = chunk_body(chat=chat, rid=rid, model=model, text=tail or None, reason=_reason(outcome, cut), first=first)
        if include_usage:
            last["usage"] = None
        yield _sse(last)
        if include_usage:
            yield _sse({"id": rid, "object": last["object"], "created": last["created"], "model": model,
                        "choices": [], "usage": _usage(outcome, predicted=kw["predicted"])})  # fmt: skip
        yield "data: [DONE]\n\n"
    finally:
        if not future.done():
            job.cancelled.set()


def _outcome(future: Any) -> Outcome:
    """Return the finished request's outcome; its failure becomes an ApiError."""
    exc = future.exception()
    if exc is None:
        outcome: Outcome = future.result()
        return outcome
    if isinstance(exc, CrestClientError):
        raise ApiError(400, str(exc))
    raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server_error")


def _reason(outcome: Outcome, cut: StopText) -> str:
    return "stop" if cut.done else finish_reason(outcome.result.stop_reason)


def _usage(outcome: Outcome, *, predicted: bool) -> dict[str, Any]:
    result = outcome.result
    return usage(len(result.prompt_token_ids), result.new_tokens, outcome.accepted_draft_tokens,
                 outcome.rejected_draft_tokens, predicted=predicted, forward_passes=result.forward_passes)  # fmt: skip


def _bad_json(body: Any, error: dict[str, Any]) -> str:
    """Return what is wrong with a body that is not JSON, and where (line and column, as Python's json says)."""
    loc = tuple(error.get("loc") or ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else 0
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body or "")
    line, column = text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)
    reason = (error.get("ctx") or {}).get("error", "invalid JSON")
    return f"request body is not valid JSON: {reason} at line {line} column {column} (char {pos})"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(exc: ApiError) -> JSONResponse:
    body = error_body(str(exc), kind=exc.kind, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)
