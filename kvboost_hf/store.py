"""Stage 3: the chunk store, a stack of tiers behind one small interface.

:class:`ChunkStore` is what the cache talks to: ``get``/``put``/``contains``/``pin``. It owns an ordered list
of :class:`StorageTier` objects, fastest first (RAM, then disk and remote tiers when configured). A hit in a
lower tier is promoted into RAM; entries evicted from RAM are demoted to the next tier that accepts them.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkKV:
    """K/V of one chunk for every layer of a model.

    ``keys`` and ``values`` are ``[num_layers, num_kv_heads, num_tokens, head_dim]`` (keys already RoPE-rotated
    at the chunk's positions). Entries are immutable once stored: readers may share the tensors.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.values.dim() != 4 or self.keys.shape[:3] != self.values.shape[:3]:
            raise ValueError(
                "ChunkKV needs keys and values shaped [num_layers, num_kv_heads, num_tokens, head_dim], got "
                f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class StorageTier(ABC):
    """One level of the store. Implementations are thread-safe and never exceed their byte budget."""

    name: str

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None:
        """The entry under ``key``, or None. Never returns an entry whose bytes fail verification."""

    @abstractmethod
    def put(self, key: str, entry: ChunkKV) -> list[tuple[str, ChunkKV]]:
        """Store ``entry``; return the entries evicted to make room (for demotion to a lower tier)."""

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


@dataclass
class _RamSlot:
    entry: ChunkKV
    hits: int
    tick: int
    pinned: bool = False


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
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._slots: dict[str, _RamSlot] = {}
        self._heap: list[tuple[int, int, str]] = []  # (hits, tick, key); stale items skipped lazily
        self._ticks = itertools.count()
        self._nbytes = 0
        self._lock = threading.RLock()
        self.evictions = 0

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            slot.hits += 1
            self._touch(key, slot)
            return slot.entry

    def put(self, key: str, entry: ChunkKV) -> list[tuple[str, ChunkKV]]:
        with self._lock:
            if key in self._slots:
                self._touch(key, self._slots[key])
                return []
            size = entry.nbytes
            evicted: list[tuple[str, ChunkKV]] = []
            while self._nbytes + size > self.max_bytes:
                victim = self._pop_victim()
                if victim is None:
                    return [*evicted, (key, entry)]
                evicted.append(victim)
            slot = _RamSlot(entry, hits=0, tick=0)
            self._slots[key] = slot
            self._nbytes += size
            self._touch(key, slot)
            return evicted

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._slots

    def delete(self, key: str) -> None:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._nbytes -= slot.entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._heap.clear()
            self._nbytes = 0

    def pin(self, key: str) -> bool:
        """Protect ``key`` from eviction; False if it is not resident."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return False
            slot.pinned = True
            return True

    def unpin(self, key: str) -> None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.pinned:
                slot.pinned = False
                self._touch(key, slot)

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.pinned

    def eviction_order(self) -> list[str]:
        """Unpinned keys in the order they would be evicted (for inspection and tests)."""
        with self._lock:
            unpinned = [(s.hits, s.tick, k) for k, s in self._slots.items() if not s.pinned]
            return [k for _, _, k in sorted(unpinned)]

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._slots)

    def _touch(self, key: str, slot: _RamSlot) -> None:
        slot.tick = next(self._ticks)
        heapq.heappush(self._heap, (slot.hits, slot.tick, key))
        if len(self._heap) > 4 * len(self._slots) + 64:
            self._heap = [(s.hits, s.tick, k) for k, s in self._slots.items()]
            heapq.heapify(self._heap)

    def _pop_victim(self) -> tuple[str, ChunkKV] | None:
        while self._heap:
            hits, tick, key = heapq.heappop(self._heap)
            slot = self._slots.get(key)
            if slot is None or slot.tick != tick or slot.hits != hits or slot.pinned:
                continue  # stale heap item; a pinned slot is pushed again on unpin
            del self._slots[key]
            self._nbytes -= slot.entry.nbytes
            self.evictions += 1
            return key, slot.entry
        return None


@dataclass
class StoreStats:
    """Counters since the store was created."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0


class ChunkStore:
    """Chunk K/V store: a RAM tier of ``max_bytes`` plus optional lower tiers (disk, remote).

    Thread-safe. ``get`` searches tiers in order and promotes a lower-tier hit to RAM; ``put`` writes to RAM
    and demotes what RAM evicts to the next tier. Entries are kept on ``device`` (CPU by default).
    """

    def __init__(
        self,
        max_bytes: int = 2 << 30,
        *,
        lower_tiers: list[StorageTier] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.ram = RamTier(max_bytes)
        self.lower_tiers: list[StorageTier] = list(lower_tiers or [])
        self.device = torch.device(device)
        self._stats = StoreStats()
        self._tier_hits: dict[str, int] = {tier.name: 0 for tier in self.tiers}
        self._lock = threading.RLock()

    @property
    def tiers(self) -> list[StorageTier]:
        return [self.ram, *self.lower_tiers]

    def get(self, key: str) -> ChunkKV | None:
        """The entry under ``key`` from the fastest tier holding it, or None (counted as a miss)."""
        with self._lock:
            for tier in self.tiers:
                entry = tier.get(key)
                if entry is None:
                    continue
                self._stats.hits += 1
                self._tier_hits[tier.name] += 1
                if tier is not self.ram:
                    self._demote(self.ram.put(key, entry))
                return entry
            self._stats.misses += 1
            return None

    def contains(self, key: str) -> bool:
        with self._lock:
            return any(tier.contains(key) for tier in self.tiers)

    def put(self, key: str, entry: ChunkKV) -> None:
        """Store ``entry`` under ``key``; a key already present is only touched (entries are immutable)."""
        entry = ChunkKV(entry.keys.to(self.device), entry.values.to(self.device))
        with self._lock:
            self._stats.puts += 1
            self._demote(self.ram.put(key, entry))
            if not self.ram.contains(key):
                self._stats.rejected += 1

    def pin(self, key: str) -> bool:
        """Keep ``key`` resident in RAM (loading it from a lower tier if needed); False if unknown."""
        with self._lock:
            if not self.ram.contains(key) and self.get(key) is None:
                return False
            return self.ram.pin(key)

    def unpin(self, key: str) -> None:
        self.ram.unpin(key)

    def clear(self) -> None:
        """Drop every entry of every tier."""
        with self._lock:
            for tier in self.tiers:
                tier.clear()

    def stats(self) -> dict[str, int]:
        """hits, misses, puts, rejected, evictions, chunks (in RAM), and ``<tier>_bytes`` / ``<tier>_hits``."""
        with self._lock:
            out = {
                "hits": self._stats.hits,
                "misses": self._stats.misses,
                "puts": self._stats.puts,
                "rejected": self._stats.rejected,
                "evictions": self.ram.evictions,
                "chunks": len(self.ram),
            }
            for tier in self.tiers:
                out[f"{tier.name}_bytes"] = tier.nbytes
                out[f"{tier.name}_hits"] = self._tier_hits[tier.name]
            return out

    def _demote(self, evicted: list[tuple[str, ChunkKV]]) -> None:
        """Cascade entries evicted from one tier into the next; what the last tier evicts is dropped."""
        for tier in self.lower_tiers:
            if not evicted:
                return
            evicted = [spilled for key, entry in evicted for spilled in tier.put(key, entry)]
        for key, _ in evicted:
            logger.debug("chunk %s left the store", key[:12])
