"""Client compatibility (issue #22 item 10): tool calling and request shapes as real OpenAI clients use them,
driven by the official ``openai`` client against a live server on 127.0.0.1 with the embedded model (see
tests/test_server.py). Greedy decoding throughout, so each answer is reproducible."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from helpers import API_KEY, MODEL_NAME, WEATHER_TOOL, LiveServer, chat, http_get, short_embedded_engine  # noqa: E402

from kvboost_hf.server.app import ServerConfig, create_app  # noqa: E402
from kvboost_hf.server.grammar import GrammarConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # a tool call is 40-50 tokens of a 135M model on CPU

NO_ARGUMENTS_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time",
        "parameters": {"type": "object", "properties": {}},  # as LangChain sends a tool without arguments
    },
}
WEATHER_QUESTION = chat("What is the weather in Paris?", "You are a helpful assistant.")


@pytest.fixture(scope="module")
def engine():
    return short_embedded_engine(chunking=16)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[LiveServer]:
    one_process = GrammarConfig(workers=1)  # one compile process serves these tests
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, max_batch_size=4, grammar_limits=one_process)
    with LiveServer(create_app(engine, settings)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client().with_options(timeout=300)


def named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


def streamed(client, **request) -> tuple[str, list[tuple[str, str]], str | None]:
    """``(content, [(name, arguments)], finish_reason)`` added up from a streamed chat completion."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.function.name:
                    calls.append((delta.function.name, ""))
                name, arguments = calls[delta.index]
                calls[delta.index] = (name, arguments + (delta.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, calls, finish


def whole(client, **request) -> tuple[str, list[tuple[str, str]], str | None]:
    """The same triple from a whole (non-streamed) chat completion."""
    choice = client.chat.completions.create(**request).choices[0]
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


# ---------------------------------------------------------------------------------------------- item 10.1
def test_a_no_argument_tool_call_finishes_with_empty_arguments(client):
    """The tool-argument grammar is the json_schema path's compact one: no whitespace to pad ``{}`` with."""
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=chat("What time is it?"),
        max_tokens=64,
        temperature=0,
        tools=[NO_ARGUMENTS_TOOL],
        tool_choice=named(NO_ARGUMENTS_TOOL),
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls[0].function.arguments == "{}"


# ---------------------------------------------------------------------------------------------- item 10.2
def test_a_call_cut_by_max_tokens_leaks_no_markup_and_streams_as_whole(client):
    """Cut one token before the end (inside ``}</tool_call>``): the call is answered with its arguments, no tag
    text anywhere, ``finish_reason`` "length", and the stream adds up to the whole answer."""
    request = dict(
        model=MODEL_NAME,
        messages=WEATHER_QUESTION,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice=named(WEATHER_TOOL),
    )
    full = client.chat.completions.create(max_tokens=80, **request)
    assert full.choices[0].finish_reason == "tool_calls"
    arguments = full.choices[0].message.tool_calls[0].function.arguments
    assert arguments == json.dumps(json.loads(arguments)) and json.loads(arguments)["city"]  # compact JSON
    cut = {**request, "max_tokens": full.usage.completion_tokens - 1}
    answer = whole(client, **cut)
    assert answer == streamed(client, **cut)
    content, calls, finish = answer
    assert (content, finish) == ("", "length")
    assert calls == [("get_weather", arguments)]  # the object was complete: only the closing tag was cut


# ---------------------------------------------------------------------------------------------- item 10.3
def test_required_tool_choice_with_parallel_calls_ends_the_turn(client):
    """``tool_choice="required"`` with the default ``parallel_tool_calls``: the embedded model repeats its call;
    the repeat ends the turn ("tool_calls", as OpenAI answers) instead of running to the token budget."""
    budget = 160
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=WEATHER_QUESTION,
        max_tokens=budget,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert calls and len(set(calls)) == len(calls) and response.usage.completion_tokens < budget


# ---------------------------------------------------------------------------------------------- item 10.4
def test_message_extras_and_explicit_nulls_are_accepted(client):
    """litellm's documented tool round trip sends the assistant message back with ``provider_specific_fields``;
    SDKs send ``null`` for options set to None (the default then), and a message may carry a ``name``."""
    history = [
        {"role": "system", "content": "You are a helpful assistant.", "name": "setup"},
        {"role": "user", "content": "What is the weather in Paris?", "name": "alice", "provider_specific_fields": {}},
        {
            "role": "assistant",
            "content": None,
            "function_call": None,
            "provider_specific_fields": {"refusal": None},
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "index": 0,
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C", "name": "get_weather"},
    ]
    nulls = dict(n=None, presence_penalty=None, frequency_penalty=None, stream=None, logprobs=None)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=history, max_tokens=2, tools=[WEATHER_TOOL], parallel_tool_calls=None, **nulls
    )
    assert len(answer.choices) == 1 and answer.usage.completion_tokens <= 2
    text = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1, **nulls)
    assert len(text.choices) == 1 and text.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="functions"):  # unknown request fields are still refused
        client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=1, extra_body={"functions": None})


# ---------------------------------------------------------------------------------------------- item 10.5
def test_completion_logprobs_carry_text_offsets(client, engine):
    """``text_offset[i]`` is where token i starts in the returned text, whole and streamed (offsets into the
    whole text); a logit bias makes the model write "é" (one character, two bytes in UTF-8: byte offsets would
    differ)."""
    [accented] = engine.tokenizer.encode("é", add_special_tokens=False)
    request = dict(model=MODEL_NAME, prompt="Le café de la crème brûlée est", max_tokens=10, temperature=0, logprobs=1)
    request |= {"logit_bias": {str(accented): 100}}
    choice = client.completions.create(**request).choices[0]
    text, logprobs = choice.text, choice.logprobs
    offsets = logprobs.text_offset
    assert len(offsets) == len(logprobs.tokens) == 10 and offsets[0] == 0
    assert not text.isascii()  # character offsets, not byte offsets, are checked
    for token, start, end in zip(logprobs.tokens, offsets, [*offsets[1:], len(text)], strict=True):
        if "\ufffd" not in token:  # a whole-character token: exactly its text at its offset
            assert text[start:end] == token, (text, logprobs.tokens, offsets)
    stream = client.completions.create(stream=True, **request)
    streamed_offsets = [
        offset for chunk in stream for part in chunk.choices if part.logprobs for offset in part.logprobs.text_offset
    ]
    assert streamed_offsets == offsets


def test_bearer_scheme_is_case_insensitive(server):
    for scheme, status in [("bearer", 200), ("BEARER", 200), ("Bearer", 200), ("Basic", 401)]:
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        assert http_get(f"{server.url}/v1/models", headers=headers, timeout=10).status_code == status, scheme
    assert http_get(f"{server.url}/v1/models", headers={"Authorization": "bearer wrong"}).status_code == 401
