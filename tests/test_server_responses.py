"""``POST /v1/responses`` (issue #22 item 10): the request translation and the event builder alone (checked
against the ``openai`` SDK's own types), then the official ``openai`` client over loopback against the embedded
model (servers as in tests/test_server.py): text, streaming, structured output, function tools and errors, each
compared with what the chat endpoint gives for the same conversation."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pydantic
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import (  # noqa: E402
    API_KEY,
    MODEL_NAME,
    PERSON,
    SYSTEM,
    WEATHER_TOOL,
    LiveServer,
    chat,
    chat_server_settings,
    http_post,
    metric,
    short_embedded_engine,
)

from kvboost_hf.server.app import create_app  # noqa: E402
from kvboost_hf.server.batching import Done  # noqa: E402
from kvboost_hf.server.errors import ApiError  # noqa: E402
from kvboost_hf.server.responses_api import ResponseBuilder, chat_request  # noqa: E402
from kvboost_hf.server.responses_schemas import ResponsesRequest  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# the chat tool of test_server in the Responses API's flat form
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
QUESTION = "What is the capital of France?"


def validated(**fields) -> ResponsesRequest:
    """A validated request body asking ``hi`` with ``fields``."""
    return ResponsesRequest.model_validate({"model": MODEL_NAME, "input": "hi", **fields})


def sdk_events(events: list[str]) -> list:
    """The SSE events parsed with the openai SDK's stream event types (validated, not just constructed)."""
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    parsed = []
    for event in events:
        name, data = event.removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        if payload.get("response", {}).get("usage"):  # cache_write_tokens is not counted per request: left out
            payload["response"]["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
        parsed.append(adapter.validate_python(payload))
    return parsed


def test_items_translate_to_the_chat_request():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    body = validated(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                         {"type": "input_text", "text": "in Oslo and Rome?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {**call, "id": "fc_1", "status": "completed"},
            {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Sun"}]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=7,
        parallel_tool_calls=False,
    )  # fmt: skip
    chat = chat_request(body)
    roles = [(m.role, m.text()) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("user", "Weather in Oslo and Rome?"), ("assistant", "Checking."),
                     ("tool", "Rain"), ("tool", "Sun")]  # fmt: skip
    calls = chat.messages[2].tool_calls  # both calls of the turn join the assistant's message
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "get_weather", '{"city": "Oslo"}'), ("call_2", "get_weather", '{"city": "Rome"}')]  # fmt: skip
    assert [m.tool_call_id for m in chat.messages[3:]] == ["call_1", "call_2"]
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.json_schema.schema_ == PERSON and chat.response_format.json_schema.strict
    assert chat.max_tokens == 7 and chat.parallel_tool_calls is False
    with pytest.raises(ApiError, match="previous_response_id"):
        chat_request(validated(previous_response_id="resp_1"))


def test_builder_streams_text_then_a_call_as_the_sdk_types_say():
    builder = ResponseBuilder(validated(tools=[WEATHER]), MODEL_NAME, tools_offered=True)
    pieces = ["Let me check. ", "<tool", '_call>{"name": "get_weather", "arguments": ', '{"city": ', '"Oslo"}',
              "}</tool_call>"]  # fmt: skip
    events = builder.start()
    for piece in pieces:
        events += builder.add(piece)
    events += builder.finish("stop") + builder.done(Done(prompt_tokens=20, cached_tokens=16, completion_tokens=6))
    parsed = sdk_events(events)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type.removeprefix("response.") for e in parsed] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "output_text.delta",  # the text before the tag
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",  # as they arrive
        "function_call_arguments.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    final = parsed[-1].response
    message, call = final.output
    assert final.status == "completed" and message.content[0].text == "Let me check."  # space before a call dropped
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"} and call.status == "completed"
    assert final.usage.input_tokens_details.cached_tokens == 16 and final.usage.total_tokens == 26
    streamed = json.loads(events[-1].split("data: ", 1)[1])["response"]
    assert builder.result().model_dump(mode="json") == streamed  # a non-streaming request answers the same body


def test_builder_ends_cut_failed_and_empty_answers():
    cut = ResponseBuilder(validated(), MODEL_NAME, tools_offered=False)
    events = sdk_events(cut.start() + cut.add("Once") + cut.finish("length") + cut.done(Done(3, 0, 1)))
    assert (
        events[-1].type == "response.incomplete"
        and events[-1].response.incomplete_details.reason == "max_output_tokens"
    )
    assert cut.result().output[0]["status"] == "incomplete"
    for reason, status in (("cancelled", 503), (None, 500)):  # a shutdown, a failed forward
        failed = ResponseBuilder(validated(), MODEL_NAME, tools_offered=False)
        steps = failed.start() + failed.add("Once")
        if reason is None:
            steps += failed.fail(ApiError(500, "boom", code="generation_failed"))
        else:
            steps += failed.finish(reason) + failed.done(Done(3, 0, 1))
        last = sdk_events(steps)[-1]
        assert last.type == "response.failed" and last.response.status == "failed" and last.response.error.message
        with pytest.raises(ApiError) as raised:
            failed.result()
        assert raised.value.status == status
    empty = ResponseBuilder(validated(), MODEL_NAME, tools_offered=False)
    events = sdk_events(empty.start() + empty.finish("stop") + empty.done(Done(3, 0, 1)))
    assert events[-1].response.output_text == "" and events[-1].response.output[0].type == "message"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = short_embedded_engine(chunking=16)
    settings = chat_server_settings()
    with LiveServer(create_app(engine, settings)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client().with_options(timeout=150)  # a bound for a loaded machine: a tool call takes ~35 tokens


def stream_events(client, **request) -> list:
    with client.responses.create(stream=True, **request) as stream:
        return list(stream)


def prompt_tokens(server: LiveServer, messages: list[dict]) -> int:
    """Tokens of ``messages`` as the chat endpoint renders them (``/tokenize``: nothing is generated)."""
    body = {"model": MODEL_NAME, "messages": messages}
    response = http_post(
        f"{server.url}/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    return response.json()["count"]


@pytest.mark.slow
def test_text_equals_chat_greedy_and_stream_concatenates_to_it(client):
    request = dict(model=MODEL_NAME, instructions=SYSTEM, input=QUESTION, max_output_tokens=8, temperature=0)
    response = client.responses.create(**request, metadata={"run": "a"}, store=True)
    chat_text = (
        client.chat.completions.create(model=MODEL_NAME, messages=chat(QUESTION), max_tokens=8, temperature=0)
        .choices[0]
        .message.content
    )
    assert response.output_text == chat_text and chat_text
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.metadata == {"run": "a"} and response.model_dump()["store"] is False  # nothing is stored
    usage = response.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"

    with client.responses.stream(**request) as stream:  # the SDK's accumulating helper parses the stream
        events = list(stream)
        final = stream.get_final_response() if response.status == "completed" else None  # needs the completed event
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    last = "response.completed" if response.status == "completed" else "response.incomplete"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == chat_text  # token by token, the same text
    if final is not None:
        assert final.output_text == chat_text and final.usage.output_tokens == usage.output_tokens


@pytest.mark.slow
def test_items_render_as_the_chat_messages(server, client):
    """A conversation given as items (parts, developer role, an earlier assistant turn) is chat's prompt."""
    history = [
        {"role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
        {"role": "user", "content": "Name a fruit."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Apple.",
                                                               "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]},
    ]  # fmt: skip
    response = client.responses.create(model=MODEL_NAME, input=history, max_output_tokens=1, temperature=0)
    messages = [*chat("Name a fruit."), {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "Another one?"}]  # fmt: skip
    assert response.usage.input_tokens == prompt_tokens(server, messages)


@pytest.mark.slow
def test_max_output_tokens_ends_incomplete(client):
    request = dict(model=MODEL_NAME, input="Tell me a long story about a dragon.", max_output_tokens=3, temperature=0)
    response = client.responses.create(**request)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    events = stream_events(client, **request)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text


@pytest.mark.slow
def test_json_schema_and_json_object_outputs_parse(client):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=150)

    parsed = client.responses.parse(  # the SDK's pydantic helper sends a strict json_schema format
        model=MODEL_NAME, input="Give me a person as JSON.", max_output_tokens=40, temperature=0, text_format=Person
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Person"
    response = client.responses.create(
        model=MODEL_NAME, input="Describe a cat as a JSON object.", max_output_tokens=4, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    assert response.output_text.startswith("{")  # constrained (cut by the budget: a prefix of a JSON object)


@pytest.mark.slow
def test_function_call_round_trip(server, client):
    request = dict(
        model=MODEL_NAME,
        input=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        max_output_tokens=64,
        temperature=0,
    )
    with ThreadPoolExecutor(2) as pool:  # sent together: one batch, one generation's time
        named = pool.submit(client.responses.create, **request, tool_choice={"type": "function", "name": "get_weather"})
        streaming = pool.submit(stream_events, client, **request, tool_choice="required", parallel_tool_calls=False)
        response, events = named.result(), streaming.result()
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert response.status == "completed" and isinstance(json.loads(call.arguments)["city"], str)

    streamed = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.name == "get_weather" and "".join(streamed) == done.arguments
    assert json.loads(done.arguments) == json.loads(call.arguments)
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    history = [*request["input"], *response.output, result]  # the call passed back as the SDK returned it
    answer = client.responses.create(
        model=MODEL_NAME, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=2, temperature=0
    )
    assert answer.output[0].type == "message" and answer.output_text
    chat_history = [
        request["input"][0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    assert answer.usage.input_tokens == prompt_tokens(server, chat_history)  # rendered as chat renders the turn


@pytest.mark.slow
def test_disconnect_mid_stream_cancels_generation(server, client):
    before = metric(server, "kvboost_completion_tokens_total")
    request = dict(model=MODEL_NAME, input="Count from 1 to 500.", max_output_tokens=200, temperature=0)
    with client.responses.create(stream=True, **request) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break  # the client leaves after its first token
    deadline = time.monotonic() + 30
    while server.app.state.worker.running_rows and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.app.state.worker.running_rows == 0
    assert metric(server, "kvboost_completion_tokens_total") - before < 100


@pytest.mark.slow
def test_cache_salt_isolates_tenants(client):
    prompt = f"Tenant test {uuid.uuid4().hex}. {SYSTEM} Which planet is largest?"

    def cached(salt: str) -> int:
        response = client.responses.create(
            model=MODEL_NAME, input=prompt, max_output_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return response.usage.input_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


BASE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}
BAD_REQUESTS = {
    "previous_response_id": ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    "unknown model": ({"model": "gpt-9"}, 404, "model"),
    "unsupported field": ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
    "empty input": ({"input": []}, 400, "input"),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
                   "input.0.message.content.0"),
    "built-in tool": ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    "unknown item": ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0"),
    "schema without name": ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, 400, "text.format"),
    "bad schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/x"}}}}, 400,
                   "text.format.schema"),
    "named tool not offered": ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400,
                               "tool_choice"),
    "budget beyond the context": ({"max_output_tokens": 10**9}, 400, "max_output_tokens"),
    "temperature too high": ({"temperature": 7}, 400, "temperature"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_style_errors_naming_the_field(server, case):
    fields, status, param = BAD_REQUESTS[case]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = http_post(f"{server.url}/v1/responses", json={**BASE, **fields}, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert "max_tokens" not in error["message"] and "response_format" not in error["message"]  # chat's names


@pytest.mark.slow
def test_api_key_required(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").responses.create(**BASE)
