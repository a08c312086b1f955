"""Types shared by the store and its tiers: the stored form of an entry, the tier interface, the eviction order."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import TypeAlias

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.quantization import QuantizedChunk

StoredChunk: TypeAlias = ChunkKV | QuantizedChunk
"""What tiers hold: the K/V as computed (``kv_cache_bits=16``) or KIVI-quantized (8 or 4 bits)."""


class StorageTier(ABC):
    """One level of the store. Implementations are thread-safe and never exceed their byte budget.

    Tiers hold :data:`StoredChunk` values and never convert between forms; the store quantizes on ``put`` and
    dequantises on ``get``.
    """

    name: str

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
