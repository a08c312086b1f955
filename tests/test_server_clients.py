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

from test_server import KEY, MODEL, LiveServer, chat  # noqa: E402

from kvboost_hf import KVBoost  # noqa: E402
from kvboost_hf.server.app import ServerSettings, create_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # a tool call is 40-50 tokens of a 135M model on CPU

NO_ARGUMENTS_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time", "parameters": {"type": "object"}},
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
WEATHER_QUESTION = chat("What is the weather in Paris?", "You are a helpful assistant.")


@pytest.fixture(scope="module")
def engine():
    return KVBoost.from_pretrained(chunk_size=16)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[LiveServer]:
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_batch_size=4)
    with LiveServer(create_app(engine, settings)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client().with_options(timeout=300)


def named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


# ---------------------------------------------------------------------------------------------- item 10.1
def test_tool_arguments_are_compact_json_and_a_no_argument_tool_finishes(client):
    """The tool-argument grammar is the json_schema path's compact one: no free whitespace to pad with."""
    for tool, question in [(NO_ARGUMENTS_TOOL, chat("What time is it?")), (WEATHER_TOOL, WEATHER_QUESTION)]:
        response = client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=80, temperature=0, tools=[tool], tool_choice=named(tool)
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        arguments = choice.message.tool_calls[0].function.arguments
        assert arguments == json.dumps(json.loads(arguments))  # compact: ", " and ": " only
    assert arguments != "{}" and json.loads(arguments)["city"]
