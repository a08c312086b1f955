"""RAG over the server (issue 19): documents sent as content parts (or, opted in, as separate messages) start
segments, so with ``--reuse-mode chunk_kv_reuse`` they hit by content key in another order, after another prompt, or
after ``/v1/warm`` stored them alone. Driven by the official ``openai`` client against live servers on 127.0.0.1 with
the embedded model's first layers (see tests/test_server.py). Greedy decoding throughout.

What is asserted: reuse (usage's ``cached_tokens``, or store hits on /metrics when repair recomputes everything);
with repair ratio 1.0 the answer equals a cold server's; with the default repair (approximate) only that it answers.
"""

from __future__ import annotations

import concurrent.futures
import re
import uuid
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import (  # noqa: E402
    API_KEY,
    MODEL_NAME,
    LiveServer,
    http_get,
    http_post,
    metric,
    short_embedded_engine,
)
from oracle import oracle_text  # noqa: E402

from kvboost_hf.core.config import RepairConfig  # noqa: E402
from kvboost_hf.engine import InferenceEngine  # noqa: E402
from kvboost_hf.server.app import ServerConfig, create_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SYSTEM = "Answer from the documents in one short sentence."
FACTS = [
    "The north archive keeps the maps of the old harbour, and its access code is 4821. Visitors sign in at the "
    "front desk and may not take photographs of the charts.\n",
    "The south archive holds tax records from the last two centuries, and its access code is 7310. It opens only "
    "on weekdays and closes early before public holidays.\n",
    "The east archive stores letters written by the city's founders, and its access code is 5594. Its reading "
    "room has twelve desks and a window facing the river.\n",
]
QUESTION = "Question: what is the access code of the south archive?"


@pytest.fixture(scope="module")
def exact_engine():
    """Repair recomputes every reused token (ratio 1.0): answers equal a full prefill's."""
    return short_embedded_engine(chunking=16, repair=RepairConfig("cacheblend", ratio=1.0))


def live(engine) -> LiveServer:
    return LiveServer(
        create_app(engine, ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, reuse_mode="chunk_kv_reuse"))
    )


@pytest.fixture(scope="module")
def exact_server(exact_engine) -> Iterator[LiveServer]:
    with live(exact_engine) as server:
        yield server


@pytest.fixture(scope="module")
def server(exact_engine) -> Iterator[LiveServer]:
    """The same model with the default (approximate) repair and a store of its own."""
    with live(InferenceEngine(exact_engine.model, exact_engine.tokenizer, chunking=16)) as default_server:
        yield default_server


@pytest.fixture(scope="module")
def client(server):
    return server.client().with_options(timeout=120)


def documents(salt: str) -> list[str]:
    """The three documents, made unique to one test at their ends (their starts differ from each other's)."""
    return [f"{fact.rstrip()} (Ref. {salt}.)\n" for fact in FACTS]


def as_parts(docs: list[str]) -> list[dict[str, str]]:
    """System prompt, then one user message whose text parts are the documents and the question."""
    parts = [{"type": "text", "text": text} for text in [*docs, QUESTION]]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def ask(client, messages, salt: str, n: int = 1, **extra):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, n=n, extra_body={"cache_salt": salt, **extra}
    )


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def store_hits(server: LiveServer) -> float:
    text = http_get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    return float(re.search(r'^kvboost_store_hits_total\{tier="ram"\} (\S+)$', text, flags=re.M).group(1))


def document_tokens(tokenizer, docs: list[str]) -> int:
    """Tokens of the documents alone, as they appear inside a chat prompt (no special tokens)."""
    return sum(len(tokenizer(doc, add_special_tokens=False)["input_ids"]) for doc in docs)


def test_reordered_parts_hit_and_equal_a_cold_prefill_with_full_repair(exact_server):
    client = exact_server.client().with_options(timeout=120)
    salt = uuid.uuid4().hex
    a, b, c = documents(salt)
    cold = ask(client, as_parts([b, c, a]), f"cold-{salt}")
    assert cached(cold) == 0
    ask(client, as_parts([a, b, c]), salt)
    hits = store_hits(exact_server)
    reordered = ask(client, as_parts([b, c, a]), salt)
    # every document spans several 16-token chunks: each one is found by content key at its new position
    assert store_hits(exact_server) - hits >= 9
    assert reordered.choices[0].message.content == cold.choices[0].message.content
    assert reordered.usage.prompt_tokens == cold.usage.prompt_tokens


def test_reordered_parts_are_reused_with_the_default_repair(client, exact_engine):
    salt = uuid.uuid4().hex
    a, b, c = documents(salt)
    first = ask(client, as_parts([a, b, c]), salt)
    reordered = ask(client, as_parts([c, a, b]), salt, n=2)  # two choices share the one repaired prefill
    assert cached(reordered) > cached(first) + document_tokens(exact_engine.tokenizer, [a, b, c]) // 2
    answers = [choice.message.content for choice in reordered.choices]
    assert answers[0] and answers[0] == answers[1]  # approximate: not compared with a full prefill
    unmarked = f"none-{salt}"
    ask(client, as_parts([a, b, c]), unmarked, document_boundaries="none")
    assert cached(ask(client, as_parts([c, a, b]), unmarked, document_boundaries="none")) < cached(reordered) // 4


def test_separate_messages_are_documents_when_the_request_opts_in(client, exact_engine):
    salt = uuid.uuid4().hex
    docs = documents(salt)

    def conversation(order: list[int]) -> list[dict[str, str]]:
        turns = [{"role": "user", "content": docs[i]} for i in order]
        return [{"role": "system", "content": SYSTEM}, *turns, {"role": "user", "content": QUESTION}]

    ask(client, conversation([0, 1, 2]), salt, document_boundaries="messages")
    marked = ask(client, conversation([2, 0, 1]), salt, document_boundaries="messages")
    assert cached(marked) > document_tokens(exact_engine.tokenizer, docs) // 2
    plain = f"plain-{salt}"
    ask(client, conversation([0, 1, 2]), plain)
    assert cached(ask(client, conversation([2, 0, 1]), plain)) < cached(marked) // 4  # default: parts only


def test_warmed_documents_hit_in_any_order(client, exact_engine):
    salt = uuid.uuid4().hex
    docs = documents(salt)
    warmed = client.post("/warm", body={"documents": docs, "cache_salt": salt}, cast_to=object)  # as in docs/server.md
    total = document_tokens(exact_engine.tokenizer, docs)
    assert warmed["token_count"] == total and warmed["chunks_stored"] >= 9
    response = ask(client, as_parts(docs[::-1]), salt)
    assert cached(response) > total // 2  # the default repair recomputes some seam tokens of each document


def test_responses_api_input_text_parts_are_documents(client, exact_engine):
    salt = uuid.uuid4().hex
    docs = documents(salt)

    def respond(order: list[int]):
        parts = [{"type": "input_text", "text": text} for text in [*(docs[i] for i in order), QUESTION]]
        return client.responses.create(
            model=MODEL_NAME,
            instructions=SYSTEM,
            input=[{"role": "user", "content": parts}],
            max_output_tokens=8,
            temperature=0,
            extra_body={"cache_salt": salt},
        )

    respond([0, 1, 2])
    reordered = respond([1, 2, 0])
    assert reordered.usage.input_tokens_details.cached_tokens > document_tokens(exact_engine.tokenizer, docs) // 2


def test_a_rag_request_and_a_plain_request_share_one_batch(exact_engine):
    """A request whose warmed documents come as content parts in another order and a plain request of the same
    tenant, arriving together, are served in one batch (the RAG prompt is prefilled alone in a cache built with its
    segment starts, then decodes with the other): the RAG answer and its cached tokens equal those it gets alone
    (same store contents, under another tenant), and the plain answer is the model's greedy answer."""
    engine = InferenceEngine(exact_engine.model, exact_engine.tokenizer, chunking=16)  # default repair, own store
    settings = ServerConfig(
        model_name=MODEL_NAME, api_key=API_KEY, reuse_mode="chunk_kv_reuse", batch_window_ms=1500, max_batch_size=2
    )
    salt = uuid.uuid4().hex
    docs = documents(salt)
    rag = as_parts(docs[::-1])
    plain = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a large river."}]
    alone_tenant, shared_tenant = f"alone-{salt}", f"shared-{salt}"
    with LiveServer(create_app(engine, settings)) as live:
        client = live.client().with_options(timeout=120)
        for tenant in (alone_tenant, shared_tenant):
            client.post("/warm", body={"documents": docs, "cache_salt": tenant}, cast_to=object)
        alone = ask(client, rag, alone_tenant)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(ask, client, messages, shared_tenant) for messages in (rag, plain)]
            batched, answered = (future.result() for future in futures)
        batches = metric(live, "kvboost_batch_size_count"), metric(live, "kvboost_batch_size_sum")
    assert batches == (2, 3)  # the lone request's batch, then one batch of both
    assert cached(alone) > document_tokens(engine.tokenizer, docs) // 2
    assert (batched.choices[0].message.content, cached(batched)) == (alone.choices[0].message.content, cached(alone))
    assert answered.choices[0].message.content == oracle_text(engine, plain, 8)  # transformers' greedy answer


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": as_parts(["x"]), "document_boundaries": "all"},
         "document_boundaries"),
        ("/v1/warm", {"text": "a", "documents": ["b"]}, "exactly one of"),
        ("/v1/warm", {"documents": ["b", ""]}, "non-empty"),
        ("/v1/warm", {"documents": []}, "documents"),
    ],
)  # fmt: skip
def test_bad_boundary_requests_are_400s(server, path, body, needle):
    response = http_post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code == 400 and needle in response.text, response.text
