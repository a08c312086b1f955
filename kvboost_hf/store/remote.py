"""Remote tier: chunks shared by several processes or machines through Redis.

* Records are :mod:`kvboost_hf.store.codec` records (no pickle) stored under ``<prefix><key>``; the record names
  its key, so a value copied under another key (or from another namespace) is refused.
* Writes go through a bounded queue to one background thread: a request never waits on Redis. When the queue is
  full the write is dropped and counted (``dropped``).
* Eviction is Redis's: run it with ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru``.
* Failures never reach the caller: a Redis error counts in ``errors`` and is a miss (or a dropped write). A lost
  connection or a timeout logs one warning per outage, and the tier answers misses (and drops writes) for
  ``retry_after_s`` before trying again; an error reply (such as OOM) fails only that operation. A record that
  fails verification is deleted from Redis, counted in ``corrupt`` and served as a miss.
* AUTH and TLS come from the URL: ``redis://user:password@host:6379/0``, ``rediss://...`` for TLS.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from kvboost_hf.store import codec
from kvboost_hf.store.base import StorageTier, StoredChunk

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kvboost:"
_STOP = object()


class RemoteTier(StorageTier):
    """Redis-backed tier (see the module docstring).

    ``nbytes`` and ``len`` count the records this process wrote (Redis may have evicted some since);
    ``put`` never evicts anything locally and always returns ``[]``.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        queue_size: int = 256,
        timeout_s: float = 1.0,
        retry_after_s: float = 2.0,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("remote_url needs the redis client: pip install 'kvboost_hf[remote]'") from exc
        self.prefix = prefix
        self.retry_after_s = retry_after_s
        self._redis_error: type[Exception] = redis.RedisError
        self._outage_errors: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
        self._reply_error_logged = False
        self._client: redis.Redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self.errors = 0
        self.dropped = 0
        self.corrupt = 0
        self.written_bytes = 0
        self.written = 0
        self._down_until = 0.0
        self._state_lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._state_lock)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kvboost-remote-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ StorageTier
    def get(self, key: str) -> StoredChunk | None:
        raw = self._call(lambda: self._client.get(self.prefix + key))
        if raw is None:
            return None
        try:
            return codec.decode(key, raw)
        except codec.CorruptEntryError as exc:
            with self._state_lock:
                self.corrupt += 1
            logger.warning("remote tier: dropping corrupt record %s%s... (%s)", self.prefix, key[:16], exc)
            self.delete(key)
            return None

    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        """Queue a background write; drop it (counted) if the queue is full or Redis is down."""
        with self._state_lock:
            if self._is_down():
                self.dropped += 1
                return []
            self._pending += 1
        try:
            self._queue.put_nowait((key, entry))
        except queue.Full:
            with self._state_lock:
                self.dropped += 1
                self._done_one()
        return []

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self._client.exists(self.prefix + key)))

    def delete(self, key: str) -> None:
        self._call(lambda: self._client.delete(self.prefix + key))

    def clear(self) -> None:
        """Delete every record under this tier's prefix (shared with every process using the prefix)."""

        def unlink_all() -> None:
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

        self._call(unlink_all)

    @property
    def nbytes(self) -> int:
        return self.written_bytes

    def __len__(self) -> int:
        return self.written

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (or dropped); False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._idle.wait(remaining):
                    return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the writer and close the connections. Idempotent."""
        if not self._writer.is_alive():
            return
        self.flush(timeout_s)
        self._queue.put(_STOP)
        self._writer.join(timeout_s)
        self._client.close()

    def ping(self) -> bool:
        """Whether Redis answers now (bypasses the outage back-off)."""
        try:
            return bool(self._client.ping())
        except self._redis_error:
            return False

    # ------------------------------------------------------------------ internals
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            key, entry = item
            try:
                record = codec.encode(key, entry)
                if self._call(lambda k=key, r=record: self._client.set(self.prefix + k, memoryview(r))) is None:
                    with self._state_lock:
                        self.dropped += 1
                else:
                    with self._state_lock:
                        self.written += 1
                        self.written_bytes += len(record)
            except Exception:  # the writer thread must survive anything one entry does
                logger.exception("remote tier: writing %s... failed", key[:16])
                with self._state_lock:
                    self.dropped += 1
            finally:
                with self._state_lock:
                    self._done_one()

    def _call(self, operation: Any) -> Any:
        """Run one Redis operation; None on any Redis error (counted and logged) or while Redis is down.

        Connection errors and timeouts start an outage (misses without network calls for ``retry_after_s``);
        an error reply (e.g. OOM for a value above ``maxmemory``) only fails this operation.
        """
        with self._state_lock:
            if self._is_down():
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
            if self._down_until:
                logger.warning("remote tier is reachable again")
                self._down_until = 0.0
        return result

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _done_one(self) -> None:
        self._pending -= 1
        if not self._pending:
            self._idle.notify_all()


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
