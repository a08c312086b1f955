"""From a running job's events to the HTTP answer: one JSON body, or SSE chunks sent as the tokens come.

The worker reports through ``job.sink`` from its own thread; :class:`Exchange` moves each event onto the event
loop with ``loop.call_soon_threadsafe`` (no second event loop) and builds the OpenAI bodies from them.

Tool calls: when the request offered tools, the text of each choice is read for ``<tool_call>`` tags
(:func:`~kvboost_hf.server.grammar.parse_tool_calls`); the calls are answered as ``tool_calls`` with
``finish_reason: "tool_calls"``. While streaming, the text before the first tag is sent as content as it comes
(a partial tag is held back), then each call as tool-call deltas: its id and name first, then its argument text
as the tokens come (:class:`~kvboost_hf.server.grammar.ToolCallStream`). Both read by the same rules, so a stream adds
up to the whole answer, and no markup reaches content or arguments. A call cut by ``max_tokens`` is answered with
the arguments text generated before the cut (not valid JSON) and ``finish_reason: "length"``, as OpenAI does.

A choice ended by a shutdown (reason "cancelled") ends a stream with ``finish_reason: "length"`` (the answer is
cut short), usage and ``[DONE]``; a non-streaming request gets a 503 error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvboost_hf.core.errors import CapacityError
from kvboost_hf.server.admission import Prepared
from kvboost_hf.server.batching import Delta, Done, Event, Failed, Finished, Job, TextLogprob
from kvboost_hf.server.errors import ApiError
from kvboost_hf.server.grammar import ToolCall, ToolCallDelta, ToolCallStream, parse_tool_calls
from kvboost_hf.server.schemas import (
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    Usage,
)
from kvboost_hf.server.worker import Overloaded, ShuttingDown, Worker

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25
SHUTDOWN_REASON = "cancelled"


class Exchange:
    """One generation request from submission to its last event."""

    def __init__(self, request: Request, prepared: Prepared, model_name: str, arrival: float) -> None:
        self.request, self.prepared, self.model_name = request, prepared, model_name
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(self.queue.put_nowait, event)

        self.job = Job(
            prepared.prompt_ids,
            prepared.params,
            sink,
            n=prepared.n,
            cache_salt=prepared.cache_salt,
            segment_starts=prepared.segment_starts,
            arrival=arrival,
        )
        self.chat = prepared.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.want_logprobs = prepared.params.top_logprobs is not None

    async def respond(self, worker: Worker) -> ChatCompletion | Completion | StreamingResponse:
        self.submit(worker)
        if self.prepared.stream:
            return StreamingResponse(self._sse(), media_type="text/event-stream")
        return await self._collect()

    def submit(self, worker: Worker) -> None:
        """Queue the job on ``worker``: 429 (with ``Retry-After``) when its queue is full, 503 while it shuts down."""
        try:
            worker.submit(self.job)
        except Overloaded as exc:
            headers = {"Retry-After": str(exc.retry_after_s)}
            raise ApiError(429, str(exc), code="rate_limit_exceeded", headers=headers) from exc
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), code="shutting_down") from exc
        except CapacityError as exc:  # its K/V (prompt and max_tokens) cannot fit the server's K/V budget
            raise ApiError(400, str(exc), param="max_tokens") from exc

    async def events(self, watch_disconnect: bool) -> AsyncGenerator[Event, None]:
        """The job's events until Done or Failed; cancels the job when the consumer stops early. With
        ``watch_disconnect`` the client is looked at every :data:`DISCONNECT_POLL_S` seconds, events flowing or not
        (a client gone from a non-streamed answer stops its generation within that)."""
        loop = asyncio.get_running_loop()
        next_look = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    event = None
                if watch_disconnect and loop.time() >= next_look:
                    next_look = loop.time() + DISCONNECT_POLL_S
                    if await self.request.is_disconnected():
                        logger.info("client of %s went away; cancelling", self.id)
                        return
                if event is None:
                    continue
                yield event
                if isinstance(event, Done | Failed):
                    return
        finally:
            self.job.cancel.set()

    # ------------------------------------------------------------------ one body
    async def _collect(self) -> ChatCompletion | Completion:
        n = self.prepared.n
        texts, reasons = [""] * n, ["stop"] * n
        logprobs: list[list[TextLogprob]] = [[] for _ in range(n)]
        done: Done | None = None
        async for event in self.events(watch_disconnect=True):
            if isinstance(event, Delta):
                texts[event.index] += event.text
                logprobs[event.index] += event.logprobs
            elif isinstance(event, Finished):
                reasons[event.index] = event.reason
            elif isinstance(event, Done):
                done = event
            else:
                raise ApiError(event.status, event.message, code="generation_failed")
        if done is None:
            raise ApiError(499, "client disconnected")
        if SHUTDOWN_REASON in reasons:
            raise ApiError(503, "the server shut down before the answer was complete", code="shutting_down")
        usage = _usage(done)
        if self.chat:
            choices = []
            for i in range(n):
                message, reason = self._message(texts[i], reasons[i])
                lp = _chat_logprobs(logprobs[i]) if self.want_logprobs else None
                choices.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=reason))
            return ChatCompletion(id=self.id, created=self.created, model=self.model_name, usage=usage, choices=choices)
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model_name,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=i,
                    text=texts[i],
                    logprobs=_completion_logprobs(logprobs[i]) if self.want_logprobs else None,
                    finish_reason=reasons[i],
                )
                for i in range(n)
            ],
        )

    def _message(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message of one choice and its finish reason (tool calls parsed when tools were offered)."""
        if not self.prepared.tool_calls:
            return {"role": "assistant", "content": text}, reason
        content, calls = parse_tool_calls(text)
        if not calls:
            return {"role": "assistant", "content": content}, reason
        message = {"role": "assistant", "content": content or None, "tool_calls": [_tool_call(c) for c in calls]}
        return message, _finish_reason(reason, all(call.complete for call in calls))

    # ------------------------------------------------------------------ SSE
    async def _sse(self) -> AsyncIterator[str]:
        """SSE ``data:`` lines: one chunk per event as soon as it arrives, then ``[DONE]``."""
        n = self.prepared.n
        texts = [""] * n
        calls = [ToolCallStream() for _ in range(n)]
        call_ids: list[list[str]] = [[] for _ in range(n)]
        if self.chat:
            for i in range(n):
                role = {"role": "assistant", "content": ""}
                yield self._chunk({"index": i, "delta": role, "logprobs": None, "finish_reason": None})
        async for event in self.events(watch_disconnect=False):
            if isinstance(event, Delta | Finished):
                i = event.index
                if isinstance(event, Delta):
                    texts[i] += event.text
                if not self.prepared.tool_calls:
                    if isinstance(event, Delta):
                        yield self._chunk(self._delta_choice(i, event.text, event.logprobs))
                else:  # tools offered: content before the first call, then the calls as they grow
                    content, deltas = calls[i].update(texts[i], final=isinstance(event, Finished))
                    if content:
                        yield self._chunk(self._delta_choice(i, content, ()))
                    for delta in deltas:
                        yield self._chunk(self._tool_delta_choice(i, delta, call_ids[i]))
                if isinstance(event, Finished):
                    reason = "length" if event.reason == SHUTDOWN_REASON else event.reason
                    reason = _finish_reason(reason, calls[i].calls_complete)
                    empty: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
                    yield self._chunk({"index": i, **empty, "logprobs": None, "finish_reason": reason})
            elif isinstance(event, Done):
                if self.prepared.include_usage:
                    yield self._chunk(None, _usage(event).model_dump())
            else:
                yield f"data: {json.dumps(ApiError(event.status, event.message, code='generation_failed').body())}\n\n"
        yield "data: [DONE]\n\n"

    def _tool_delta_choice(self, index: int, delta: ToolCallDelta, ids: list[str]) -> dict[str, Any]:
        """A chunk choice carrying one tool-call delta (id, type and name on the call's first delta)."""
        call: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.arguments}}
        if delta.name is not None:
            ids.append(_call_id())
            call.update(id=ids[-1], type="function")
            call["function"]["name"] = delta.name
        return {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}

    def _delta_choice(self, index: int, text: str, logprobs: tuple[TextLogprob, ...]) -> dict[str, Any]:
        if self.chat:
            lp = _chat_logprobs(list(logprobs)) if self.want_logprobs else None
            return {"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        lp = _completion_logprobs(list(logprobs)) if self.want_logprobs else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": None}

    def _chunk(self, choice: dict[str, Any] | None, usage: Any = None) -> str:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [] if choice is None else [choice],
        }
        if self.prepared.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"


def _finish_reason(reason: str, calls_complete: bool) -> str:
    """A choice's finish reason: "tool_calls" for one that ended by itself with calls, each of them complete; one
    cut (by the token budget: "length", or by a stop string inside a call: "stop") keeps its reason."""
    return "tool_calls" if calls_complete and reason == "stop" else reason


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _usage(done: Done) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def _token_entry(token: str, logprob: float, raw: bytes) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(raw)}


def _chat_logprobs(entries: list[TextLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: each token's text, log-probability and own bytes (which join into the answer's
    UTF-8 even where a token holds part of a character), and the same of its top alternatives."""
    return {
        "content": [
            {
                **_token_entry(e.token, e.logprob, e.token_bytes),
                "top_logprobs": [_token_entry(t, lp, raw) for (t, lp), raw in zip(e.top, e.top_bytes, strict=True)],
            }
            for e in entries
        ]
    }


def _completion_logprobs(entries: list[TextLogprob]) -> dict[str, Any]:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": [e.offset for e in entries],
    }
