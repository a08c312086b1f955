"""Types shared by the store and its tiers: the stored form of an entry, the tier interface, the eviction order."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.store.quantization import QuantizedChunk

logger = logging.getLogger(__name__)

StoredChunk: TypeAlias = ChunkKV | QuantizedChunk
"""What tiers hold: the K/V as computed (``kv_cache_bits=16``) or KIVI-quantized (8 or 4 bits)."""


CLOSE_TIMEOUT_S = 10.0  # seconds flush() and close() wait for background writes unless told otherwise


class StorageTier(ABC):
    """One level of the store. Implementations are thread-safe and never exceed their byte budget.

    Tiers hold :data:`StoredChunk` values and never convert between forms; the store quantizes on ``put`` and
    dequantises on ``get``. The abstract members are the minimum; the others have defaults that a tier overrides
    when it can do better (one round trip for a batch, a persistent tail index, background writes to finish).
    Class attributes tell the store how to treat the tier:

    * ``local``: ``contains`` is cheap (no network): the store checks it before writing an entry again, gives
      the tier RAM's evictions and re-queues RAM entries it misses on :meth:`flush`. Remote tiers set False.
    * ``shared``: other processes see its entries, so :meth:`ChunkStore.clear` leaves it alone unless asked.
    * ``on_reconnect``: set by the store; a tier that may have lost its entries (a restarted server) calls it,
      and the store writes its RAM entries and tail notes there again.
    """

    name: str
    local: bool = True
    shared: bool = False
    on_reconnect: Callable[[], None] | None = None

    @abstractmethod
    def get(self, key: str) -> StoredChunk | None:
        """The entry under ``key``, or None. Never returns an entry whose bytes fail verification."""

    @abstractmethod
    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        """Store ``entry``; return what left this tier for a lower one: the entries evicted to make room and
        ``(key, entry)`` itself if it was refused. A tier with nothing below it may drop its victims instead."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes currently held."""

    @abstractmethod
    def __len__(self) -> int: ...

    def get_many(self, keys: Sequence[str]) -> list[StoredChunk | None]:
        """:meth:`get` for each key, in order (override to batch)."""
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains` for each key, in order (override to batch)."""
        return [self.contains(key) for key in keys]

    def note_tail(self, parent_key: str, lengths: frozenset[int]) -> None:
        """Remember that unfinished chunks of ``lengths`` tokens follow ``parent_key`` (default: not kept)."""
        return None  # a tier without this feature has nothing to do

    def tail_lengths(self, parent_key: str) -> set[int]:
        """Lengths noted after ``parent_key`` (default: none)."""
        return set()

    def items(self) -> list[tuple[str, StoredChunk]]:
        """A snapshot of the entries, for tiers that can list them cheaply (default: none)."""
        return []

    def pin(self, key: str) -> bool:
        """Keep ``key`` from eviction; False if the tier does not hold it or cannot pin (the default)."""
        return False

    def unpin(self, key: str) -> None:
        """Undo :meth:`pin` (default: nothing to undo)."""
        return None  # a tier without this feature has nothing to do

    def republish(self, entries: Iterable[tuple[str, StoredChunk]]) -> None:
        """Write ``entries`` again after the tier lost its contents (default: :meth:`put` each)."""
        for key, entry in entries:
            self.put(key, entry)

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait up to ``timeout_s`` for background writes; False if some are still pending (default: none)."""
        return True

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish background writes (up to ``timeout_s``) and release resources; idempotent (default: nothing)."""
        return None  # a tier without this feature has nothing to do

    def stats(self) -> dict[str, int]:
        """Counters of this tier; the store reports them as ``<name>_<counter>``. Default: ``bytes`` and
        ``chunks``. May raise (damaged storage): the store then reports the tier degraded."""
        return {"bytes": self.nbytes, "chunks": len(self)}


class FrequencyRecencyOrder:
    """Eviction order of a tier: fewest hits first, then least recently touched; pinned keys are never chosen.

    Not thread-safe: the owning tier calls it under its own lock. Ticks only grow, and :meth:`add` accepts a
    saved ``(hits, tick)`` so that a tier reopened from disk keeps its order.
    """

    def __init__(self) -> None:
        self._state: dict[str, tuple[int, int]] = {}  # key -> (hits, tick)
        self._pinned: set[str] = set()
        self._heap: list[tuple[int, int, str]] = []  # lazily deleted: items not matching _state are stale
        self._next_tick = 0

    def __contains__(self, key: str) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def add(self, key: str, hits: int = 0, tick: int | None = None) -> None:
        """Track ``key`` (replacing its state), touched now unless a saved ``tick`` is given."""
        if tick is None:
            tick = self._next_tick
        self._next_tick = max(self._next_tick, tick + 1)
        self._set(key, hits, tick)

    def touch(self, key: str, hit: bool) -> None:
        """Mark ``key`` as just used; ``hit`` also counts one more read."""
        hits, _ = self._state[key]
        self.add(key, hits + int(hit))

    def discard(self, key: str) -> None:
        self._state.pop(key, None)
        self._pinned.discard(key)

    def clear(self) -> None:
        self._state.clear()
        self._pinned.clear()
        self._heap.clear()

    def state(self, key: str) -> tuple[int, int]:
        """``(hits, tick)`` of a tracked key."""
        return self._state[key]

    def pin(self, key: str) -> None:
        self._pinned.add(key)

    def unpin(self, key: str) -> None:
        if key in self._pinned:
            self._pinned.discard(key)
            self.touch(key, hit=False)  # its heap item may have been popped while pinned

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def pinned_keys(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def pop_victim(self) -> str | None:
        """Stop tracking and return the next unpinned key to evict; None if every key is pinned."""
        while self._heap:
            hits, tick, key = heapq.heappop(self._heap)
            if self._state.get(key) != (hits, tick) or key in self._pinned:
                continue  # stale item; a pinned key is pushed again on unpin
            del self._state[key]
            return key
        return None

    def order(self) -> list[str]:
        """Unpinned keys in eviction order."""
        items = sorted((hits, tick, key) for key, (hits, tick) in self._state.items() if key not in self._pinned)
        return [key for _, _, key in items]

    def _set(self, key: str, hits: int, tick: int) -> None:
        self._state[key] = (hits, tick)
        heapq.heappush(self._heap, (hits, tick, key))
        if len(self._heap) > 4 * len(self._state) + 64:
            self._heap = [(h, t, k) for k, (h, t) in self._state.items()]
            heapq.heapify(self._heap)


class BackgroundWriter:
    """Write-behind for a slow tier: a bounded set of pending items drained in batches by one daemon thread.

    :meth:`submit` never waits on I/O: with ``queue_size`` items pending it drops the new one (counted in
    ``dropped``) unless ``block_s`` allows waiting for room. A key submitted again while pending replaces its item
    (one write). ``write(batch)`` runs on the writer thread with up to ``batch_size`` ``(key, item)`` pairs; an
    exception it raises is logged and counted in ``errors`` (the items are lost, the thread survives). ``write``
    may return the pairs it could not write yet (the storage is busy): they are queued again in front, unless a
    newer item was submitted under the key, and the thread waits ``retry_s`` before the next batch; once closing,
    they and everything still queued are dropped (counted). Until an item is written, :meth:`pending` serves it,
    so a read never misses a write in flight.
    """

    def __init__(
        self,
        name: str,
        write: Callable[[list[tuple[str, Any]]], list[tuple[str, Any]] | None],
        *,
        queue_size: int = 256,
        batch_size: int = 16,
        retry_s: float = 0.05,
    ) -> None:
        if queue_size < 1 or batch_size < 1:
            raise ConfigError(f"queue_size and batch_size must be >= 1, got {queue_size}, {batch_size}")
        self.name = name
        self.queue_size = queue_size
        self.batch_size = batch_size
        self.retry_s = retry_s
        self.dropped = 0
        self.errors = 0
        self.written = 0
        self._write = write
        self._queued: OrderedDict[str, Any] = OrderedDict()
        self._in_flight: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"kvboost-{name}-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, item: Any, block_s: float = 0.0) -> bool:
        """Queue ``item`` under ``key``; False (counted in ``dropped``) if the queue stayed full or it is closed."""
        deadline = time.monotonic() + block_s
        with self._cond:
            while not self._stopping and key not in self._queued and len(self._queued) >= self.queue_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.dropped += 1
                    return False
                self._cond.wait(remaining)
            if self._stopping:
                self.dropped += 1
                return False
            self._queued[key] = item
            self._cond.notify_all()
            return True

    def pending(self, key: str) -> Any | None:
        """The item queued or being written under ``key``, or None."""
        with self._cond:
            item = self._queued.get(key)
            return item if item is not None else self._in_flight.get(key)

    def __len__(self) -> int:
        """Items submitted and not yet written: waiting plus in flight."""
        with self._cond:
            return len(self._queued) + len(self._in_flight)

    @property
    def waiting(self) -> int:
        """Items submitted and not yet taken by the writer thread (what counts against ``queue_size``)."""
        with self._cond:
            return len(self._queued)

    @property
    def running(self) -> bool:
        """Whether the writer thread is alive (after :meth:`close`: still finishing a write)."""
        return self._thread.is_alive()

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every submitted item is written (or failed); False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queued or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Drain, then stop the thread, within ``timeout_s`` (plus two ``retry_s`` for a write that was waiting for
        busy storage: it then drops what is left); later submits are dropped. True if all was written."""
        deadline = time.monotonic() + timeout_s
        drained = self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(deadline - time.monotonic(), 2 * self.retry_s))  # a write waiting out its retry
        return drained

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._stopping:
                    self._cond.wait()
                if not self._queued:
                    return
                batch: list[tuple[str, Any]] = []
                while self._queued and len(batch) < self.batch_size:
                    batch.append(self._queued.popitem(last=False))
                self._in_flight = dict(batch)
                self._cond.notify_all()  # room in the queue
            retry: list[tuple[str, Any]] = []
            try:
                retry = self._write(batch) or []
                written, failed = len(batch) - len(retry), 0
            except Exception:  # the writer must survive anything a batch does
                logger.exception("%s tier: a background write of %d items failed", self.name, len(batch))
                written, failed = 0, 1
            with self._cond:
                self.written += written
                self.errors += failed
                self._in_flight = {}
                if retry and self._stopping:  # closing: nothing will free the storage in time
                    self.dropped += len(retry) + len(self._queued)
                    self._queued.clear()
                for key, item in reversed(retry if not self._stopping else []):
                    if key not in self._queued:
                        self._queued[key] = item
                        self._queued.move_to_end(key, last=False)
                self._cond.notify_all()
                if retry and not self._stopping:
                    self._cond.wait(self.retry_s)
