"""The Ray Serve application: an ``Ingress`` deployment in front of ``KVBoostReplica`` deployments.

* :class:`KVBoostReplica`: one engine with its RAM tier (every replica built from the same flags, so all share the
  Redis tier those flags name) and the single server's FastAPI app, called in-process: every route, streaming,
  tools, errors and ``/metrics`` (of that replica) behave as with ``python -m kvboost_hf.server``.
* :class:`Ingress`: the HTTP entry (Ray Serve's proxy calls it). It computes each request's chunk keys
  (:func:`~kvboost_hf.serve_ray.routing.routing_keys`), hands the request to the replicas' handle (whose request
  router reads the keys) and relays the answer, naming the replica in the ``x-kvboost-replica`` header. When a
  replica dies before its answer is complete, the request is sent again (Ray Serve routes around the dead replica):
  a non-streamed answer is relayed only once complete; a stream whose events already reached the client is
  continued from the same event on another replica when it is reproducible (greedy or seeded), keeping the ids the
  client has seen (:class:`StreamIdentity`), and cut otherwise.
"""

# no `from __future__ import annotations`: FastAPI reads the ingress route's annotations at run time
import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import ASGIApp, Message
from transformers import PreTrainedTokenizerBase

from kvboost_hf.core.errors import KVBoostError, NotFoundError
from kvboost_hf.hf.chat_segments import DocumentBoundaries, encode_chat_segments
from kvboost_hf.hf.tokens import SegmentTokenizer, TokenCacheConfig, TokenIdsCache
from kvboost_hf.serve_ray.routing import DEFAULT_MAX_CHUNKS, ForwardedRequest, KeySpace, routing_keys
from kvboost_hf.server.errors import ApiError
from kvboost_hf.server.gate import RequestGate
from kvboost_hf.server.schemas import ChatCompletionRequest, CompletionRequest, plain_messages
from kvboost_hf.server.settings import ServerConfig

logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvboost-replica"
SERVE_NAMESPACE = "serve"  # where Ray Serve names its actors
REPLICA_LOST = (RayActorError,)  # the replica process died or became unreachable (ActorDiedError, ...)
HOP_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass(frozen=True)
class ResponseStart:
    """The first part of a replica's answer: status, headers (as the app sent them) and the replica's id."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str

    @property
    def is_event_stream(self) -> bool:
        return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers)

    def relayed_headers(self) -> dict[str, str]:
        """The headers the ingress answers with: the app's, less per-hop ones, plus the replica's id."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.headers if k not in HOP_HEADERS}
        return {**headers, REPLICA_HEADER: self.replica}


async def call_asgi(app: ASGIApp, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``request`` through ``app`` in this process: a :class:`ResponseStart`, then the body's parts as the app
    sends them. Closing the iterator early tells the app the client disconnected (a running generation stops)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": list(request.headers),
        "client": None,
        "server": None,
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        await app(scope, receive, sent.put)

    task = asyncio.create_task(run())
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                yield ResponseStart(message["status"], headers, replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        disconnected.set()
        await asyncio.wait_for(asyncio.shield(task), timeout=30)


class KVBoostReplica:
    """One engine and the single server's app, built from the server's flags (``args``). Ray Serve runs one per
    replica; each is its own process with its own RAM tier."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvboost_hf.server.launch import build_app, configure_process, freeze_startup_heap

        configure_process(args)
        self.app, self.engine = build_app(args)
        freeze_startup_heap()
        self.app.state.worker.start()  # what the app's lifespan does under uvicorn
        self.replica = serve.get_replica_context().replica_id.unique_id

    def routing_context(self) -> tuple[KeySpace, PreTrainedTokenizerBase]:
        """What the ingress needs to compute this replica's chunk keys: the key space and the tokenizer."""
        return self.engine.factories.key_space, self.engine.tokenizer

    def stored(self, keys: Sequence[str]) -> list[bool]:
        """Whether this replica's store (RAM, then its lower tiers) holds each of ``keys``."""
        return self.engine.store.contains_many(list(keys))

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to ``request`` (see :func:`call_asgi`)."""
        async for part in call_asgi(self.app, request, self.replica):
            yield part

    def __del__(self) -> None:  # Ray Serve's graceful replica shutdown
        app = getattr(self, "app", None)
        if app is not None:
            app.state.shutdown_worker()
            self.engine.store.close()  # queued Redis writes finish


def prompt_ids(tokens: SegmentTokenizer, path: str, body: bytes) -> list[int] | None:
    """The prompt's token ids exactly as a replica tokenises it, for the request kinds the ingress can render alone
    (plain chat messages, their contents strings or lists of text parts, rendered by the engine's own function;
    one completion prompt); None otherwise (tools, and any body the ingress fails to read, render or tokenise:
    those are routed by load, and a bad body gets its 400 from the replica). ``tokens``: the replicas' tokenizer
    with a token ids cache of the ingress's own (a chat's earlier messages are not tokenized again)."""
    try:
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(json.loads(body))
            if chat.tools or any(m.tool_calls or m.role == "tool" for m in chat.messages):
                return None
            messages = plain_messages(chat.messages)
            ids, _ = encode_chat_segments(tokens.tokenizer, messages, boundaries=DocumentBoundaries.NONE, tokens=tokens)
            return ids
        if path == "/v1/completions":
            prompt = CompletionRequest.model_validate(json.loads(body)).prompt
            text = prompt if isinstance(prompt, str) else prompt[0] if len(prompt) == 1 else None
            return tokens.encode(text, add_special_tokens=True) if text else None
    except Exception:  # not JSON, a template refusing the messages, ...: the replica answers with its own error
        return None
    return None


def is_reproducible(body: bytes) -> bool:
    """Whether generating ``body`` again gives the same events: greedy (temperature 0) or seeded."""
    try:
        fields = json.loads(body)
    except ValueError:
        return False
    return isinstance(fields, dict) and (fields.get("temperature") == 0 or fields.get("seed") is not None)


def cache_salt(body: bytes) -> str | None:
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    salt = fields.get("cache_salt") if isinstance(fields, dict) else None
    return salt if isinstance(salt, str) else None


class SseEvents:
    """Cuts a byte stream into complete server-sent events (each ending with a blank line)."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.pending += data
        *events, self.pending = self.pending.split(b"\n\n")
        return [event + b"\n\n" for event in events]


#: Keys whose values name the answer or a part of it, or date it: a resumed attempt's values are replaced by those
#: relayed (chat and completion chunks: ``id``, ``created``, a tool call's ``id``; Responses API events: the
#: response's ``id`` and ``created_at``, its items' ``id`` and ``call_id``, an event's ``item_id``).
IDENTITY_KEYS = frozenset({"id", "created", "created_at", "item_id", "call_id"})


class StreamDiverged(KVBoostError):
    """A resumed attempt's replay does not match the events the client already has: the stream is cut."""


class StreamIdentity:
    """Keeps a stream continued by other replicas one answer: the client never sees two values for one thing.

    The values under :data:`IDENTITY_KEYS` anywhere in each relayed event's JSON data are recorded as relayed. A
    resumed attempt replays the events the client already has; each replayed event is matched, value for value,
    with the one relayed at its position, which tells which of the new replica's values stand for which relayed
    ones; the attempt's later events carry the relayed values instead. Values first seen after a resume (a new
    item) pass as they are. A replay whose values cannot be matched one to one raises :class:`StreamDiverged`."""

    def __init__(self) -> None:
        self.relayed: list[list[object]] = []  # per relayed event: its identity values, as relayed
        self.replacing: dict[object, object] = {}  # the current attempt's value -> the relayed value it stands for
        self.replaced_by: dict[object, object] = {}  # the inverse of ``replacing``

    def resume(self) -> None:
        """A new attempt starts: its values are learned again from its replay."""
        self.replacing, self.replaced_by = {}, {}

    def replayed(self, index: int, event: bytes) -> None:
        """Learn from ``event``, the current attempt's replay of relayed event ``index`` (not relayed again)."""
        values, relayed = list(_identities(_split_event(event)[1])), self.relayed[index]
        if len(values) != len(relayed) or any(
            self.replacing.setdefault(new, old) != old or self.replaced_by.setdefault(old, new) != new
            for new, old in zip(values, relayed, strict=True)
        ):
            raise StreamDiverged(f"event {index} replayed by another replica names other things than the one relayed")

    def relay(self, event: bytes) -> bytes:
        """``event`` as the client gets it: the current attempt's learned values replaced by the relayed ones."""
        head, data = _split_event(event)
        if self.replacing and data is not None and (replaced := _replaced(data, self.replacing)) != data:
            event, data = head + b"data: " + json.dumps(replaced).encode() + b"\n\n", replaced
        self.relayed.append(list(_identities(data)))
        return event


def _split_event(event: bytes) -> tuple[bytes, object]:
    """An event's lines before its ``data:`` line (``event: ...`` of the Responses API), and its data parsed as
    JSON; ``(event, None)`` when it has no JSON data (``data: [DONE]``)."""
    start = 0 if event.startswith(b"data: ") else event.find(b"\ndata: ") + 1
    if start == 0 and not event.startswith(b"data: "):
        return event, None
    try:
        return event[:start], json.loads(event[start + len(b"data: ") :])
    except ValueError:
        return event, None


def _is_identity(key: object, value: object) -> bool:
    return key in IDENTITY_KEYS and isinstance(value, (str, int))


def _identities(data: object) -> Iterator[object]:
    """The values under :data:`IDENTITY_KEYS` anywhere in ``data``, in document order."""
    if isinstance(data, dict):
        for key, value in data.items():
            if _is_identity(key, value):
                yield value
            else:
                yield from _identities(value)
    elif isinstance(data, list):
        for value in data:
            yield from _identities(value)


def _replaced(data: object, replacing: dict[object, object]) -> object:
    """``data`` with each identity value that ``replacing`` names replaced."""
    if isinstance(data, dict):
        return {
            key: replacing.get(value, value) if _is_identity(key, value) else _replaced(value, replacing)
            for key, value in data.items()
        }
    if isinstance(data, list):
        return [_replaced(value, replacing) for value in data]
    return data


class ReplicasLost(KVBoostError):
    """Every attempt at a request met a dead replica."""


web = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the replicas' app answers those paths


@serve.ingress(web)
class Ingress:
    """The HTTP entry: keys each request, lets the replicas' router place it, relays the answer (see the module)."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        settings: ServerConfig,
        max_attempts: int = 3,
        max_routing_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        # the replicas' API key and body limits, checked here too: before this ingress reads or tokenises a body
        web.add_middleware(
            RequestGate,
            api_key=settings.api_key,
            max_body_bytes=settings.max_body_bytes,
            body_timeout_s=settings.body_timeout_s,
        )
        self.replicas = replicas
        self.max_attempts = max_attempts
        self.max_routing_chunks = max_routing_chunks
        self._context: tuple[KeySpace, SegmentTokenizer] | None = None

    @web.api_route("/{path:path}", methods=METHODS)
    async def relay(self, request: Request) -> Response:
        body = await request.body()
        keys = await self.keys(request.url.path, body)
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=tuple(request.headers.raw),
            body=body,
            routing_keys=keys,
        )
        try:
            start, parts = await self.open(forwarded)
            if start.is_event_stream:
                events = self.stream(forwarded, parts, is_reproducible(body))
                return StreamingResponse(events, status_code=start.status, headers=start.relayed_headers())
            for attempt in range(self.max_attempts):
                try:
                    content = b"".join([part async for part in parts if isinstance(part, bytes)])
                    return Response(content, status_code=start.status, headers=start.relayed_headers())
                except REPLICA_LOST as exc:
                    logger.warning("replica %s lost during a request (attempt %d): %s", start.replica, attempt + 1, exc)
                    start, parts = await self.open(forwarded)
            raise ReplicasLost
        except ReplicasLost:
            return ApiError(503, f"no replica answered in {self.max_attempts} attempts; retry later").response()

    async def keys(self, path: str, body: bytes) -> tuple[str, ...]:
        """The request's routing keys (() when the ingress cannot render its prompt)."""
        if self._context is None:
            try:
                space, tokenizer = await self.replicas.routing_context.remote()
                cache = TokenIdsCache(TokenCacheConfig().max_bytes)
                self._context = space, await asyncio.to_thread(SegmentTokenizer, tokenizer, cache)
            except REPLICA_LOST:
                return ()  # routed by load; the next request asks again
        space, tokens = self._context
        ids = await asyncio.to_thread(prompt_ids, tokens, path, body)
        return routing_keys(space, ids, cache_salt(body), self.max_routing_chunks) if ids else ()

    async def open(self, forwarded: ForwardedRequest) -> tuple[ResponseStart, DeploymentResponseGenerator]:
        """Send ``forwarded`` to a replica and wait for its :class:`ResponseStart`, retrying on lost replicas."""
        for attempt in range(self.max_attempts):
            parts: DeploymentResponseGenerator = self.replicas.options(stream=True).handle.remote(forwarded)  # type: ignore[assignment]
            try:
                start = await parts.__anext__()
            except REPLICA_LOST as exc:
                logger.warning("replica lost before answering (attempt %d): %s", attempt + 1, exc)
                continue
            assert isinstance(start, ResponseStart)
            return start, parts
        raise ReplicasLost

    async def stream(
        self, forwarded: ForwardedRequest, parts: DeploymentResponseGenerator, reproducible: bool
    ) -> AsyncIterator[bytes]:
        """Relay complete events; if the replica dies, continue a reproducible stream on another replica from the
        first event the client has not seen (its earlier events are generated again and skipped). The stream keeps
        its first ids and creation times (the answer's; a Responses API response's and its items': see
        :class:`StreamIdentity`), and is cut when the replay names other things; its usage, if asked for, is the
        last replica's, which generated the whole answer again: its tokens are the whole answer's."""
        relayed, attempts = 0, 1
        identity = StreamIdentity()
        try:
            while True:
                events, position = SseEvents(), 0
                try:
                    async for part in parts:
                        for event in events.feed(part):
                            if position < relayed:
                                identity.replayed(position, event)
                            else:
                                relayed += 1
                                yield identity.relay(event)
                            position += 1
                    return
                except REPLICA_LOST as exc:
                    logger.warning("replica lost after %d events (attempt %d): %s", relayed, attempts, exc)
                    if not reproducible or attempts >= self.max_attempts:
                        raise
                    attempts += 1
                    identity.resume()
                    _, parts = await self.open(forwarded)
        finally:
            parts.cancel()


def replica_actor_names(app_name: str) -> list[str]:
    """Names of the live ``KVBoostReplica`` actors of Ray Serve application ``app_name``."""
    prefix = f"SERVE_REPLICA::{app_name}#{KVBoostReplica.__name__}#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in actors if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix))


def kill_replica(app_name: str, replica: str | None = None) -> str:
    """Kill one replica process of ``app_name`` without warning (the one whose id is ``replica``, else the first);
    Ray Serve replaces it after a failed health check. Returns the killed replica's id. For tests and benchmarks."""
    names = [n for n in replica_actor_names(app_name) if replica is None or n.endswith(f"#{replica}")]
    if not names:
        raise NotFoundError(f"no live replica {replica or ''} in application {app_name!r}")
    ray.kill(ray.get_actor(names[0], namespace=SERVE_NAMESPACE), no_restart=True)
    return names[0].rsplit("#", 1)[1]
