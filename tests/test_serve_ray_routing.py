"""Routing by chunk identity without Ray running: keys equal the store's, the prefix table, the ranking rules, the
routers' hooks on fake replicas, the ingress's pure helpers (prompt rendering, SSE cutting, reproducibility, a
resumed stream's ids) and the launcher's flag checks."""

from __future__ import annotations

import asyncio
import json
import random
import re
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("ray.serve")

from conftest import make_tiny_model
from helpers import run_python, word_tokenizer
from ray.exceptions import RayActorError

from kvboost_hf import KVBoost
from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.hf.tokens import SegmentTokenizer, TokenIdsCache
from kvboost_hf.serve_ray.app import Ingress, SseEvents, StreamDiverged, StreamIdentity, is_reproducible, prompt_ids
from kvboost_hf.serve_ray.launch import main as launch_main
from kvboost_hf.serve_ray.routers import ChunkAffinityRouter, RoundRobinRouter
from kvboost_hf.serve_ray.routing import (
    ForwardedRequest,
    InFlight,
    KeySpace,
    PrefixTable,
    choose_ranked,
    request_keys,
    routing_keys,
)
from kvboost_hf.server.batching import Done
from kvboost_hf.server.responses_api import ResponseBuilder
from kvboost_hf.server.responses_schemas import ResponsesRequest
from kvboost_hf.server.schemas import ChatCompletionRequest, plain_messages

SPACE = KeySpace("digest", "torch.float32", ChunkingConfig(4))
token_lists = st.lists(st.integers(0, 99), max_size=40)
replica_names = st.sampled_from(["a", "b", "c", "d"])


#: A chat template that concatenates each content as a string (a list content would make it raise TypeError).
WORD_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ' w3 ' + m['content'] + ' w4 ' }}{% endfor %}"
    "{% if add_generation_prompt %}w5 {% endif %}"
)
chat_words = st.lists(st.sampled_from(["w6", "w7", "w8", "w9"]), min_size=1, max_size=3).map(" ".join)
chat_contents = st.one_of(
    chat_words, st.lists(st.builds(lambda text: {"type": "text", "text": text}, chat_words), min_size=1, max_size=3)
)


@pytest.fixture(scope="module")
def engine():
    tokenizer = word_tokenizer()
    tokenizer.chat_template = WORD_CHAT_TEMPLATE
    return KVBoost(make_tiny_model("llama"), tokenizer, chunking=4)


INGRESS_IMPORTS = """
import sys
import kvboost_hf.serve_ray.app
heavy = ["kvboost_hf.engine", "transformers.modeling_utils", "kvboost_hf.server.app"]
print([name for name in heavy if name in sys.modules])
"""


def test_the_ingress_module_imports_no_model_code():
    """Ray Serve's ingress process imports ``kvboost_hf.serve_ray.app`` (where its deployment class lives): it
    checks and routes requests, so it must not load the engine or transformers' model code (measured here:
    633 -> 414 MB of RSS and 13.1 -> 7.2 s to import). The ``sys.modules`` of a child forked from the store tests'
    fork server, which loaded none of them, says what the import loaded."""
    child = run_python(INGRESS_IMPORTS)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "[]", child.stdout


def test_keys_are_the_stored_keys_per_tenant(engine):
    """After a generation, every routing key of its prompt is in the store, in its tenant's namespace only."""
    space = engine.factories.key_space
    prompt = list(range(2, 23))  # 5 full chunks and a tail
    for salt in (None, "tenant-a"):
        assert space.namespace(salt) == engine.new_cache(cache_salt=salt, adapter=False).namespace
        engine.generate(prompt, 2, cache_salt=salt)
        keys = routing_keys(space, prompt, salt)
        assert len(keys) == 5 and all(engine.store.contains_many(list(keys)))
    assert not any(engine.store.contains_many(list(routing_keys(space, prompt, "tenant-b"))))


@given(token_lists, st.integers(0, 40), st.text(max_size=5))
def test_keys_of_a_prefix_are_a_prefix_and_tenants_never_share_one(ids, cut, salt):
    keys = routing_keys(SPACE, ids, None)
    assert len(keys) == len(ids) // 4
    assert routing_keys(SPACE, ids[:cut], None) == keys[: min(cut, len(ids)) // 4]
    assert routing_keys(SPACE, ids, None, max_chunks=2) == keys[:2]
    assert not set(routing_keys(SPACE, ids, salt)) & set(keys)  # the salt enters the namespace ("" included)


def test_request_keys_come_from_a_forwarded_request_only():
    forwarded = ForwardedRequest(
        method="POST", path="/v1/completions", query_string=b"", headers=(), body=b"{}", routing_keys=("k1", "k2")
    )
    assert request_keys([forwarded]) == ("k1", "k2")
    assert request_keys([]) == () and request_keys(["other"]) == ()


def test_prefix_table_finds_the_deepest_key_held_by_a_candidate():
    table = PrefixTable()
    table.record(["k1", "k2", "k3"], "a")
    table.record(["k1"], "b")
    assert table.longest_match(["k1", "k2", "k3", "k4"], {"a", "b"}) == (3, ["a"])
    assert table.longest_match(["k1", "k2", "k3"], {"b"}) == (1, ["b"])  # a is not a candidate
    assert table.longest_match(["k1"], {"a", "b"}) == (1, ["b", "a"])  # most recent first
    assert table.longest_match(["x"], {"a", "b"}) == (0, [])
    table.forget(["a"])
    assert table.longest_match(["k1", "k2", "k3"], {"a", "b"}) == (1, ["b"]) and len(table) == 1


def test_prefix_table_drops_least_recently_used_keys_beyond_capacity():
    table = PrefixTable(capacity=3)
    table.record(["k1", "k2", "k3"], "a")
    assert table.longest_match(["k1"], {"a"}) == (1, ["a"])  # k1 is now the most recently used
    table.record(["k4"], "b")
    assert len(table) == 3 and table.longest_match(["k1", "k2"], {"a"}) == (1, ["a"])  # k2 went
    with pytest.raises(ValueError, match="capacity"):
        PrefixTable(0)


def test_in_flight_counts_started_requests_per_replica():
    flight = InFlight()
    flight.start("r1", "a")
    flight.start("r2", "a")
    flight.start("r3", "b")
    flight.finish("r1")
    flight.finish("never-started")
    assert flight.loads() == {"a": 1, "b": 1}


def test_ranking_prefers_the_holder_until_loads_differ_too_much():
    table = PrefixTable()
    table.record(["k1", "k2"], "b")
    keys = ["k1", "k2", "k3"]
    assert choose_ranked(keys, ["a", "b"], {"b": 1}, table) == [["b"], ["a"]]
    assert choose_ranked(keys, ["a", "b"], {"b": 2}, table) == [["a"], ["b"]]  # imbalanced: least loaded
    assert choose_ranked(keys, ["a", "b"], {"b": 2}, table, imbalance_threshold=2) == [["b"], ["a"]]
    assert choose_ranked(["x"], ["a", "b", "c"], {"a": 1}, table) == [["b", "c"], ["a"]]  # no match
    assert choose_ranked(keys, [], {}, table) == []
    two = choose_ranked(["x"], ["a", "b", "c"], {"a": 3}, table, fallback="power_of_two", rng=random.Random(0))
    assert len(two) == 1 and len(two[0]) == 2 and set(two[0]) <= {"a", "b", "c"}
    with pytest.raises(ValueError, match="fallback"):
        choose_ranked(keys, ["a"], {}, table, fallback="random")


@given(
    st.lists(replica_names, min_size=1, max_size=4, unique=True),
    st.dictionaries(replica_names, st.integers(0, 5)),
    st.lists(st.tuples(st.lists(st.sampled_from(["k1", "k2", "k3"]), max_size=3), replica_names), max_size=6),
    st.lists(st.sampled_from(["k1", "k2", "k3"]), max_size=3),
    st.sampled_from(["least_loaded", "power_of_two"]),
)
def test_ranks_are_disjoint_candidates_and_a_balanced_match_goes_first(candidates, loads, seen, keys, fallback):
    table = PrefixTable()
    for recorded, replica in seen:
        table.record(recorded, replica)
    ranks = choose_ranked(keys, candidates, loads, table, fallback=fallback, rng=random.Random(0))
    flat = [r for rank in ranks for r in rank]
    assert ranks[0] and len(flat) == len(set(flat)) and set(flat) <= set(candidates)
    depth, holders = table.longest_match(keys, candidates)
    spread = max(loads.get(c, 0) for c in candidates) - min(loads.get(c, 0) for c in candidates)
    if depth and spread <= 1:
        assert set(ranks[0]) == set(holders)
    elif fallback == "least_loaded":
        assert {loads.get(r, 0) for r in ranks[0]} == {min(loads.get(c, 0) for c in candidates)}


@given(st.lists(st.text(alphabet="ab:{} ", max_size=12), max_size=6), st.data())  # JSON: no raw newline
def test_sse_events_come_out_whole_however_the_bytes_are_cut(texts, data):
    events = [f"data: {text}\n\n".encode() for text in texts]
    stream = b"".join(events)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=5)))
    cutter = SseEvents()
    out = [
        e for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True) for e in cutter.feed(stream[start:end])
    ]
    assert out == events and cutter.pending == b""


def test_prompt_ids_render_as_the_engine_or_give_up(engine):
    """Completions tokenise as the engine (chats: tests/test_serve_ray.py, with a chat template); tools and bad
    bodies give no ids."""
    chat = {"model": "m", "messages": [{"role": "developer", "content": "w5 w6"}, {"role": "user", "content": "w7"}]}
    path = "/v1/chat/completions"
    ingress = SegmentTokenizer(engine.tokenizer, TokenIdsCache(1 << 20))  # the ingress's own token ids cache
    assert prompt_ids(ingress, "/v1/completions", b'{"model": "m", "prompt": "w3 w4"}') == engine.encode("w3 w4")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert prompt_ids(ingress, path, json.dumps({**chat, "tools": [tool]}).encode()) is None
    assert prompt_ids(ingress, path, b"not json") is None
    assert prompt_ids(ingress, path, b'{"messages": 3}') is None
    assert prompt_ids(ingress, "/v1/models", b"") is None


@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "developer", "user", "assistant"]), chat_contents), min_size=1, max_size=3
    )
)
def test_chat_prompt_ids_at_the_ingress_are_the_replicas(engine, messages):
    """A plain chat, its contents strings or lists of text parts, tokenises at the ingress exactly as a replica
    tokenises it (routing on other ids would never hit)."""
    body = json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()
    chat = ChatCompletionRequest.model_validate(json.loads(body))
    replica_ids, _ = engine.encode_segments(plain_messages(chat.messages))
    ingress = SegmentTokenizer(engine.tokenizer, TokenIdsCache(1 << 20))
    assert prompt_ids(ingress, "/v1/chat/completions", body) == replica_ids


def test_prompt_ids_give_up_on_any_rendering_failure(engine):
    """A template that fails on the messages (any exception, not only ValueError) gives no ids: routed by load."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"  # TypeError when rendered
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w6"}]}).encode()
    assert prompt_ids(SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20)), "/v1/chat/completions", body) is None


def test_prompt_ids_give_up_on_messages_the_chat_template_refuses():
    """The replica answers those with a 400 (tests/test_server_hardening.py); the ingress routes them by load."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    ingress = SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20))
    chat = {"model": "m", "messages": [{"role": "user", "content": "w5 w6"}]}
    path = "/v1/chat/completions"
    assert prompt_ids(ingress, path, json.dumps(chat).encode()) == tokenizer("w5 w6 ")["input_ids"]
    refused = {"model": "m", "messages": [{"role": "system", "content": "w5"}, *chat["messages"]]}
    assert prompt_ids(ingress, path, json.dumps(refused).encode()) is None


def test_prompt_ids_give_up_on_a_lone_surrogate(engine):
    """``json.loads`` takes ``"\\ud800"``; the replica refuses the body with a 400 (server/app.py decode_body)."""
    ingress = SegmentTokenizer(engine.tokenizer, TokenIdsCache(1 << 20))
    assert prompt_ids(ingress, "/v1/completions", b'{"model": "m", "prompt": "w3 \\ud800 w4"}') is None
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "w5 \\udc00"}]}'
    assert prompt_ids(SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20)), "/v1/chat/completions", chat) is None


def test_only_greedy_or_seeded_streams_are_replayed():
    assert is_reproducible(b'{"temperature": 0}') and is_reproducible(b'{"temperature": 0.7, "seed": 3}')
    assert not is_reproducible(b'{"temperature": 0.7}') and not is_reproducible(b"{}")
    assert not is_reproducible(b"[1]") and not is_reproducible(b"oops")


def fake_replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def fake_request(request_id: str, keys: tuple[str, ...] = ()) -> SimpleNamespace:
    forwarded = ForwardedRequest(
        method="POST", path="/v1/chat/completions", query_string=b"", headers=(), body=b"{}", routing_keys=keys
    )
    return SimpleNamespace(args=[forwarded], metadata=SimpleNamespace(internal_request_id=request_id))


def bare_router(cls: type, **state: object):
    """A router without Ray Serve's handle state (only the hooks under test touch it)."""
    router = cls.__new__(cls)
    router.initialize_state(**state)
    return router


def test_affinity_router_learns_from_routed_requests_and_counts_load():
    router = bare_router(ChunkAffinityRouter, imbalance_threshold=1)
    a, b = fake_replica("a"), fake_replica("b")
    first = fake_request("r1", ("k1", "k2"))
    assert asyncio.run(router.choose_replicas([a, b], first)) == [[a, b]]  # nothing known, equal loads
    router.on_request_routed(first, b.replica_id, None)
    follow_up = fake_request("r2", ("k1", "k2", "k3"))
    assert asyncio.run(router.choose_replicas([a, b], follow_up)) == [[b], [a]]
    router.on_request_routed(follow_up, b.replica_id, None)  # b: 2 in flight, a: 0: imbalanced
    assert asyncio.run(router.choose_replicas([a, b], fake_request("r3", ("k1",)))) == [[a], [b]]
    router.on_request_completed(b.replica_id, "r1")
    assert router.in_flight.loads() == {"b": 1}


def test_round_robin_gives_each_request_one_turn_however_often_it_is_routed():
    router = bare_router(RoundRobinRouter)
    replicas = [fake_replica("b"), fake_replica("a")]
    first, second = fake_request("r1"), fake_request("r2")
    picks = [asyncio.run(router.choose_replicas(replicas, r))[0][0].replica_id.unique_id for r in (first, first)]
    assert picks == ["a", "a"]  # routed again (a full replica): same turn
    assert asyncio.run(router.choose_replicas(replicas, second))[0][0].replica_id.unique_id == "b"
    router.on_request_routed(first, replicas[1].replica_id, None)
    router.on_request_completed(replicas[0].replica_id, "r2")
    assert router.turns == {}


def test_a_resumed_stream_keeps_its_first_id_and_created():
    identity = StreamIdentity()

    def event(chunk_id: str, created: int, text: str) -> bytes:
        chunk = {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "choices": [{"delta": text}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    first = event("chatcmpl-a", 1, "Hel")
    assert identity.relay(first) == first
    identity.resume()
    identity.replayed(0, event("chatcmpl-b", 2, "Hel"))
    assert identity.relay(event("chatcmpl-b", 2, "lo")) == event("chatcmpl-a", 1, "lo")
    assert identity.relay(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def responses_attempt(created_at: int) -> list[bytes]:
    """The events of one replica's greedy Responses API stream (its own response and item ids, ``created_at``)."""
    builder = ResponseBuilder(ResponsesRequest.model_validate({"model": "m", "input": "hi"}), "m", tools_offered=False)
    builder.created_at = created_at
    events = builder.start() + builder.add("Once") + builder.add(" upon") + builder.add(" a time")
    events += builder.finish("length") + builder.done(Done(prompt_tokens=3, cached_tokens=0, completion_tokens=3))
    return [event.encode() for event in events]


class LostReplica:
    """A replica's answer parts that end with the replica dying after ``lost_after`` events (None: never)."""

    def __init__(self, events: list[bytes], lost_after: int | None) -> None:
        self.parts = events if lost_after is None else events[:lost_after]
        self.lost = lost_after is not None

    async def __aiter__(self):
        for part in self.parts:
            yield part
        if self.lost:
            raise RayActorError()

    def cancel(self) -> None:
        pass


@given(st.lists(st.integers(0, 13), min_size=1, max_size=2).map(sorted))
def test_a_resumed_responses_stream_is_the_first_replicas_stream(kills):
    """A greedy Responses API stream whose replicas die after ``kills`` events (cumulative) reaches the client as
    one response: the events of the first replica that sent any, one response id, ``created_at`` and item id
    throughout (an item first sent after a resume may carry the new replica's id: the client never saw another)."""
    attempts = [responses_attempt(created_at=1000 + i) for i in range(len(kills) + 1)]
    assert len({event for attempt in attempts for event in attempt}) > len(attempts[0])  # the ids differ
    lost_after = [*kills, None]
    replicas = [LostReplica(attempt, lost) for attempt, lost in zip(attempts, lost_after, strict=True)]
    first_heard = next(i for i, lost in enumerate(lost_after) if lost != 0)
    later = iter(replicas[1:])

    async def open_next(forwarded: ForwardedRequest) -> tuple[None, LostReplica]:
        return None, next(later)

    ingress = SimpleNamespace(max_attempts=len(replicas), open=open_next)
    forwarded = fake_request("r1").args[0]

    async def relayed() -> list[bytes]:
        return [event async for event in Ingress.stream(ingress, forwarded, replicas[0], reproducible=True)]

    stream = asyncio.run(relayed())
    assert stream[0] == attempts[first_heard][0] and canonical(stream) == canonical(attempts[first_heard])


def canonical(events: list[bytes]) -> list[bytes]:
    """``events`` with each response id, item id and ``created_at`` named by its order of first appearance."""
    names: dict[bytes, bytes] = {}
    pattern = rb'(resp|msg)_[0-9a-f]{32}|"created_at": \d+'
    return [re.sub(pattern, lambda m: names.setdefault(m.group(), b"<%d>" % len(names)), e) for e in events]


def test_a_replay_naming_other_things_cuts_the_stream():
    """A replay whose values cannot stand one to one for the relayed ones (two responses for one) is cut."""
    identity = StreamIdentity()
    for event in responses_attempt(created_at=1)[:2]:  # response.created, response.in_progress
        identity.relay(event)
    identity.resume()
    identity.replayed(0, responses_attempt(created_at=2)[0])
    with pytest.raises(StreamDiverged):
        identity.replayed(1, responses_attempt(created_at=2)[1])  # another response's in_progress


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "--replicas must be a number >= 1"),
        (["--max-ongoing-requests", "0"], "--max-ongoing-requests must be a number >= 1"),
        (["--replica-cpus", "-1"], "--replica-cpus must be a number >= 0"),
        (["--replica-gpus", "nan"], "--replica-gpus must be a number >= 0"),
        (["--imbalance-threshold", "-5"], "--imbalance-threshold must be a number >= 0"),
        (["--num-cpus", "0"], "--num-cpus must be a number >= 1"),
        (["--shutdown-wait-s", "-1"], "--shutdown-wait-s must be a number >= 0"),
        (["--chunk-size", "0"], "chunk_size must be a positive number"),  # the single server's own check
        (["--port", "99999"], "--port must be in"),
    ],
)
def test_a_bad_launcher_flag_is_a_usage_error_before_ray_starts(flags, message, capsys, monkeypatch):
    """Each bad flag exits 2 naming it from the flags alone: Ray is never started (it was, and the replicas were
    built three times before Ray Serve gave up, or a Ray or pydantic traceback came, or the value was accepted)."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("Ray started"))
    with pytest.raises(SystemExit) as exited:
        launch_main(flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err
