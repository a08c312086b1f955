"""``POST /v1/responses``: the text, streaming, structured-output and function-tool subset of OpenAI's Responses
API, served by the chat-completions machinery.

A request becomes a :class:`~kvboost_hf.server.schemas.ChatCompletionRequest` (:func:`chat_request`):
``instructions`` is the first system message; ``message`` items are chat messages (their parts stay parts, which may
mark documents); ``function_call`` items are the assistant's ``tool_calls`` (consecutive calls join one assistant
message) and ``function_call_output`` items are ``tool`` messages; ``text.format`` is ``response_format``; flat
function tools are chat tools. So prompt rendering, grammars, limits and tenant isolation (``cache_salt``) are the
chat endpoint's (:class:`~kvboost_hf.server.admission.Admission`), and the job runs in the same decode loop
(:class:`~kvboost_hf.server.responses.Exchange`).

:class:`ResponseBuilder` turns the job's events into output items and the Responses stream events, each numbered
by ``sequence_number``. A non-streaming request runs the same builder and answers its last snapshot, so streamed
and non-streamed answers are built alike. A choice cut by the token budget ends with ``status: "incomplete"``
(``incomplete_details.reason: "max_output_tokens"``) and a ``response.incomplete`` event, as OpenAI's API does.

Nothing is stored: ``store`` is accepted and echoed as false; ``previous_response_id`` is a 400.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvboost_hf.server.admission import GRAMMAR_PARAM, Admission, Prepared, client_address
from kvboost_hf.server.batching import Delta, Done, Finished
from kvboost_hf.server.errors import ApiError
from kvboost_hf.server.grammar import ToolCallDelta, ToolCallStream
from kvboost_hf.server.responses import SHUTDOWN_REASON, Exchange
from kvboost_hf.server.responses_schemas import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextPart,
    text_of,
)
from kvboost_hf.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDefinition,
)
from kvboost_hf.server.worker import Worker

# the chat request's field names in admission errors -> the Responses request's
RESPONSES_PARAM = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    GRAMMAR_PARAM: "text.format.schema",
}
RESPONSES_FIELD_NAMES = ("max_tokens", "response_format")  # chat fields an error message may name
SHUTDOWN_MESSAGE = "the server shut down before the answer was complete"


def register_responses_route(
    app: FastAPI, model_name: str, worker: Worker, admission: Admission, errors: dict[int | str, dict[str, Any]]
) -> None:
    """Add ``POST /v1/responses`` to ``app`` (authentication and body limits are the app's, as for every route)."""

    @app.post("/v1/responses", responses=errors, response_model=ResponseObject)
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        arrival = time.perf_counter()
        prepared = await _admit(admission, chat_request(body), client_address(request))
        exchange = Exchange(request, prepared, model_name, arrival)
        builder = ResponseBuilder(body, model_name, tools_offered=prepared.tool_calls)
        exchange.submit(worker)
        if prepared.stream:
            return StreamingResponse(_stream(exchange, builder, watch_disconnect=False), media_type="text/event-stream")
        async for _ in _stream(exchange, builder, watch_disconnect=True):
            pass
        return builder.result()


async def _admit(admission: Admission, chat: ChatCompletionRequest, client: str) -> Prepared:
    """``admission.chat``, its errors naming the Responses request's fields."""
    try:
        return await admission.chat(chat, client)
    except ApiError as exc:
        exc.param = RESPONSES_PARAM.get(exc.param or "", exc.param)
        for chat_field in RESPONSES_FIELD_NAMES:  # the message names them too (it named max_tokens)
            exc.message = re.sub(rf"\b{chat_field}\b", RESPONSES_PARAM[chat_field], exc.message)
        raise


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat-completions request that generates what ``body`` asks for (400 for what it cannot express)."""
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id is unsupported: this server stores no responses; send the whole conversation "
            "as 'input'",
            param="previous_response_id",
        )
    response_format = None
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        spec = None
        if fmt.type == "json_schema":
            spec = JsonSchemaSpec.model_validate(
                {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
            )
        response_format = ResponseFormat(type=fmt.type, json_schema=spec)
    tools = [
        ToolDefinition(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in body.tools or []
    ]
    choice = body.tool_choice
    return ChatCompletionRequest(
        model=body.model,
        messages=_messages(body),
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stream=bool(body.stream),
        user=body.user,
        cache_salt=body.cache_salt,
        document_boundaries=body.document_boundaries,
        response_format=response_format,
        tools=tools or None,
        tool_choice=NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        if choice is not None and not isinstance(choice, str)
        else choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=_chat_content(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":  # the calls of one turn join its message
                last = messages[-1]
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=text_of(item.output), tool_call_id=item.call_id))
    return messages


def _chat_content(content: str | list[TextPart]) -> str | list[ContentPart]:
    """A message item's content as a chat message's: its parts stay parts (they may mark documents)."""
    if isinstance(content, str):
        return content
    return [ContentPart(type="text", text=part.text) for part in content]


async def _stream(exchange: Exchange, builder: ResponseBuilder, watch_disconnect: bool) -> AsyncIterator[str]:
    """The SSE events of ``exchange``'s job, from ``response.created`` to its final event; a consumer that stops
    early (a client gone) cancels the job."""
    for event in builder.start():
        yield event
    async with contextlib.aclosing(exchange.events(watch_disconnect)) as job_events:  # closed: the job is cancelled
        async for job_event in job_events:
            if isinstance(job_event, Delta):
                events = builder.add(job_event.text)
            elif isinstance(job_event, Finished):
                events = builder.finish(job_event.reason)
            elif isinstance(job_event, Done):
                events = builder.done(job_event)
            else:
                events = builder.fail(ApiError(job_event.status, job_event.message, code="generation_failed"))
            for event in events:
                yield event


class ResponseBuilder:
    """One ``response`` built from its job's events. Each step returns the SSE events it implies (``event:`` and
    ``data:`` lines, serialised at once: later steps may change the items they carry)."""

    def __init__(self, body: ResponsesRequest, model_name: str, tools_offered: bool) -> None:
        self.body, self.model_name = body, model_name
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.calls = ToolCallStream() if tools_offered else None  # tool calls parsed from the text when offered
        self.text = ""  # everything generated so far
        self.output: list[dict[str, Any]] = []
        self.open_item: dict[str, Any] | None = None  # the item being written (then output[-1]); None between items
        self.reason: str | None = None  # the job's finish reason once it finished
        self.usage: ResponseUsage | None = None
        self.failure: ApiError | None = None
        self.sequence = 0

    # ------------------------------------------------------------------ steps
    def start(self) -> list[str]:
        """The first events: the response created and in progress, with no output yet."""
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def add(self, text: str, final: bool = False) -> list[str]:
        """Events for newly generated ``text`` (``final``: the text is complete, nothing may be held back)."""
        self.text += text
        if self.calls is None:
            return self._text_delta(text) if text else []
        content, deltas = self.calls.update(self.text, final=final)
        events = self._text_delta(content) if content else []
        for delta in deltas:
            events += self._call_delta(delta)
        return events

    def finish(self, reason: str) -> list[str]:
        """The job's text is complete: the last item is closed (incomplete when cut by the budget or a shutdown)."""
        self.reason = reason
        events = self.add("", final=True)
        if not self.output:  # an empty answer is an empty message
            events += self._open_message()
        return events + self._close("completed" if reason == "stop" else "incomplete")

    def done(self, done: Done) -> list[str]:
        """The job ended: the final event, with the whole response."""
        self.usage = ResponseUsage(
            input_tokens=done.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=done.cached_tokens),
            output_tokens=done.completion_tokens,
            total_tokens=done.prompt_tokens + done.completion_tokens,
        )
        if self.reason == SHUTDOWN_REASON:
            return self.fail(ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down"))
        kind = "response.incomplete" if self.reason == "length" else "response.completed"
        return [self._event(kind, response=self._snapshot())]

    def fail(self, error: ApiError) -> list[str]:
        """The job failed: ``response.failed``, the response carrying ``error``'s message."""
        self.failure = error
        return [self._event("response.failed", response=self._snapshot())]

    def result(self) -> ResponseObject:
        """The finished response; raises the job's failure as an error answer (499 when the client went away)."""
        if self.failure is not None:
            raise self.failure
        if self.usage is None:
            raise ApiError(499, "client disconnected")
        return self._snapshot()

    # ------------------------------------------------------------------ items
    def _open_message(self) -> list[str]:
        """Start an assistant message holding one empty ``output_text`` part."""
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        item: dict[str, Any] = {
            "id": _new_id("msg_"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        events = self._open(item)
        item["content"] = [part]  # after the added event: the part is announced by its own event
        return [*events, self._item_event("response.content_part.added", content_index=0, part=part)]

    def _text_delta(self, text: str) -> list[str]:
        events = []
        if self.open_item is None or self.open_item["type"] != "message":
            events += self._open_message()
        assert self.open_item is not None
        self.open_item["content"][0]["text"] += text
        events.append(self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=[]))
        return events

    def _call_delta(self, delta: ToolCallDelta) -> list[str]:
        events = []
        if delta.name is not None:
            events += self._open(
                {
                    "id": _new_id("fc_"),
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": _new_id("call_"),
                    "name": delta.name,
                    "arguments": "",
                }
            )
        assert self.open_item is not None and self.open_item["type"] == "function_call"
        if delta.arguments:
            self.open_item["arguments"] += delta.arguments
            events.append(self._item_event("response.function_call_arguments.delta", delta=delta.arguments))
        return events

    def _open(self, item: dict[str, Any]) -> list[str]:
        """Close the item being written and start ``item``."""
        events = self._close("completed")
        self.output.append(item)
        self.open_item = item
        return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _close(self, status: str) -> list[str]:
        item = self.open_item
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self._item_event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]),
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
        else:
            events = [
                self._item_event(
                    "response.function_call_arguments.done", name=item["name"], arguments=item["arguments"]
                )
            ]
        self.open_item = None
        return [*events, self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    # ------------------------------------------------------------------ serialisation
    def _item_event(self, kind: str, **fields: Any) -> str:
        """An event about the item being written (its id and output index added)."""
        assert self.open_item is not None
        return self._event(kind, item_id=self.open_item["id"], output_index=len(self.output) - 1, **fields)

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        if isinstance(data.get("response"), ResponseObject):
            data["response"] = data["response"].model_dump()
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _snapshot(self) -> ResponseObject:
        body = self.body
        status: Literal["in_progress", "completed", "incomplete", "failed"]
        if self.failure is not None:
            status, error = "failed", ResponseError(code="server_error", message=self.failure.message)
        else:
            status = "in_progress" if self.usage is None else "incomplete" if self.reason == "length" else "completed"
            error = None
        choice = body.tool_choice
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            model=self.model_name,
            output=self.output,
            usage=self.usage,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=body.temperature,
            text=body.text.model_dump(by_alias=True, exclude_none=True)
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}},
            tool_choice=choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            top_p=body.top_p,
            user=body.user,
        )


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
