"""Server hardening (issue #22 server items 6-9, issue #18 item 7): client errors are 400s, request bodies,
headers and grammar compiles are bounded, /metrics reads one snapshot off the event loop (#22 item 11, the quiet
import, is checked in tests/test_architecture.py). Servers run on 127.0.0.1 with the embedded model's first layers
(see tests/test_server.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from helpers import (  # noqa: E402
    API_KEY,
    MODEL_NAME,
    WEATHER_TOOL,
    LiveServer,
    chat,
    http_client,
    http_get,
    http_post,
    http_stream,
    http_transport,
    short_embedded_engine,
)

from kvboost_hf.server.app import ServerConfig, create_app, decode_body  # noqa: E402
from kvboost_hf.server.grammar import GrammarBusy, GrammarCompiler, GrammarConfig, GrammarError  # noqa: E402
from kvboost_hf.server.grammar_process import CompileProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


SETTINGS = ServerConfig(
    model_name=MODEL_NAME,
    api_key=API_KEY,
    max_json_values=1000,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    grammar_limits=GrammarConfig(max_schema_bytes=2048, workers=1),  # one compile process is enough
)


@pytest.fixture(scope="module")
def engine():
    return short_embedded_engine(chunking=16)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, SETTINGS), settings=SETTINGS) as live:
        yield live


def post(server: LiveServer, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http_post(f"{server.url}{path}", content=content, headers=HEADERS, timeout=60)


# ---------------------------------------------------------------------------------------------- item 8
def test_an_unexpected_error_answers_500_and_says_its_connection_closes(server, caplog):
    """Starlette re-raises after the 500 and uvicorn drops the connection: the answer says so, so a client's next
    request goes on a new connection (it was sent on the dropped one and reset)."""

    def fails() -> None:
        raise RuntimeError("a bug")

    server.app.add_api_route("/test-unexpected-error", fails)
    with http_client(base_url=server.url, headers=HEADERS, timeout=30) as client:
        answer = client.get("/test-unexpected-error")
        assert answer.status_code == 500 and answer.headers["connection"] == "close"
        assert answer.json()["error"]["message"] == "internal error: RuntimeError"
        assert client.get("/health").status_code == 200


def test_client_errors_are_400_not_500(server):
    superscript = {"model": MODEL_NAME, "messages": chat("hi"), "logit_bias": {"²": 1}, "max_tokens": 1}
    response = post(server, superscript)
    assert response.status_code == 400 and "logit_bias" in response.json()["error"]["message"], response.text
    surrogate = b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 1}' % (
        MODEL_NAME.encode()
    )
    for path in ("/v1/chat/completions", "/tokenize"):
        response = post(server, surrogate, path)
        assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"], response.text
    paired = b'{"model": "%s", "prompt": "a\\ud83d\\ude00", "max_tokens": 1}' % MODEL_NAME.encode()  # an emoji: fine
    assert post(server, paired, "/v1/completions").status_code == 200


def test_messages_the_chat_template_refuses_are_a_400_naming_them():
    """A template's ``raise_exception`` (a system role Gemma's template refuses) answers 400 on ``messages`` with
    its reason, with tools (rendered by the admission) or without, on the chat route and on /tokenize."""
    from conftest import make_tiny_model
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from kvboost_hf.engine import InferenceEngine
    from kvboost_hf.hf.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + tokenizer.chat_template
    )
    model = make_tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256)
    engine = InferenceEngine(model, tokenizer, chunking=16)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    bodies = {
        "/v1/chat/completions": {"model": "tiny", "messages": messages, "max_tokens": 1},
        "/tokenize": {"model": "tiny", "messages": messages},
    }
    bodies["tools"] = {**bodies["/v1/chat/completions"], "tools": [WEATHER_TOOL]}
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as client:
        for name, body in bodies.items():
            response = client.post(name if name.startswith("/") else "/v1/chat/completions", json=body)
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "messages", (name, response.text)
            assert "chat template refused the messages: System role not supported" in error["message"], name


# ---------------------------------------------------------------------------------------------- item 7
def test_decode_body_counts_values_and_refuses_lone_surrogates():
    assert decode_body(b'{"a": [1, 2, {"b": "c"}]}', 6) == {"a": [1, 2, {"b": "c"}]}
    with pytest.raises(Exception, match="more than 5 JSON values"):
        decode_body(b'{"a": [1, 2, {"b": "c"}]}', 5)
    with pytest.raises(Exception, match="surrogate"):
        decode_body(b'["\\udc00"]', 10)


def test_body_with_too_many_content_parts_is_refused(server):
    parts = [{"type": "text", "text": "x"}] * 600  # 1801 JSON values in these parts, over the limit of 1000
    response = post(server, {"model": MODEL_NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert response.status_code == 400 and "JSON values" in response.json()["error"]["message"], response.text
    parts = parts[:100]
    response = post(server, {"model": MODEL_NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------------------------------- item 9
def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_slow_headers_and_bodies_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # headers never finished
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # nothing sent at all
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # a body that stops coming
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode() + b'{"model"')
        reply = _read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in reply
    with http_client(base_url=server.url, timeout=10) as client:  # keep-alive: a second request is served
        assert client.get("/health").status_code == 200
        time.sleep(0.2)
        assert client.get("/health").status_code == 200


def test_streamed_response_is_not_cut_by_the_body_timeout(server):
    body = {"model": MODEL_NAME, "prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0, "stream": True}
    with http_stream("POST", f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"


# ---------------------------------------------------------------------------------------------- item 6
def test_schema_over_the_size_limit_is_400(server):
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(400)]}  # ~5 KiB, over the 2 KiB limit
    response_format = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    response = post(server, {"model": MODEL_NAME, "messages": chat("hi"), "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_schema" and "limit of 2048" in error["message"]


class _CountingCompiles:
    """Wraps ``CompileProcess.compile`` (the parent's side of a compile): counts compiles, optionally holding each
    until ``release`` is set."""

    def __init__(self, monkeypatch, release: threading.Event | None = None) -> None:
        self.release, self.calls = release, []
        original = CompileProcess.compile

        def compile(process, kind, args, time_limit_s):
            self.calls.append(args)
            if self.release is not None:
                assert self.release.wait(60)
            return original(process, kind, args, time_limit_s)

        monkeypatch.setattr(CompileProcess, "compile", compile)


def test_grammar_cache_is_per_tenant(engine, monkeypatch):
    counting = _CountingCompiles(monkeypatch)
    compiler = GrammarCompiler(engine.tokenizer, len(engine.tokenizer), GrammarConfig(workers=1))  # one process
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        compiler.json_schema(schema, tenant="a").result(60)
        assert compiler.json_schema(schema, tenant="a").done()  # a cache hit of the same tenant
        compiler.json_schema(schema, tenant="b").result(60)  # another tenant compiles its own
        compiler.json_schema(schema).result(60)
        assert len(counting.calls) == 3
        with pytest.raises(GrammarError, match="cannot compile"):
            compiler.json_schema({"$ref": "#/nope"}, tenant="a").result(60)
    finally:
        compiler.close()


def test_grammar_compiles_are_bounded(engine, monkeypatch):
    release = threading.Event()
    _CountingCompiles(monkeypatch, release)
    limits = GrammarConfig(workers=1, max_waiting=2)
    compiler = GrammarCompiler(engine.tokenizer, len(engine.tokenizer), limits)
    try:
        first = compiler.json_schema({"type": "integer"}, tenant="a")
        again = compiler.json_schema({"type": "integer"}, tenant="a")  # the same compile, not a new one
        second = compiler.json_schema({"type": "string"}, tenant="a")
        with pytest.raises(GrammarBusy):
            compiler.json_schema({"type": "boolean"}, tenant="b")
    finally:
        release.set()
    try:
        assert again is first and first.result(60) is not None and second.result(60) is not None
        assert compiler.json_schema({"type": "boolean"}, tenant="b").result(60) is not None  # room again
    finally:
        compiler.close()


# ---------------------------------------------------------------------------------------------- #30 item 3
SLOW_PATTERN = {"type": "string", "pattern": "[a-z]{1,30000}"}  # 46 bytes; xgrammar compiles it for minutes


def test_a_compile_past_its_time_limit_is_killed_and_refused(engine):
    limits = GrammarConfig(compile_limit_s=1.0, workers=1)
    compiler = GrammarCompiler(engine.tokenizer, len(engine.tokenizer), limits)
    try:
        assert compiler.json_schema({"type": "integer"}).result(60) is not None  # the child is up
        start = time.perf_counter()
        with pytest.raises(GrammarError, match="did not compile within this server's limit of 1 s"):
            compiler.json_schema(SLOW_PATTERN).result(60)
        assert time.perf_counter() - start < 5
        assert compiler.json_schema({"type": "boolean"}).result(60) is not None  # a new child took over
    finally:
        compiler.close()


def test_one_tenant_never_holds_every_compile_worker(engine):
    """Tenant A sends two slow schemas at once (two workers); tenant B's structured chat is answered meanwhile,
    and A's get a 400 once their compile passes the limit."""
    limits = GrammarConfig(compile_limit_s=6.0, compile_timeout_s=30.0, workers=2)
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, grammar_limits=limits)
    with LiveServer(create_app(engine, settings), settings=settings) as live:
        client = live.client()
        transport = http_transport(local_address="127.0.0.2")  # another client address: another tenant
        other = openai.OpenAI(
            base_url=f"{live.url}/v1",
            api_key=API_KEY,
            max_retries=0,
            timeout=60,
            http_client=http_client(transport=transport),
        )
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

        def structured(schema: dict, salt: str) -> dict:
            format_ = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            return {
                "model": MODEL_NAME,
                "messages": chat("Is water wet?"),
                "max_tokens": 8,
                "temperature": 0,
                "response_format": format_,
                "extra_body": {"cache_salt": salt},
            }

        client.chat.completions.create(**structured(schema, "warm"))  # both compile processes started
        slow = [{**SLOW_PATTERN, "pattern": f"[a-z]{{1,{30000 + i}}}"} for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            attacks = [pool.submit(client.chat.completions.create, **structured(s, "tenant-a")) for s in slow]
            time.sleep(0.5)  # A's compiles are running
            start = time.perf_counter()
            answer = other.chat.completions.create(**structured(schema, "tenant-b"))
            waited = time.perf_counter() - start
            refusals = []
            for attack in attacks:
                with pytest.raises(openai.BadRequestError) as refused:
                    attack.result(60)
                refusals.append(refused.value.body)
        assert waited < 4 and answer.choices[0].message.content.startswith('{"ok": '), waited
        assert all(r["code"] == "invalid_schema" and "did not compile within" in r["message"] for r in refusals)


# ---------------------------------------------------------------------------------------------- #18 item 7
def test_metrics_read_one_snapshot_off_the_event_loop(server, engine, monkeypatch):
    calls: list[tuple[dict, bool]] = []
    original = engine.cache_stats

    def recorded(**kwargs):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append((kwargs, on_loop))
        return original(**kwargs)

    monkeypatch.setattr(engine, "cache_stats", recorded)
    response = http_get(f"{server.url}/metrics", headers=HEADERS, timeout=10)
    assert response.status_code == 200 and 'kvboost_store_hits_total{tier="ram"}' in response.text
    assert "kvboost_store_misses_total" in response.text and "kvboost_target_forwards_total" in response.text
    assert calls == [({"settle": False}, False)]  # once, in a thread, host-side counters only


def _request_counts(server: LiveServer) -> dict[str, float]:
    """``kvboost_requests_total`` samples of a live server: labels text -> count."""
    text = http_get(f"{server.url}/metrics", headers=HEADERS, timeout=10).text
    prefix = "kvboost_requests_total{"
    return {
        line[len(prefix) : line.rindex("}")]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def test_metrics_count_gate_refusals_under_route_templates(server):
    """The API-key gate's 401 and the body limit's 413 are answered before the routes: they are counted all the
    same. A path with a parameter counts under its route's template, and an unknown path under ``other``: labels
    stay bounded."""
    before = _request_counts(server)
    unauthorised = http_get(f"{server.url}/v1/models", timeout=10)
    too_large = http_post(
        f"{server.url}/v1/chat/completions", content=b"x" * (SETTINGS.max_body_bytes + 1), headers=HEADERS, timeout=10
    )
    model = http_get(f"{server.url}/v1/models/{MODEL_NAME}", headers=HEADERS, timeout=10)
    missing = http_get(f"{server.url}/no/such/path/{time.time()}", headers=HEADERS, timeout=10)
    assert [r.status_code for r in (unauthorised, too_large, model, missing)] == [401, 413, 200, 404]
    after = _request_counts(server)
    for labels in (
        'code="401",endpoint="/v1/models"',
        'code="413",endpoint="/v1/chat/completions"',
        'code="200",endpoint="/v1/models/{model_id}"',
        'code="404",endpoint="other"',
    ):
        assert after.get(labels, 0) == before.get(labels, 0) + 1, labels
    assert not any(MODEL_NAME in labels for labels in after)


# ---------------------------------------------------------------------------------------------- #30 item 2
def _raw_request(port: int, body: dict, http_version: str, extra_headers: str = "") -> tuple[float, bytes]:
    """(seconds, every byte of the reply) of one chat request on a fresh socket, read until the server closes it."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/{http_version}\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{extra_headers}\r\n"
    )
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        reply = _read_until_closed(sock)
    return time.perf_counter() - start, reply


def test_connection_close_responses_outlive_the_request_timeouts(server):
    """``Connection: close`` (urllib, nginx) and HTTP/1.0 requests whose answers take over twice the 0.5 s header
    and body timeouts: complete answers, no 408 anywhere."""
    body = {"model": MODEL_NAME, "messages": chat("Tell a long story."), "max_tokens": 60, "ignore_eos": True}
    seconds, reply = _raw_request(server.port, {**body, "stream": True}, "1.1", "Connection: close\r\n")
    assert seconds > 1.0 and b"HTTP/1.1 408" not in reply, (seconds, reply[-300:])  # not "408" in an id or text
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), reply[-300:]
    seconds, reply = _raw_request(server.port, body, "1.0")
    assert seconds > 1.0 and reply.startswith(b"HTTP/1.1 200"), (seconds, reply[-300:])
    answer = json.loads(reply.partition(b"\r\n\r\n")[2])
    assert answer["usage"]["completion_tokens"] == 60 and answer["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------- #30 item 5
def _drip(sock: socket.socket, interval_s: float, stop: threading.Event) -> None:
    """Send one body byte every ``interval_s`` until ``stop`` or the server closes the connection."""
    while not stop.wait(interval_s):
        try:
            sock.sendall(b" ")
        except OSError:
            return


def _dripped_request(port: int, head: str, interval_s: float) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, its reply) for ``head`` (headers announcing a 1,000-byte
    body) followed by a body dripped one byte per ``interval_s`` (under the 0.5 s body timeout)."""
    stop = threading.Event()
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=8) as sock:
        sock.sendall(head.encode() + b'{"model": ')
        dripper = threading.Thread(target=_drip, args=(sock, interval_s, stop), daemon=True)
        dripper.start()
        try:
            reply = _read_until_closed(sock)
        finally:
            stop.set()
            dripper.join(5)
    return time.perf_counter() - start, reply


def test_dripped_bodies_are_bounded_in_total_time(server):
    """A body dripped a byte every 0.2 s (each pause under the 0.5 s body timeout) is cut off once the whole body
    is late: with a 408 while the app reads it, and closed when the app answered early (401) and never reads it."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    seconds, reply = _dripped_request(server.port, head, 0.2)
    assert seconds < 3 and reply.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in reply, reply
    unauthorized = head.replace(API_KEY, "wrong-key")
    seconds, reply = _dripped_request(server.port, unauthorized, 0.2)
    assert seconds < 3 and reply.startswith(b"HTTP/1.1 401"), (seconds, reply)


def test_connections_per_client_address_are_capped(engine):
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, header_timeout_s=20, max_connections_per_client=3)
    with LiveServer(create_app(engine, settings), settings=settings) as live:
        held = [socket.create_connection(("127.0.0.1", live.port), timeout=10) for _ in range(3)]
        try:
            with socket.create_connection(("127.0.0.1", live.port), timeout=10) as extra:
                reply = _read_until_closed(extra)
            assert reply.startswith(b"HTTP/1.1 429"), reply
            error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "too_many_connections" and "3 open connections" in error["message"]
            held.pop().close()
            deadline = time.monotonic() + 10
            while (status := http_get(f"{live.url}/health", timeout=10).status_code) != 200:
                assert time.monotonic() < deadline, status  # the closed one's slot is given back
                time.sleep(0.05)
        finally:
            for sock in held:
                sock.close()


# ---------------------------------------------------------------------------------------------- #30 item 4
def test_required_parallel_calls_end_when_the_budget_cannot_hold_another(server):
    """``tool_choice="required"`` with parallel calls and ``max_tokens`` under twice a call's length: the complete
    call ends the turn (``tool_calls``) instead of the model's cut repeat (``length``)."""
    client = server.client()
    request = {"model": MODEL_NAME, "messages": chat("What is the weather in Paris?"), "temperature": 0}
    request |= {"tools": [WEATHER_TOOL], "tool_choice": "required"}
    single = client.chat.completions.create(**request, max_tokens=64, parallel_tool_calls=False)
    call_tokens = single.usage.completion_tokens
    assert single.choices[0].finish_reason == "tool_calls", single  # the call is whole: its length sets the budget
    for stream in (False, True):
        budget = call_tokens * 3 // 2
        if not stream:
            answer = client.chat.completions.create(**request, max_tokens=budget)
            finish, calls = answer.choices[0].finish_reason, answer.choices[0].message.tool_calls
            arguments = [call.function.arguments for call in calls]
        else:
            chunks = list(client.chat.completions.create(**request, max_tokens=budget, stream=True))
            finish = next(c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason)
            deltas = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
            indices = sorted({d.index for d in deltas})
            arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in indices]
        assert finish == "tool_calls", (stream, finish, arguments)
        assert arguments == [single.choices[0].message.tool_calls[0].function.arguments]


# ---------------------------------------------------------------------------------------------- #30 item 6
def _documents(count: int) -> list[str]:
    """``count`` distinct documents of about 100 tokens each."""
    tag = time.time_ns()
    return [f"Document {tag}-{i}. " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(45)) for i in range(count)]


def test_warm_documents_are_capped(server):
    response = post(server, {"documents": ["d"] * 257}, "/v1/warm")
    assert response.status_code == 400 and "limit of 256" in response.json()["error"]["message"], response.text


def test_warm_yields_to_decoding(server, engine):
    """A chat sent while 8 documents are warmed is answered between two of them, not after the last (a warm that
    did not yield would answer it after the 7 documents left: over half of the warm's time)."""
    warmed: list[tuple[float, int]] = []

    def warm() -> None:
        start = time.perf_counter()
        status = post(server, {"documents": _documents(8)}, "/v1/warm").status_code
        warmed.append((time.perf_counter() - start, status))

    stored = engine.store.stats()["puts"]
    thread = threading.Thread(target=warm)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.store.stats()["puts"] == stored:  # the warm has started: its first document is stored
        assert time.monotonic() < deadline and thread.is_alive(), warmed
        time.sleep(0.01)
    start = time.perf_counter()
    chat_status = post(server, {"model": MODEL_NAME, "messages": chat("Say hi."), "max_tokens": 1}).status_code
    chat_s = time.perf_counter() - start
    still_warming = thread.is_alive()
    thread.join(120)
    ((warm_s, warm_status),) = warmed
    assert chat_status == warm_status == 200 and still_warming and chat_s < warm_s / 2, (chat_s, warm_s)


def _settled(read: Callable[[], int], quiet_s: float, limit_s: float) -> int:
    """``read()`` once it has kept one value for ``quiet_s`` seconds (read every 50 ms); fails past ``limit_s``."""
    deadline = time.monotonic() + limit_s
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still changing after {limit_s} s: {value}"
        time.sleep(0.05)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return value


def test_warm_stops_when_the_client_disconnects(server, engine):
    """The client leaves after 1.5 s of a 200-document warm: the document being stored then is finished (however
    long that takes on a loaded machine), then nothing more is stored for 1.5 s, far short of the 200 documents."""
    puts = lambda: engine.store.stats()["puts"]  # noqa: E731
    before = puts()
    body = json.dumps({"documents": _documents(200)}).encode()
    with pytest.raises(httpx.ReadTimeout):
        http_post(f"{server.url}/v1/warm", content=body, headers=HEADERS, timeout=1.5)
    stopped = _settled(puts, quiet_s=1.5, limit_s=60)
    assert stopped - before < 200 * 5, (before, stopped)
