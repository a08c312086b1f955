"""Two engine replicas on Ray Serve (a tiny random model on CPU, a private Redis tier), driven over loopback by the
official ``openai`` client and httpx: transformers' own greedy ``generate()`` outputs (tests/oracle.py), a
conversation's next turn on the replica that computed its prefix, the ingress's keys equal to the stored ones, and
no lost or wrong request when a replica is killed mid-stream. One Ray instance per module (Ray is heavy on a 2-core
machine), shut down at the end."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")

from conftest import make_tiny_model  # noqa: E402
from helpers import RedisServer, free_port  # noqa: E402
from oracle import oracle_text  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kvboost_hf import KVBoost  # noqa: E402
from kvboost_hf.hf.models import embedded_model_dir  # noqa: E402
from kvboost_hf.hf.sampling import SamplingConfig  # noqa: E402
from kvboost_hf.serve_ray.app import REPLICA_HEADER, kill_replica, prompt_ids, replica_actor_names  # noqa: E402
from kvboost_hf.serve_ray.launch import APP_NAME, init_local_ray, parse_args, start  # noqa: E402
from kvboost_hf.serve_ray.routing import routing_keys  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHUNK = 8
MODEL = "tiny"
KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 1 << 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen2 with the embedded model's tokenizer (and chat template)."""
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    make_tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    """The tiny model's engine: its model, tokenizer, chat rendering and key space (the replicas load the same)."""
    return KVBoost.from_pretrained(model_dir, chunking=CHUNK, device="cpu")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/start-redis.sh installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def url(model_dir: Path, redis_url: str) -> Iterator[str]:
    """Two replicas with prefix routing on one Redis tier, behind Ray Serve's proxy on a free loopback port."""
    init_local_ray(2, log_to_driver=False)  # as `python -m kvboost_hf.serve_ray` starts it
    try:
        flags = ["--model", str(model_dir), "--served-model-name", MODEL, "--chunk-size", str(CHUNK)]
        flags += ["--remote-url", redis_url, "--remote-prefix", f"t{uuid.uuid4().hex[:8]}:", "--threads", "1"]
        flags += ["--replicas", "2", "--routing", "prefix", "--replica-cpus", "0.5", "--port", str(free_port())]
        flags += ["--batch-window-ms", "5", "--log-level", "warning", "--api-key", KEY]
        flags += ["--max-body-bytes", str(MAX_BODY), "--shutdown-wait-s", "0.2"]  # no request runs at the end
        yield start(parse_args(flags))
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def conversation(tag: str) -> list[dict[str, str]]:
    system = f"You are assistant {tag}. Keep answers short and precise, and never repeat the question."
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Say something about {tag}."}]


def greedy(engine, messages, max_tokens: int, ignore_eos: bool = False) -> str:
    """transformers' greedy ``generate()`` text for ``messages`` rendered as the engine renders them."""
    return oracle_text(engine, messages, max_tokens, SamplingConfig(temperature=0, ignore_eos=ignore_eos))


def chat_turn(client, messages, max_tokens: int = 8):
    """One greedy turn; returns (text, replica id, cached prompt tokens)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    completion = raw.parse()
    details = completion.usage.prompt_tokens_details
    return completion.choices[0].message.content, raw.headers[REPLICA_HEADER], (details.cached_tokens or 0)


def test_outputs_equal_transformers_greedy(client, engine):
    """Greedy answers through the replicas, plain and streamed, equal transformers' ``generate()``."""
    for tag in ("apples", "rivers"):
        messages = conversation(tag)
        expected = greedy(engine, messages, 12)
        assert chat_turn(client, messages, 12)[0] == expected
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_next_turn_goes_to_the_replica_holding_the_prefix(client, engine):
    """Each conversation's turns land on one replica, which loads the earlier turns' chunks."""
    for tag in ("mountains", "engines", "violins"):
        messages = conversation(tag)
        replicas = []
        for turn in range(3):
            text, replica, cached = chat_turn(client, messages)
            assert text == greedy(engine, messages, 8)
            replicas.append(replica)
            if turn:
                assert cached >= len(engine.encode(messages[:2])) // CHUNK * CHUNK  # at least the first turn's chunks
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And turn {turn}?"}]
        assert len(set(replicas)) == 1, replicas


def test_ingress_checks_the_key_and_body_size_before_reading_a_body(url):
    """The replicas' API key and body limit hold at the ingress (which reads and tokenises bodies to route them)."""
    chat_url = f"{url}/v1/chat/completions"
    refused = httpx.post(chat_url, json={"model": MODEL, "messages": conversation("keys")}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    huge = httpx.post(chat_url, content=b" " * (MAX_BODY + 1), headers=AUTH, timeout=30)
    assert huge.status_code == 413
    assert REPLICA_HEADER not in refused.headers and REPLICA_HEADER not in huge.headers  # no replica was asked
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # public, as on one server


def test_ingress_keys_are_the_keys_the_replicas_store(client, engine, url):
    """The keys the ingress routes by name the chunks the replica stored (same namespace, chunks and chaining)."""
    messages = conversation("lighthouses")
    chat_turn(client, messages)
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    ids = prompt_ids(engine.tokens, "/v1/chat/completions", body)
    assert ids == engine.encode(messages)
    keys = routing_keys(engine.factories.key_space, ids, None)
    assert len(keys) == len(ids) // CHUNK
    handle = serve.get_deployment_handle("KVBoostReplica", APP_NAME)
    space, _ = handle.routing_context.remote().result()
    assert space == engine.factories.key_space
    deadline = time.monotonic() + 10  # Redis writes are queued in the background
    while not all(handle.stored.remote(keys).result()):
        assert time.monotonic() < deadline, "the prompt's chunks never reached the store"
        time.sleep(0.2)
    salted = routing_keys(space, ids, "tenant-b")
    assert not any(handle.stored.remote(salted).result())


def test_killed_replica_loses_no_request(client, engine, url):
    """A replica killed while it streams one answer and computes another: both complete, equal to transformers'
    greedy ``generate()`` (the stream continues on the other replica from the first event the client had not
    received), and the next turn on the other replica loads the lost replica's chunks from Redis. The continued
    stream keeps its id and reports the whole answer's usage."""
    messages = conversation("glaciers")
    tokens = 120
    expected = greedy(engine, messages, tokens, ignore_eos=True)
    body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    results: dict[str, str] = {}

    def plain() -> None:
        results["plain"] = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
            .chat.completions.create(
                model=MODEL, messages=messages, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .message.content
        )

    chat_url = f"{url}/v1/chat/completions"
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", chat_url, json=streamed, headers=AUTH, timeout=60) as response:
        victim = response.headers[REPLICA_HEADER]
        lines = response.iter_lines()
        text, events, ids, usage = "", 0, set(), None
        worker = threading.Thread(target=plain)
        for line in lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            choices, ids, usage = chunk["choices"], ids | {chunk["id"]}, chunk.get("usage") or usage
            text += choices[0]["delta"].get("content") or "" if choices else ""
            events += 1
            if events == 3:
                worker.start()  # same prefix: routed to the victim too
                time.sleep(0.2)
                assert kill_replica(APP_NAME, victim) == victim
        else:
            pytest.fail("the stream ended without [DONE]")
    worker.join(60)
    assert text == expected
    assert len(ids) == 1 and usage["completion_tokens"] == tokens, (ids, usage)  # one id; the whole answer's usage
    assert results["plain"] == expected
    survivors = [name.rsplit("#", 1)[1] for name in replica_actor_names(APP_NAME)]
    assert victim not in survivors
    follow_up = [*messages, {"role": "assistant", "content": expected}, {"role": "user", "content": "Why?"}]
    answer, replica, cached = chat_turn(client, follow_up)
    assert answer == greedy(engine, follow_up, 8)
    assert replica != victim and cached >= len(engine.encode(messages)) // CHUNK * CHUNK


def test_local_ray_runs_no_dashboard(url):
    """The local Ray that ``python -m kvboost_hf.serve_ray`` starts has no dashboard (its job API runs arbitrary
    code); what else stays open is listed in docs/server.md."""
    from ray._private.worker import global_worker

    assert not global_worker.node.address_info.get("webui_url"), global_worker.node.address_info
