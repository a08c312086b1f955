"""The server against transformers' own ``generate()`` (tests/oracle.py), not against the engine's decode loop.

Requests go over HTTP with the official ``openai`` client; the oracle runs ``model.generate`` on the same rendered
prompt (``engine.encode``: the server's rendering of plain chat messages and of completion prompts). Greedy must be
identical; a seeded sampled choice ``i`` (seed ``s + i``) must draw what ``generate`` draws for the prompt alone
under ``torch.manual_seed(s + i)`` with the same processors.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from oracle import Reference, engine_reference

from kvboost_hf.hf.sampling import SamplingConfig

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import API_KEY, MODEL_NAME, SYSTEM, LiveServer  # noqa: E402

from kvboost_hf.server.app import ServerConfig, create_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def server(embedded_engine) -> Iterator[LiveServer]:
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, batch_window_ms=30, max_batch_size=4, max_queue=16)
    with LiveServer(create_app(embedded_engine, settings)) as live:
        yield live


def text_of(engine, expected: Reference) -> str:
    return engine.tokenizer.decode(expected.tokens, skip_special_tokens=True)


def test_greedy_chat_and_completion_equal_transformers_generate(embedded_engine, server):
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a large city in Japan."}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    expected = engine_reference(embedded_engine, messages, 12)
    assert chat.choices[0].message.content == text_of(embedded_engine, expected)
    assert chat.usage.completion_tokens == len(expected.tokens)
    prompt = "The three primary colours are"
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0)
    expected = engine_reference(embedded_engine, prompt, 10)
    assert completion.choices[0].text == text_of(embedded_engine, expected)
    assert completion.usage.completion_tokens == len(expected.tokens)


def test_seeded_sampled_choices_equal_transformers_generate_alone(embedded_engine, server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Invent a name for a cat."}]
    response = server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, n=2, temperature=0.9, top_p=0.95, presence_penalty=0.5,
        seed=11, extra_body={"top_k": 30},
    )  # fmt: skip
    assert len(response.choices) == 2
    for choice in response.choices:
        sampling = SamplingConfig(temperature=0.9, top_p=0.95, top_k=30, presence_penalty=0.5, seed=11 + choice.index)
        expected = engine_reference(embedded_engine, messages, 8, sampling)
        assert choice.message.content == text_of(embedded_engine, expected), choice.index
