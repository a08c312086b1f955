"""Remote tier: chunks shared by several processes or machines through Redis.

* Records are :mod:`kvboost_hf.store.codec` records (no pickle) stored under ``<prefix><key>``; the record names
  its key, so a value copied under another key (or from another namespace) is refused. Unfinished-chunk notes
  live in sets under ``<prefix>tail:<parent key>``.
* Writes go through a bounded :class:`~.base.BackgroundWriter`, one pipeline per batch: a request never waits on
  Redis. A full queue drops the write (counted in ``dropped``). ``ttl_s`` sets an expiry on every key written.
* Reads use their own connection with a short socket timeout (``read_timeout_s``, distinct from the writer's
  ``timeout_s``), so a hung or busy Redis delays a lookup by at most that; a prompt's candidate chunks are fetched
  with one pipeline (:meth:`RemoteTier.get_many`), existence checks likewise.
* Eviction is Redis's: run it with ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru``.
* Failures never reach the caller: a Redis error counts in ``errors`` and is a miss (or a dropped write). A lost
  connection or a timeout logs one warning per outage, and the tier answers misses (and drops writes) for
  ``retry_after_s`` before trying again. When Redis answers again after an outage, or answers with another
  ``run_id`` (restarted, maybe empty: checked every ``watch_interval_s`` by a watcher thread, since the client
  reconnects silently), ``on_reconnect`` is called: the store re-publishes its RAM entries. An error reply
  (such as OOM) fails only that operation. A record that fails verification, or a key holding another Redis
  type (a record or a tail note), is deleted, counted in ``corrupt`` and served as a miss; a record whose HMAC
  seal does not verify, or a sealed record read without ``hmac_key``, is counted and refused but left in place
  (it may be another replica's, sealed with its own secret). Reads connect with ``read_timeout_s`` too, so a
  connect that hangs is bounded the same way.
* AUTH and TLS come from the URL: ``redis://user:password@host:6379/0``, ``rediss://...`` for TLS. A Redis
  Cluster (or Valkey cluster) is named ``redis+cluster://host:port`` (any node; ``rediss+cluster://`` for TLS):
  keys spread over its shards, batches are split by node.
* ``hmac_key``: records are sealed with HMAC-SHA256 under this secret and unsealed records are refused. Without
  it the SHA-256 inside a record only detects damage: anyone who can write to Redis can forge a record that is
  served. With it, a writer without the secret can delete or evict records (misses) but not make this process
  serve K/V it did not compute (replaying a genuine record under its own key gives the same K/V).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvboost_hf.core.errors import ConfigError, MissingDependencyError
from kvboost_hf.store import codec
from kvboost_hf.store.base import CLOSE_TIMEOUT_S, BackgroundWriter, StorageTier, StoredChunk

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kvboost:"
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
DEFAULT_READ_TIMEOUT_S = 0.25  # seconds a lookup may wait before it is a miss (StoreConfig.remote_read_timeout_s)
_TAIL = "tail:"
_OWN_NAME = re.compile(rb"(tail:)?[0-9a-f]*")  # what follows the prefix in a name this tier writes
_DELETE = object()
_SEAL = b"KVBH"
_TAG_BYTES = 32


class RemoteTier(StorageTier):
    """Redis-backed tier (see the module docstring).

    ``nbytes`` and ``len`` count the records this process wrote (Redis may have evicted some since);
    ``put`` never evicts anything locally and always returns ``[]``.
    """

    name = "remote"
    local = False
    shared = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        queue_size: int = 256,
        timeout_s: float = 1.0,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        retry_after_s: float = 2.0,
        ttl_s: float | None = None,
        hmac_key: bytes | str | None = None,
        on_reconnect: Callable[[], None] | None = None,
        watch_interval_s: float = 5.0,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("remote_url needs the redis client: pip install 'kvboost_hf[remote]'") from exc
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"remote ttl_s must be > 0 seconds, got {ttl_s}")
        if read_timeout_s <= 0 or timeout_s <= 0:
            raise ConfigError(f"Redis timeouts must be > 0 seconds, got {timeout_s}, {read_timeout_s}")
        self.prefix = prefix
        self.retry_after_s = retry_after_s
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.on_reconnect = on_reconnect
        self._hmac_key = hmac_key.encode() if isinstance(hmac_key, str) else hmac_key
        self._redis_error: type[Exception] = redis.RedisError
        self._response_error: type[Exception] = redis.ResponseError
        self._outage_errors: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
        self._reply_error_logged = False
        check_url(url)
        no_retry = Retry(NoBackoff(), 0)
        scheme, sep, rest = url.partition("://")
        self.cluster = scheme.endswith("+cluster")
        connect: Any = redis.RedisCluster.from_url if self.cluster else redis.Redis.from_url
        url = scheme.removesuffix("+cluster") + sep + rest
        self._client: Any = connect(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=no_retry)
        self._reader: Any = connect(  # connecting counts against the read bound too (a hung connect)
            url, socket_timeout=read_timeout_s, socket_connect_timeout=read_timeout_s, retry=no_retry
        )
        self.errors = 0
        self.corrupt = 0
        self.written_bytes = 0
        self.written = 0
        self.republished = 0
        self._lost_writes = 0
        self._down_until = 0.0
        self._republished_on_reconnect = False  # until check_restart next reads the run_id
        self._state_lock = threading.Lock()
        self._writer = BackgroundWriter("remote", self._write_batch, queue_size=queue_size)
        self._run_id: str | None = None
        self._stop_watch = threading.Event()
        self.check_restart()
        self._watcher = threading.Thread(
            target=self._watch, args=(watch_interval_s,), name="kvboost-remote-watch", daemon=True
        )
        self._watcher.start()

    # ------------------------------------------------------------------ StorageTier
    def get(self, key: str) -> StoredChunk | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[StoredChunk | None]:
        """The verified entries under ``keys`` (None for misses), fetched with one pipelined round trip."""
        if not keys:
            return []

        def fetch() -> list[Any]:
            pipe = self._reader.pipeline(transaction=False)
            for key in keys:
                pipe.get(self.prefix + key)
            return pipe.execute(raise_on_error=False)

        replies = self._call(fetch)
        if replies is None:
            return [None] * len(keys)
        return [self._verified(key, reply) for key, reply in zip(keys, replies, strict=True)]

    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        """Queue a background write; drop it (counted) if the queue is full or Redis is down."""
        if self._down():
            with self._state_lock:
                self._lost_writes += 1
        else:
            self._writer.submit(key, entry)
        return []

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in Redis, with one pipelined round trip (False for all while Redis is down)."""
        if not keys:
            return []

        def check() -> list[Any]:
            pipe = self._reader.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + key)
            return pipe.execute()

        replies = self._call(check)
        return [bool(r) for r in replies] if replies is not None else [False] * len(keys)

    def delete(self, key: str) -> None:
        self._call(lambda: self._client.delete(self.prefix + key))

    def clear(self) -> None:
        """Delete every record under this tier's prefix (shared with every process using the prefix); the names of a
        longer prefix that starts with this one (another tenant's) are left alone."""

        def unlink_all() -> None:
            pipe = self._client.pipeline(transaction=False)  # one UNLINK per key: keys of a cluster span slots
            names = self._client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000)
            start = len(self.prefix.encode())
            ours = (name for name in names if _OWN_NAME.fullmatch(name[start:]))  # not a longer prefix's names
            for i, name in enumerate(ours):
                pipe.unlink(name)
                if i % 1000 == 999:
                    pipe.execute()
            pipe.execute()

        self._call(unlink_all)

    @property
    def nbytes(self) -> int:
        return self.written_bytes

    def __len__(self) -> int:
        return self.written

    def stats(self) -> dict[str, int]:
        """``bytes`` (written by this process), ``errors``, ``dropped`` (writes not done), ``republished``,
        ``corrupt`` (records refused)."""
        with self._state_lock:
            counters = {"errors": self.errors, "republished": self.republished, "corrupt": self.corrupt}
        return {"bytes": self.written_bytes, "dropped": self.dropped, **counters}

    # ------------------------------------------------------------------ tails
    def note_tail(self, parent_key: str, lengths: frozenset[int]) -> None:
        """Queue adding ``lengths`` to the shared set of tail lengths after ``parent_key``."""
        if not self._down():
            self._writer.submit(_TAIL + parent_key, lengths)

    def tail_lengths(self, parent_key: str) -> set[int]:
        """Lengths noted after ``parent_key``; a key of another Redis type there (not written by this library) is
        deleted and counted in ``corrupt``, so that later notes can be added."""
        name = self.prefix + _TAIL + parent_key

        def read() -> Any:
            try:
                return self._reader.smembers(name)
            except self._response_error as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
            with self._state_lock:
                self.corrupt += 1
            logger.warning("remote tier: deleting %s, which is not a set of tail lengths", name)
            self._client.delete(name)
            return set()

        members = self._call(read)
        out: set[int] = set()
        for member in members or ():
            try:
                out.add(int(member))
            except ValueError:
                continue  # not written by this library: ignored
        return out

    # ------------------------------------------------------------------ lifecycle
    @property
    def dropped(self) -> int:
        """Writes not done: queue full, Redis down or refusing them."""
        with self._state_lock:
            return self._writer.dropped + self._lost_writes

    @property
    def waiting(self) -> int:
        """Writes queued and not yet taken by the writer thread."""
        return self._writer.waiting

    def republish(self, entries: Iterable[tuple[str, StoredChunk]], wait_s: float = 1.0) -> None:
        """Write ``entries`` again from a background thread (waiting up to ``wait_s`` for queue room each):
        Redis lost them (restart, eviction)."""

        def submit_all() -> None:
            for key, entry in entries:
                if self._down() or not self._writer.submit(key, entry, block_s=wait_s):
                    return
                with self._state_lock:
                    self.republished += 1

        threading.Thread(target=submit_all, name="kvboost-remote-republish", daemon=True).start()

    def check_restart(self) -> bool:
        """Whether Redis answers with another ``run_id`` than last time (it restarted); then ``on_reconnect``
        is called. The watcher thread runs this every ``watch_interval_s``."""
        run_id = self._call(self._run_ids)
        if not run_id:
            return False
        with self._state_lock:
            restarted = self._run_id is not None and run_id != self._run_id
            self._run_id = run_id
            republished, self._republished_on_reconnect = self._republished_on_reconnect, False
        if restarted and not republished:  # after an outage the reconnection published them already
            logger.warning("remote tier: Redis restarted (new run_id); publishing local entries again")
            if self.on_reconnect is not None:
                self.on_reconnect()
        return restarted

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every queued write is done (or dropped); False if ``timeout_s`` passed first."""
        return self._writer.flush(timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the writer and close the connections. Idempotent."""
        self._stop_watch.set()
        self._writer.close(timeout_s)
        self._client.close()
        self._reader.close()

    def ping(self) -> bool:
        """Whether Redis answers now (bypasses the outage back-off)."""
        try:
            return bool(self._client.ping())
        except self._redis_error:
            return False

    # ------------------------------------------------------------------ internals
    def _verified(self, key: str, reply: Any) -> StoredChunk | None:
        if reply is None:
            return None
        if isinstance(reply, Exception) and "WRONGTYPE" not in str(reply):
            with self._state_lock:
                self.errors += 1
            logger.debug("remote tier: Redis refused a read: %s", reply)
            return None
        try:
            if isinstance(reply, Exception):  # a key holding a list, set...: not written by this library
                raise codec.CorruptEntryError(str(reply))
            return codec.decode(key, self._unseal(reply))
        except _Unverifiable as exc:  # maybe a replica with another secret: refused, left for its owner
            with self._state_lock:
                self.corrupt += 1
            logger.debug("remote tier: refusing record %s%s... (%s)", self.prefix, key[:16], exc)
            return None
        except codec.CorruptEntryError as exc:
            with self._state_lock:
                self.corrupt += 1
            logger.warning("remote tier: dropping corrupt record %s%s... (%s)", self.prefix, key[:16], exc)
            self.delete(key)
            return None

    def _seal(self, record: bytearray) -> bytes | bytearray:
        if self._hmac_key is None:
            return record
        tag = hmac.new(self._hmac_key, record, hashlib.sha256).digest()
        return _SEAL + tag + record

    def _unseal(self, raw: bytes) -> bytes | memoryview:
        """The codec record inside ``raw``; :class:`_Unverifiable` for a record this process cannot check
        (sealed, with no key here; unsealed or sealed with another key, with one): never deleted."""
        view = memoryview(raw)
        if self._hmac_key is None:
            if view[: len(_SEAL)] == _SEAL:  # codec records start with codec.MAGIC, never with _SEAL
                raise _Unverifiable("record sealed with an HMAC key, and this store has none")
            return raw
        head = len(_SEAL) + _TAG_BYTES
        if len(raw) < head or view[: len(_SEAL)] != _SEAL:
            raise _Unverifiable("record is not sealed with the HMAC key")
        expected = hmac.new(self._hmac_key, view[head:], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, bytes(view[len(_SEAL) : head])):
            raise _Unverifiable("HMAC mismatch (record not written with this store's key)")
        return view[head:]

    def _run_ids(self) -> str:
        """The server's ``run_id`` (a cluster: every primary's, joined)."""
        if not self.cluster:
            return str(self._client.info("server").get("run_id", ""))
        per_node = self._client.info("server", target_nodes=self._client.PRIMARIES)
        return ",".join(sorted(str(info.get("run_id", "")) for info in per_node.values()))

    def _watch(self, interval_s: float) -> None:
        while not self._stop_watch.wait(interval_s):
            self.check_restart()

    def _write_batch(self, batch: list[tuple[str, Any]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        sizes = []
        records, refused = codec.encode_each([(key, item) for key, item in batch if not key.startswith(_TAIL)])
        for key, item in batch:
            if key.startswith(_TAIL):
                pipe.sadd(self.prefix + key, *sorted(item))
                if self.ttl_ms is not None:
                    pipe.pexpire(self.prefix + key, self.ttl_ms)
        for key, record in records:
            value = self._seal(record)
            pipe.set(self.prefix + key, memoryview(value), px=self.ttl_ms)
            sizes.append(len(value))
        if refused:
            with self._state_lock:
                self._lost_writes += len(refused)
        if self._call(pipe.execute) is None:
            with self._state_lock:
                self._lost_writes += len(batch)
            return
        with self._state_lock:
            self.written += len(sizes)
            self.written_bytes += sum(sizes)

    def _call(self, operation: Callable[[], Any]) -> Any:
        """Run one Redis operation; None on any Redis error (counted and logged) or while Redis is down.

        Connection errors and timeouts start an outage (misses without network calls for ``retry_after_s``);
        an error reply (e.g. OOM for a value above ``maxmemory``) only fails this operation.
        """
        if self._down():
            return None
        try:
            result = operation()
        except self._outage_errors as exc:
            with self._state_lock:
                self.errors += 1
                first = self._down_until == 0.0
                self._down_until = time.monotonic() + self.retry_after_s
            if first:
                logger.warning(
                    "remote tier unavailable (%s: %s); serving misses, retrying every %.1f s",
                    type(exc).__name__,
                    exc,
                    self.retry_after_s,
                )
            return None
        except self._redis_error as exc:
            with self._state_lock:
                self.errors += 1
                first, self._reply_error_logged = not self._reply_error_logged, True
            logger.log(logging.WARNING if first else logging.DEBUG, "remote tier: Redis refused an operation: %s", exc)
            return None
        with self._state_lock:
            reconnected, self._down_until = self._down_until != 0.0, 0.0
            self._republished_on_reconnect |= reconnected and self.on_reconnect is not None
        if reconnected:
            logger.warning("remote tier is reachable again")
            if self.on_reconnect is not None:
                self.on_reconnect()
        return result

    def _down(self) -> bool:
        with self._state_lock:
            return time.monotonic() < self._down_until


class _Unverifiable(codec.CorruptEntryError):
    """A record whose HMAC seal is missing or made with another secret, or a sealed record read by a store
    without a secret: refused but not deleted (a replica configured with another secret shares the prefix)."""


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_url(url: object) -> None:
    """Raise :class:`~kvboost_hf.core.errors.ConfigError` unless ``url`` names a Redis server (:data:`URL_SCHEMES`)."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
        raise ConfigError(f"a Redis URL must start with one of {', '.join(URL_SCHEMES)}, got {url!r}")
