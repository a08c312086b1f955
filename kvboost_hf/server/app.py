"""The FastAPI application: OpenAI-compatible routes in front of the model worker.

``create_app(engine, settings)`` builds the app; the worker thread starts and stops with the app's lifespan.
Every handler runs on uvicorn's event loop: it validates and tokenises the request, submits a
:class:`~kvboost_hf.server.batching.Job` and reads the job's events from an ``asyncio.Queue`` that the worker
fills through ``loop.call_soon_threadsafe`` (no second event loop). A streaming response sends each event as an
SSE ``data:`` line at once; a client that goes away sets the job's cancel event and frees its batch row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost_hf.core.config import GenerationMode
from kvboost_hf.engine import InferenceEngine, Prompt
from kvboost_hf.offload import layer_streamer
from kvboost_hf.server.batching import Delta, Done, Event, Failed, Finished, Job, SamplingParams, TokenLogprob
from kvboost_hf.server.metrics import Metrics, Scraped
from kvboost_hf.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    WarmRequest,
    WarmResponse,
)
from kvboost_hf.server.worker import Overloaded, ShuttingDown, Worker

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default of /v1/completions
REUSE_MODES = {
    "off": GenerationMode.BASELINE,  # plain K/V per request
    "prefix": GenerationMode.PREFIX_CACHE,  # exact prefix hits: outputs equal no reuse, batched or alone
    "chunk": GenerationMode.CHUNK_KV_REUSE,  # also repaired non-prefix hits (approximate, single-row batches)
}


@dataclass(frozen=True)
class ServerSettings:
    """Server behaviour.

    ``reuse_mode``: a key of ``REUSE_MODES``; ``batch_window_ms``: how long a request may wait for others sharing
    its prefix; ``max_batch_size``: rows generated at once; ``max_queue``: requests waiting before 429;
    ``default_max_tokens``: budget when a request names none; ``max_tokens_limit``: largest budget a request may
    ask for (None: up to the context); ``shutdown_grace_s``: time in-flight requests get to finish at shutdown
    before they are cancelled.
    """

    model_name: str = "SmolLM2-135M-Instruct"
    api_key: str | None = None
    reuse_mode: str = "prefix"
    batch_window_ms: float = 10.0
    max_batch_size: int = 8
    max_queue: int = 64
    default_max_tokens: int = 256
    max_tokens_limit: int | None = None
    shutdown_grace_s: float = 10.0


class ApiError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


_ERROR_KINDS = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def _error(status: int, message: str, **kwargs: Any) -> ApiError:
    return ApiError(status, message, kind=_ERROR_KINDS.get(status, "invalid_request_error"), **kwargs)


class _CountRequests:
    """ASGI middleware: counts answered requests (and errors) per known endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: Callable[[], set[str]]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints() else "other"
            self.metrics.requests.inc(1, endpoint, str(status))
            if status >= 400:
                self.metrics.errors.inc(1, endpoint, str(status))


def create_app(engine: InferenceEngine, settings: ServerSettings | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``engine``. The model is used only by the app's worker thread."""
    settings = settings or ServerSettings()
    metrics = Metrics()
    worker = Worker(
        engine,
        mode=REUSE_MODES[settings.reuse_mode],
        batch_window_s=settings.batch_window_ms / 1e3,
        max_batch_size=settings.max_batch_size,
        max_queue=settings.max_queue,
        metrics=metrics,
    )
    _register_scraped(metrics, worker, engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.shutdown, settings.shutdown_grace_s)

    app = FastAPI(title="kvboost_hf OpenAI-compatible server", version="0.1.0", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics
    app.add_middleware(_CountRequests, metrics=metrics, endpoints=lambda: {r.path for r in app.routes})
    _install_error_handlers(app)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            raise _error(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    guarded = [Depends(authorize)]
    errors: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}

    class _Run:
        """One generation request from validation to its last event."""

        def __init__(
            self,
            request: Request,
            body: ChatCompletionRequest | CompletionRequest,
            prompt: Prompt,
            max_tokens: int | None,
            top_logprobs: int | None,
            kind: str,
        ) -> None:
            self.arrival = time.perf_counter()
            self.request, self.body, self.kind = request, body, kind
            if body.model != settings.model_name:
                raise _error(
                    404,
                    f"model {body.model!r} is not served here (try {settings.model_name!r})",
                    param="model",
                    code="model_not_found",
                )
            if body.n > settings.max_batch_size:
                raise _error(
                    400, f"n={body.n} exceeds the server's max batch size {settings.max_batch_size}", param="n"
                )
            try:
                prompt_ids = worker.encode(prompt)
            except Exception as exc:  # empty prompt, chat template refusing a role, ...
                raise _error(400, f"invalid prompt: {exc}", param="messages" if kind == "chat" else "prompt") from exc
            room = engine.max_context - len(prompt_ids) if engine.max_context else None
            limit = settings.max_tokens_limit
            if max_tokens is not None and limit is not None and max_tokens > limit:
                raise _error(400, f"max_tokens={max_tokens} exceeds this server's limit of {limit}", param="max_tokens")
            if max_tokens is None:
                max_tokens = min(
                    settings.default_max_tokens,
                    limit or settings.default_max_tokens,
                    2**31 if room is None else max(room, 1),
                )
            if room is not None and max_tokens > room:
                raise _error(
                    400,
                    f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} exceeds the context of "
                    f"{engine.max_context} tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                stop=body.stop_strings(),
                seed=body.seed,
                top_logprobs=top_logprobs,
            )
            self.queue: asyncio.Queue[Event] = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def sink(event: Event) -> None:
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                    loop.call_soon_threadsafe(self.queue.put_nowait, event)

            self.job = Job(prompt_ids, params, sink, n=body.n, cache_salt=body.cache_salt, arrival=self.arrival)
            self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
            logger.debug("%s: %d prompt tokens, n=%d, user=%r", self.id, len(prompt_ids), body.n, body.user)
            self.created = int(time.time())

        async def respond(self) -> ChatCompletion | Completion | StreamingResponse:
            try:
                worker.submit(self.job)
            except Overloaded as exc:
                headers = {"Retry-After": str(exc.retry_after_s)}
                raise _error(429, str(exc), code="rate_limit_exceeded", headers=headers) from exc
            except ShuttingDown as exc:
                raise _error(503, str(exc)) from exc
            if self.body.stream:
                return StreamingResponse(self._sse(), media_type="text/event-stream")
            return await self._collect()

        async def _events(self, watch_disconnect: bool) -> AsyncIterator[Event]:
            """The job's events until Done or Failed; cancels the job when the consumer stops early."""
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                    except TimeoutError:
                        if watch_disconnect and await self.request.is_disconnected():
                            logger.info("client of %s went away; cancelling", self.id)
                            return
                        continue
                    yield event
                    if isinstance(event, Done | Failed):
                        return
            finally:
                self.job.cancel.set()

        async def _collect(self) -> ChatCompletion | Completion:
            n = self.body.n
            texts, reasons = [""] * n, ["stop"] * n
            logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
            done: Done | None = None
            async for event in self._events(watch_disconnect=True):
                if isinstance(event, Delta):
                    texts[event.index] += event.text
                    logprobs[event.index] += event.logprobs
                elif isinstance(event, Finished):
                    reasons[event.index] = event.reason
                elif isinstance(event, Done):
                    done = event
                else:
                    raise _error(event.status, event.message, code="generation_failed")
            if done is None:
                raise _error(499, "client disconnected")
            usage = _usage(done)
            want_logprobs = self.job.params.top_logprobs is not None
            if self.kind == "chat":
                return ChatCompletion(
                    id=self.id,
                    created=self.created,
                    model=settings.model_name,
                    usage=usage,
                    choices=[
                        {
                            "index": i,
                            "message": {"role": "assistant", "content": texts[i]},
                            "logprobs": _chat_logprobs(logprobs[i]) if want_logprobs else None,
                            "finish_reason": reasons[i],
                        }
                        for i in range(n)
                    ],
                )
            return Completion(
                id=self.id,
                created=self.created,
                model=settings.model_name,
                usage=usage,
                choices=[
                    {
                        "index": i,
                        "text": texts[i],
                        "logprobs": _completion_logprobs(logprobs[i]) if want_logprobs else None,
                        "finish_reason": reasons[i],
                    }
                    for i in range(n)
                ],
            )

        async def _sse(self) -> AsyncIterator[str]:
            """SSE ``data:`` lines: one chunk per event as soon as it arrives, then ``[DONE]``."""
            include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
            want_logprobs = self.job.params.top_logprobs is not None
            if self.kind == "chat":
                for i in range(self.body.n):
                    yield self._chunk(
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        },
                        include_usage,
                    )
            async for event in self._events(watch_disconnect=False):
                if isinstance(event, Delta):
                    yield self._chunk(self._delta_choice(event, want_logprobs), include_usage)
                elif isinstance(event, Finished):
                    empty = {"delta": {}} if self.kind == "chat" else {"text": ""}
                    choice = {"index": event.index, **empty, "logprobs": None, "finish_reason": event.reason}
                    yield self._chunk(choice, include_usage)
                elif isinstance(event, Done):
                    if include_usage:
                        yield self._chunk(None, True, _usage(event).model_dump())
                else:
                    body = {"error": {"message": event.message, "type": "server_error", "code": "generation_failed"}}
                    yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        def _delta_choice(self, event: Delta, want_logprobs: bool) -> dict[str, Any]:
            if self.kind == "chat":
                logprobs = _chat_logprobs(list(event.logprobs)) if want_logprobs else None
                return {
                    "index": event.index,
                    "delta": {"content": event.text},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            logprobs = _completion_logprobs(list(event.logprobs)) if want_logprobs else None
            return {"index": event.index, "text": event.text, "logprobs": logprobs, "finish_reason": None}

        def _chunk(self, choice: dict[str, Any] | None, include_usage: bool, usage: Any = None) -> str:
            chunk: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created,
                "model": settings.model_name,
                "choices": [] if choice is None else [choice],
            }
            if include_usage:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"

    @app.get("/health", responses=errors)
    async def health() -> dict[str, Any]:
        """Liveness (no API key needed): queue depth and running rows."""
        return {"status": "ok", "queue_depth": worker.queue_depth, "running_rows": worker.running_rows}

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse, responses=errors)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=guarded, responses=errors)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=created)])

    @app.post("/v1/warm", dependencies=guarded, responses=errors)
    async def warm(body: WarmRequest) -> WarmResponse:
        """Pre-load a text (or chat messages) so later prompts starting with it hit the cache."""
        if (body.text is None) == (body.messages is None):
            raise _error(400, "give exactly one of 'text' or 'messages'", param="text")
        prompt: Prompt = body.text if body.text is not None else _chat_prompt(body.messages or [])
        try:
            future = worker.call(lambda: engine.warm(prompt, cache_salt=body.cache_salt))
            result = await asyncio.wrap_future(future)
        except ShuttingDown as exc:
            raise _error(503, str(exc)) from exc
        except ValueError as exc:
            raise _error(400, str(exc), param="text") from exc
        return WarmResponse(
            chunks_stored=result.chunks_stored,
            token_count=result.token_count,
            chunk_size=result.chunk_size,
            partial_tail_tokens=result.partial_tail_tokens,
            alignment_warning=result.alignment_warning,
        )

    @app.post("/v1/chat/completions", dependencies=guarded, responses=errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion:
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        run = _Run(request, body, _chat_prompt(body.messages), max_tokens, top, "chat")
        return await run.respond()  # type: ignore[return-value]

    @app.post("/v1/completions", dependencies=guarded, responses=errors)
    async def completions(body: CompletionRequest, request: Request) -> Completion:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise _error(400, "exactly one prompt per request is supported (use n for several choices)", param="prompt")
        max_tokens = body.max_tokens or min(COMPLETIONS_DEFAULT_MAX_TOKENS, settings.max_tokens_limit or 2**31)
        run = _Run(request, body, prompts[0], max_tokens, body.logprobs, "completion")
        return await run.respond()  # type: ignore[return-value]

    return app


def _chat_prompt(messages: list[Any]) -> list[dict[str, str]]:
    """Chat messages as the tokenizer's chat template expects them ("developer" is a system message)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def _usage(done: Done) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details={"cached_tokens": done.cached_tokens},
    )


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {**_token_entry(e.token, e.logprob), "top_logprobs": [_token_entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def _completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
    }


SPECULATIVE_COUNTERS = {
    "target_forwards": "Forwards of the target model in engine.generate calls (a batch's rows share them).",
    "draft_tokens_proposed": "Tokens proposed by the speculative draft.",
    "draft_tokens_accepted": "Draft tokens the target kept.",
}


STREAMING_METRICS = (
    ("kvboost_streamed_bytes_total", "bytes_streamed", "Bytes of streamed decoder layers copied to the device."),
    ("kvboost_streamed_layer_reloads_total", "reloads", "Streamed layers copied when about to run (no prefetch)."),
    ("kvboost_streamed_wait_seconds_total", "wait_seconds", "Seconds the compute waited on layer copies."),
)


def _register_scraped(metrics: Metrics, worker: Worker, engine: InferenceEngine) -> None:
    metrics.add_scraped(
        Scraped("kvboost_queue_depth", "Requests waiting for admission.", lambda: {(): worker.queue_depth})
    )
    metrics.add_scraped(Scraped("kvboost_running_rows", "Rows generating now.", lambda: {(): worker.running_rows}))

    def store_hits() -> dict[tuple[str, ...], float]:
        stats = engine.cache_stats()
        return {(tier,): stats.get(f"{tier}_hits", 0) for tier in ("ram", "disk", "remote")}

    metrics.add_scraped(
        Scraped("kvboost_store_hits_total", "Chunk store hits by tier.", store_hits, ("tier",), "counter")
    )
    metrics.add_scraped(
        Scraped(
            "kvboost_store_misses_total",
            "Chunk store misses.",
            lambda: {(): engine.cache_stats().get("misses", 0)},
            kind="counter",
        )
    )
    for name, help_text in SPECULATIVE_COUNTERS.items():
        read = lambda n=name: {(): engine.cache_stats().get(n, 0)}  # noqa: E731
        metrics.add_scraped(Scraped(f"kvboost_{name}_total", help_text, read, kind="counter"))
    metrics.add_scraped(
        Scraped(
            "kvboost_draft_acceptance_rate",
            "Draft tokens accepted / proposed, over the engine's life.",
            lambda: {(): engine.cache_stats().get("draft_acceptance_rate", 0.0)},
        )
    )
    streamer = layer_streamer(engine.model)
    if streamer is not None:  # layer streaming: counters of the copies
        for name, field, help_text in STREAMING_METRICS:
            read = lambda f=field: {(): getattr(streamer.stats(), f)}  # noqa: E731
            metrics.add_scraped(Scraped(name, help_text, read, kind="counter"))


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {...}}``; validation problems are 400s naming the field."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        else:
            message = f"{where or 'body'}: {first.get('msg')}"
        return _error(400, message, param=where or None).response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    handlers: dict[type[Exception], Callable[[Request, Exception], Awaitable[JSONResponse]]] = {
        ApiError: api_error,
        RequestValidationError: validation_error,
        StarletteHTTPException: http_error,
        Exception: unexpected,
    }
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
