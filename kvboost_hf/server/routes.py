"""The HTTP routes: OpenAI endpoints (models, chat and text completions, responses), tokenize/detokenize, warm,
health and metrics. Authentication and the body limit are checked before a route runs (see
:mod:`kvboost_hf.server.app`)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response

from kvboost_hf.engine import InferenceEngine, Prompt
from kvboost_hf.results import WarmResult
from kvboost_hf.server.admission import Admission, client_address
from kvboost_hf.server.errors import ApiError
from kvboost_hf.server.metrics import CONTENT_TYPE, Metrics
from kvboost_hf.server.responses import Exchange
from kvboost_hf.server.responses_api import register_responses_route
from kvboost_hf.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    WarmRequest,
    WarmResponse,
    plain_messages,
)
from kvboost_hf.server.settings import ServerConfig
from kvboost_hf.server.worker import ShuttingDown, Worker

ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


def register_routes(
    app: FastAPI,
    engine: InferenceEngine,
    settings: ServerConfig,
    worker: Worker,
    admission: Admission,
    metrics: Metrics,
) -> None:
    """Add every route to ``app``."""
    _register_service_routes(app, engine, settings, worker, admission, metrics)
    _register_generation_routes(app, engine, settings, worker, admission)


def _register_service_routes(
    app: FastAPI,
    engine: InferenceEngine,
    settings: ServerConfig,
    worker: Worker,
    admission: Admission,
    metrics: Metrics,
) -> None:
    """Health, metrics, the model list and (de)tokenization."""
    card = ModelCard(id=settings.model_name, created=int(time.time()))

    @app.get("/health", responses=ERRORS)
    async def health() -> dict[str, Any]:
        """Liveness (no API key needed): queue depth, running rows, whether structured output's compile
        processes are up (``structured_output``: ready, starting or idle; a readiness probe can wait for ready), and
        the decode graphs' warm-up (``decode_graphs``: warming, ready, lazy without a warm-up, or off; see
        ``ServerConfig.warm_up_graphs``)."""
        return {
            "status": "ok",
            "queue_depth": worker.queue_depth,
            "running_rows": worker.running_rows,
            "structured_output": admission.structured_output,
            "decode_graphs": engine.graphs.state,
        }

    @app.get("/metrics", responses=ERRORS)
    async def prometheus() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id}", responses=ERRORS)
    async def model(model_id: str) -> ModelCard:
        admission.check_model(model_id)
        return card

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt (as /v1/completions tokenises it) or of chat messages (as chat renders them)."""
        admission.check_model(body.model)
        tokens = await admission.tokenize(body.prompt, body.messages, body.add_generation_prompt)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_context)

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        admission.check_model(body.model)
        return DetokenizeResponse(prompt=await admission.detokenize(body.tokens))


def _register_generation_routes(
    app: FastAPI, engine: InferenceEngine, settings: ServerConfig, worker: Worker, admission: Admission
) -> None:
    """Warming, chat completions, completions and responses: the routes that run the model."""

    @app.post("/v1/warm", responses=ERRORS)
    async def warm(body: WarmRequest, request: Request) -> WarmResponse:
        """Pre-load a text (or chat messages) so later prompts starting with it hit the cache, or documents so
        that chat prompts marking them as documents hit them anywhere (figures summed over the documents).

        Documents are stored one per worker call, so decoding of other requests runs between two documents, and
        storing stops at the next document once the client has disconnected; at most ``max_warm_documents`` per
        request (400 beyond)."""
        given = [name for name in ("text", "messages", "documents") if getattr(body, name) is not None]
        if len(given) != 1:
            raise ApiError(400, "give exactly one of 'text', 'messages' or 'documents'", param="text")
        if body.documents is not None and not all(body.documents):
            raise ApiError(400, "documents must be non-empty strings", param="documents")
        limit = settings.max_warm_documents
        if body.documents is not None and len(body.documents) > limit:
            message = f"{len(body.documents)} documents exceed this server's limit of {limit} per warm request"
            raise ApiError(400, message, param="documents")
        slices: list[Callable[[], list[WarmResult]]]
        if body.documents is not None:
            salt = body.cache_salt
            slices = [functools.partial(engine.warm_documents, [doc], cache_salt=salt) for doc in body.documents]
        else:
            messages = body.messages or []
            prompt: Prompt
            if body.text is not None:
                prompt = body.text
            elif any(m.tool_calls or m.role == "tool" for m in messages):  # rendered as chat renders tool history
                prompt = await admission.tokenize(None, messages, False)
            else:
                prompt = plain_messages(messages)
            slices = [lambda: [engine.warm(prompt, cache_salt=body.cache_salt)]]
        results: list[WarmResult] = []
        try:
            for store in slices:  # each on the worker thread, between decode steps
                if await request.is_disconnected():
                    raise ApiError(499, "the client disconnected; warming stopped")
                results += await asyncio.wrap_future(worker.call(store))
        except ShuttingDown as exc:
            raise ApiError(503, str(exc)) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc), param=given[0]) from exc
        return WarmResponse(
            chunks_stored=sum(result.chunks_stored for result in results),
            token_count=sum(result.token_count for result in results),
            chunk_size=results[0].chunk_size,
            partial_tail_tokens=sum(result.partial_tail_tokens for result in results),
            alignment_warning=results[0].alignment_warning if body.documents is None else None,
        )

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion:
        arrival = time.perf_counter()
        prepared = await admission.chat(body, client_address(request))
        return await Exchange(request, prepared, settings.model_name, arrival).respond(worker)  # type: ignore[return-value]

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Completion:
        arrival = time.perf_counter()
        prepared = await admission.completion(body)
        return await Exchange(request, prepared, settings.model_name, arrival).respond(worker)  # type: ignore[return-value]

    register_responses_route(app, settings.model_name, worker, admission, ERRORS)
