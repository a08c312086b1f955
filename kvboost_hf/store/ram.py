"""RAM tier: the store's first tier, in process memory, bounded in bytes."""

from __future__ import annotations

import threading

import torch

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.store.base import FrequencyRecencyOrder, StorageTier, StoredChunk


class RamTier(StorageTier):
    """In-process tier bounded by ``max_bytes``.

    Eviction order: fewest hits first, then least recently used (a system prompt read by every request stays
    resident). Pinned entries are never evicted. An entry larger than the whole budget, or that cannot fit
    because everything else is pinned, is refused (``put`` returns it as evicted).
    Invariant: ``nbytes <= max_bytes`` at every moment.
    """

    name = "ram"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ConfigError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: dict[str, StoredChunk] = {}
        self._order = FrequencyRecencyOrder()
        self._nbytes = 0
        self._lock = threading.RLock()
        self.evictions = 0

    def get(self, key: str) -> StoredChunk | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._order.touch(key, hit=True)
            return entry

    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        with self._lock:
            if key in self._entries:
                self._order.touch(key, hit=False)
                return []
            if self._nbytes + entry.nbytes > self.max_bytes and entry.nbytes > self.max_bytes - self._pinned_bytes():
                return [(key, entry)]  # larger than what evictions could free: refused without evicting anything
            evicted: list[tuple[str, StoredChunk]] = []
            while self._nbytes + entry.nbytes > self.max_bytes:
                victim = self._order.pop_victim()
                if victim is None:
                    return [*evicted, (key, entry)]
                evicted.append((victim, self._remove(victim)))
                self.evictions += 1
            self._entries[key] = entry
            self._nbytes += entry.nbytes
            self._order.add(key)
            return evicted

    def _pinned_bytes(self) -> int:
        """Bytes held by pinned entries (never evicted); under the lock."""
        return sum(self._entries[k].nbytes for k in self._order.pinned_keys() if k in self._entries)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> None:
        with self._lock:
            if key in self._entries:
                self._order.discard(key)
                self._remove(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._order.clear()
            self._nbytes = 0

    def items(self) -> list[tuple[str, StoredChunk]]:
        """A snapshot of the resident entries."""
        with self._lock:
            return list(self._entries.items())

    def pin(self, key: str) -> bool:
        """Protect ``key`` from eviction; False if it is not resident."""
        with self._lock:
            if key not in self._entries:
                return False
            self._order.pin(key)
            return True

    def unpin(self, key: str) -> None:
        with self._lock:
            if key in self._entries:
                self._order.unpin(key)

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return self._order.is_pinned(key)

    def eviction_order(self) -> list[str]:
        """Unpinned keys in the order they would be evicted (for inspection and tests)."""
        with self._lock:
            return self._order.order()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stats(self) -> dict[str, int]:
        return {"bytes": self._nbytes, "chunks": len(self._entries), "evictions": self.evictions}

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: str) -> StoredChunk:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes
        return entry


class GpuTier(RamTier):
    """The RAM tier's policy over GPU memory: entries live on ``device``, where the cache copies them from at
    device bandwidth. It sits in front of RAM (every entry it holds is also written to RAM, so an eviction drops
    nothing the store does not hold below)."""

    name = "gpu"

    def __init__(self, max_bytes: int, device: torch.device | str) -> None:
        super().__init__(max_bytes)
        self.device = torch.device(device)
