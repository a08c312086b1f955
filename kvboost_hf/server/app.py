"""The FastAPI application: OpenAI-compatible routes in front of the model worker.

``create_app(engine, settings)`` builds the app; the worker thread starts and stops with the app's lifespan.
Layers, outermost first:

* the connection (:mod:`~kvboost_hf.server.transport`, with :func:`uvicorn_config`): time bounds on reading a
  request's headers and body, and a cap on the connections per client address;
* request counting for ``/metrics`` (outermost, so the gate's 401, 413 and 408 answers are counted too);
* :class:`RequestGate` (ASGI): the API key is checked from the headers before any byte of the body is read (only
  ``/health`` is public; ``/docs``, ``/redoc`` and ``/openapi.json`` need the key when one is set), and a body
  larger than ``max_body_bytes`` is refused with 413 (by its Content-Length, or while it streams in);
* routes (:mod:`~kvboost_hf.server.routes`): JSON bodies are parsed and bounded in a thread (``max_json_values``);
  rendering, tokenisation and grammar compilation run in threads too (:mod:`~kvboost_hf.server.admission`);
  answers are built by :mod:`~kvboost_hf.server.responses`.

Shutdown: :class:`GracefulServer` (a ``uvicorn.Server``) first shuts the worker down for ``shutdown_grace_s`` (new
requests get 503, running ones finish or are ended cleanly), and only then lets uvicorn close connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost_hf.engine import InferenceEngine
from kvboost_hf.offload import layer_streamer
from kvboost_hf.server.admission import Admission
from kvboost_hf.server.errors import install_error_handlers
from kvboost_hf.server.gate import RequestGate
from kvboost_hf.server.metrics import Metrics
from kvboost_hf.server.routes import register_routes
from kvboost_hf.server.settings import ServerConfig
from kvboost_hf.server.transport import bounded_protocol
from kvboost_hf.server.worker import Worker

__all__ = ["GracefulServer", "RequestGate", "ServerConfig", "create_app", "uvicorn_config"]
logger = logging.getLogger(__name__)


class _CountRequests:
    """ASGI middleware: counts answered requests (and errors) per endpoint and status code. The endpoint is the
    path template of the route that matches (``/v1/models/{model_id}``), or ``other`` where none does: labels stay
    bounded whatever paths clients send."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoint_of: Callable[[Scope], str]) -> None:
        self.app, self.metrics, self.endpoint_of = app, metrics, endpoint_of

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
            endpoint = self.endpoint_of(scope)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if status >= 400:
                self.metrics.errors.labels(endpoint, str(status)).inc()


class _BadBody(StarletteHTTPException):
    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def decode_body(body: bytes, max_values: int) -> Any:
    """The JSON value of a request ``body``, refused (400) when it holds more than ``max_values`` JSON values
    (validating each costs time on the event loop) or a string with a lone UTF-16 surrogate (no text encoding
    can carry it). Runs in a thread."""
    value = json.loads(body)
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if count > max_values:
            raise _BadBody(f"request body holds more than {max_values} JSON values (this server's limit)")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _BadBody("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string") from exc
    return value


class _OffLoopJSONRequest(Request):
    """A request whose JSON body is decoded and bounded in a thread (a large body must not stall other clients)."""

    max_values = 0  # set by the app's route class (ServerConfig.max_json_values)

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await asyncio.to_thread(decode_body, await self.body(), self.max_values)
        return self._json


def _off_loop_route(max_values: int) -> type[APIRoute]:
    """The app's route class: bodies decoded by :class:`_OffLoopJSONRequest` with ``max_values``."""

    class OffLoopRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Any:
                off_loop = _OffLoopJSONRequest(request.scope, request.receive)
                off_loop.max_values = max_values
                return await handler(off_loop)

            return route

    return OffLoopRoute


class GracefulServer(uvicorn.Server):
    """uvicorn that shuts the app's worker down (``app.state.shutdown_worker``: in-flight requests finish within
    ``shutdown_grace_s``) before closing connections, so every stream ends with its final chunk and every other
    request with a complete body."""

    def __init__(self, config: uvicorn.Config, shutdown_worker: Callable[[], None]) -> None:
        super().__init__(config)
        self.shutdown_worker = shutdown_worker

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self.shutdown_worker)
        await super().shutdown(sockets)


def uvicorn_config(app: ASGIApp, settings: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: h11 with the request-reading bounds of ``settings``
    (:func:`~kvboost_hf.server.transport.bounded_protocol`); ``kwargs``: host, port, ..."""
    protocol = bounded_protocol(settings.header_timeout_s, settings.body_timeout_s, settings.max_connections_per_client)
    return uvicorn.Config(app, http=protocol, **kwargs)


def create_app(engine: InferenceEngine, settings: ServerConfig | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``engine``. The model is used only by the app's worker thread, whose first
    call warms the decode graphs up (``settings.warm_up_graphs``, parsed here: a bad value raises before serving)."""
    settings = settings or ServerConfig()
    graph_shapes = engine.graph_shapes(settings.warm_up_graphs)
    metrics = Metrics()
    worker = Worker(engine, settings, metrics=metrics)
    _register_scraped(metrics, worker, engine)

    admission = Admission(engine, settings, worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        if graph_shapes:  # on the worker, before any request: /health shows decode_graphs "warming", then "ready"
            warm_up = worker.call(functools.partial(engine.warm_up_graphs, graph_shapes))
            warm_up.add_done_callback(_log_warm_up)
        if settings.grammar_limits.start_with_server:
            await asyncio.to_thread(admission.start)  # the compile processes come up while the server serves
        yield
        await asyncio.to_thread(worker.shutdown, settings.shutdown_grace_s)
        await asyncio.to_thread(admission.close)

    app = FastAPI(title="kvboost_hf OpenAI-compatible server", version="0.1.0", lifespan=lifespan)
    app.router.route_class = _off_loop_route(settings.max_json_values)
    app.state.settings = settings
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.shutdown_worker = lambda: worker.shutdown(settings.shutdown_grace_s)
    app.add_middleware(
        RequestGate,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(_CountRequests, metrics=metrics, endpoint_of=functools.partial(_endpoint_of, app))
    install_error_handlers(app)
    register_routes(app, engine, settings, worker, admission, metrics)
    return app


def _log_warm_up(done: concurrent.futures.Future) -> None:
    """Log the outcome of the server's decode graph warm-up."""
    if (error := done.exception()) is not None:
        logger.error("decode graph warm-up failed: %s; shapes compile at their first step", error, exc_info=error)
        return
    result = done.result()
    logger.info("decode graphs warmed up in %.1f s: %d captured, %d skipped, %d failed", result.seconds,
                len(result.warmed), len(result.skipped), len(result.failed))  # fmt: skip


SPECULATIVE_COUNTERS = {
    "target_forwards": "Forwards of the target model in engine.generate calls (a batch's rows share them).",
    "verify_forwards": "Target forwards that verified draft tokens (each speculative step; the prompt forward too "
    "when it verified the first tree).",
    "draft_tokens_proposed": "Draft tokens (tree nodes) the target verified.",
    "draft_tokens_accepted": "Draft tokens the target kept.",
}


KV_COUNTERS = {
    "kv_preemptions": "Requests preempted to keep the running rows' K/V within the K/V budget (resumed later).",
    "kv_rows_preempted": "Rows preempted to keep the running rows' K/V within the K/V budget.",
    "kv_admissions_deferred": "Requests whose admission waited for K/V memory (each counted once).",
}

KV_GAUGES = {
    "kv_reserved_bytes": "Projected K/V bytes of the running batches after the latest schedule.",
    "kv_peak_reserved_bytes": "The most projected K/V bytes after any schedule, over the engine's life.",
}


STREAMING_METRICS = (
    ("kvboost_streamed_bytes", "bytes_streamed", "Bytes of streamed decoder layers copied to the device."),
    ("kvboost_streamed_layer_reloads", "reloads", "Streamed layers copied when about to run (no prefetch)."),
    ("kvboost_streamed_wait_seconds", "wait_seconds", "Seconds the compute waited on layer copies."),
)


def _register_scraped(metrics: Metrics, worker: Worker, engine: InferenceEngine) -> None:
    """Scraped metrics; those of the engine read the one ``engine.cache_stats`` snapshot of the scrape, taken with
    host-side counters only (a scrape never synchronises the device nor waits for the model)."""
    metrics.read_state_with(lambda: engine.cache_stats(settle=False))
    metrics.gauge("kvboost_queue_depth", "Requests waiting for admission.", lambda: worker.queue_depth)
    metrics.gauge("kvboost_running_rows", "Rows generating now.", lambda: worker.running_rows)

    def store_hits() -> dict[str, float]:
        return {tier: metrics.state.get(f"{tier}_hits", 0) for tier in ("ram", "disk", "remote")}

    metrics.scraped_counter("kvboost_store_hits", "Chunk store hits by tier.", "tier", store_hits)
    metrics.gauge(
        "kvboost_store_misses_total", "Chunk store misses.", functools.partial(_state_value, metrics, "misses")
    )
    for name, help_text in SPECULATIVE_COUNTERS.items():
        metrics.scraped_counter(f"kvboost_{name}", help_text, None, _state_counter(metrics, name))
    for name, help_text in KV_COUNTERS.items():  # the schedulers' MemoryCounters, engine-wide
        metrics.scraped_counter(f"kvboost_{name}", help_text, None, _state_counter(metrics, name))
    for name, help_text in KV_GAUGES.items():
        metrics.gauge(f"kvboost_{name}", help_text, functools.partial(_state_value, metrics, name))
    metrics.gauge(
        "kvboost_draft_acceptance_rate",
        "Draft tokens accepted / proposed, over the engine's life.",
        functools.partial(_state_value, metrics, "draft_acceptance_rate"),
    )
    metrics.gauge(
        "kvboost_draft_tokens_accepted_per_verify",
        "Draft tokens accepted per verify forward, over the engine's life.",
        functools.partial(_state_value, metrics, "draft_tokens_accepted_per_verify"),
    )
    if layer_streamer(engine.model) is not None:  # layer streaming: counters of the copies
        for name, field, help_text in STREAMING_METRICS:
            metrics.scraped_counter(name, help_text, None, _state_counter(metrics, f"streaming_{field}"))
        metrics.gauge(
            "kvboost_streamed_bytes_per_token",
            "Bytes streamed by decoding / generated tokens, over the engine's life.",
            functools.partial(_state_value, metrics, "streamed_bytes_per_token"),
        )


def _state_counter(metrics: Metrics, key: str) -> Callable[[], dict[str, float]]:
    """A scrape-time reader of one (unlabelled) counter of the scrape's snapshot."""
    return lambda: {"": metrics.state.get(key, 0)}


def _state_value(metrics: Metrics, key: str) -> float:
    """A scrape-time read of one gauge of the scrape's snapshot (0 when the engine does not report it)."""
    return metrics.state.get(key, 0)


def _endpoint_of(app: FastAPI, scope: Scope) -> str:
    """The path template of the app's route that matches ``scope`` (read at request time, so routes added later
    count): one that matches fully, else one whose path matches but not its method (a 405), else ``other``."""
    endpoint = "other"
    for route in app.routes:
        if not isinstance(route, Route | WebSocketRoute | Mount):
            continue
        match = route.matches(scope)[0]
        if match is Match.FULL:
            return route.path
        if match is Match.PARTIAL and endpoint == "other":
            endpoint = route.path
    return endpoint
