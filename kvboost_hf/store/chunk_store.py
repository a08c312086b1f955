"""Stage 3: the chunk store, a stack of tiers behind one small interface.

:class:`ChunkStore` is what the cache talks to: ``get``/``put``/``contains``/``pin``. It owns

* a RAM tier (:class:`RamTier`, ``max_bytes``), always;
* a disk tier (:class:`~kvboost_hf.store.disk.DiskTier`) with ``disk_cache_dir``: RAM evictions are demoted
  into it, its hits are promoted back into RAM, and :meth:`ChunkStore.close` (also run at interpreter exit)
  writes the RAM entries into it so that a restart keeps them;
* a remote tier (:class:`~kvboost_hf.store.remote.RemoteTier`) with ``remote_url``: every ``put`` is also
  written there in the background (write-through, so other replicas see new chunks at once); its hits are
  promoted into RAM.

With ``kv_cache_bits`` 8 or 4 every tier holds the KIVI-quantized form (RAM included: that is the saving);
``get`` dequantises to the dtype the entry was put with. The live cache never sees quantized tensors.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.base import FrequencyRecencyOrder, StorageTier, StoredChunk
from kvboost_hf.store.disk import DEFAULT_MAX_BYTES as DEFAULT_DISK_MAX_BYTES
from kvboost_hf.store.disk import DiskTier
from kvboost_hf.store.quantization import DEFAULT_GROUP_SIZE, SUPPORTED_BITS, QuantizedChunk, quantize_chunk
from kvboost_hf.store.remote import DEFAULT_PREFIX, RemoteTier

__all__ = ["ChunkKV", "ChunkStore", "RamTier", "StorageTier", "StoredChunk"]

logger = logging.getLogger(__name__)


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
            if entry.nbytes > self.max_bytes:
                return [(key, entry)]  # larger than the whole tier: refused without evicting anything
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

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: str) -> StoredChunk:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes
        return entry


@dataclass
class StoreStats:
    """Counters since the store was created."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0


MAX_TAIL_PARENTS = 65536


class ChunkStore:
    """Chunk K/V store: RAM (``max_bytes``), then optional disk and Redis tiers (see the module docstring).

    Args:
        max_bytes: RAM budget in bytes (of the stored form: quantized bytes with ``kv_cache_bits`` < 16).
        kv_cache_bits: 16 keeps K/V as computed; 8 or 4 stores KIVI-quantized K/V in every tier.
        kv_group_size: quantization group in tokens (keys) and channels (values).
        disk_cache_dir: enables the disk tier in that directory (one process at a time).
        disk_max_bytes: size of the disk tier's slot file in bytes.
        remote_url: enables the Redis tier (``redis://`` or ``rediss://``, credentials in the URL).
        remote_prefix: prefix of every Redis key this store reads and writes.
        device: where RAM entries live and where ``get`` returns them.

    Thread-safe. Never returns K/V that failed verification: a damaged disk or Redis record is a miss.
    """

    def __init__(
        self,
        max_bytes: int = 2 << 30,
        *,
        kv_cache_bits: int = 16,
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        disk_cache_dir: str | os.PathLike[str] | None = None,
        disk_max_bytes: int = DEFAULT_DISK_MAX_BYTES,
        remote_url: str | None = None,
        remote_prefix: str = DEFAULT_PREFIX,
        device: torch.device | str = "cpu",
    ) -> None:
        if kv_cache_bits != 16 and kv_cache_bits not in SUPPORTED_BITS:
            raise ValueError(f"kv_cache_bits must be 16, 8 or 4, got {kv_cache_bits}")
        if kv_group_size < 1:
            raise ValueError(f"kv_group_size must be >= 1 (tokens or channels), got {kv_group_size}")
        self.kv_cache_bits = kv_cache_bits
        self.kv_group_size = kv_group_size
        self.device = torch.device(device)
        self.ram = RamTier(max_bytes)
        self.disk = DiskTier(disk_cache_dir, disk_max_bytes) if disk_cache_dir is not None else None
        self.remote = RemoteTier(remote_url, prefix=remote_prefix) if remote_url else None
        self._stats = StoreStats()
        self._tier_hits = {"ram": 0, "disk": 0, "remote": 0}
        self._tail_lengths: OrderedDict[str, set[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        if self.disk is not None or self.remote is not None:
            atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def tiers(self) -> list[StorageTier]:
        """Configured tiers, fastest first."""
        return [tier for tier in (self.ram, self.disk, self.remote) if tier is not None]

    def get(self, key: str) -> ChunkKV | None:
        """The entry under ``key`` from the fastest tier holding it, dequantised, or None (counted as a miss)."""
        for tier in self.tiers:
            stored = tier.get(key)
            if stored is None:
                continue
            with self._lock:
                self._stats.hits += 1
                self._tier_hits[tier.name] += 1
            if tier is not self.ram:
                stored = stored.to(self.device)
                self._demote(self.ram.put(key, stored))
            return _materialize(stored)
        with self._lock:
            self._stats.misses += 1
        return None

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def put(self, key: str, entry: ChunkKV) -> None:
        """Store ``entry`` under ``key`` (quantized if configured); a key already present is only touched."""
        stored: StoredChunk
        if self.kv_cache_bits == 16:
            stored = entry.to(self.device)
        else:
            stored = quantize_chunk(entry.keys, entry.values, self.kv_cache_bits, self.kv_group_size).to(self.device)
        with self._lock:
            self._stats.puts += 1
        self._demote(self.ram.put(key, stored))
        if not self.ram.contains(key) and (self.disk is None or not self.disk.contains(key)):
            with self._lock:
                self._stats.rejected += 1
        if self.remote is not None:
            self.remote.put(key, stored)

    def note_tail(self, parent_key: str | None, num_tokens: int) -> None:
        """Remember that a partial chunk of ``num_tokens`` tokens was stored after ``parent_key`` (None: at the
        start), so a later prompt can find it without knowing its length. An in-process index of at most
        ``MAX_TAIL_PARENTS`` parents (least recently noted forgotten first); the entry itself lives in the tiers."""
        with self._lock:
            lengths = self._tail_lengths.pop(parent_key or "", set())
            lengths.add(num_tokens)
            self._tail_lengths[parent_key or ""] = lengths
            while len(self._tail_lengths) > MAX_TAIL_PARENTS:
                self._tail_lengths.popitem(last=False)

    def tail_lengths(self, parent_key: str | None) -> list[int]:
        """Lengths (tokens) of the partial chunks noted after ``parent_key``, longest first."""
        with self._lock:
            return sorted(self._tail_lengths.get(parent_key or "", ()), reverse=True)

    def pin(self, key: str) -> bool:
        """Keep ``key`` resident in RAM (loading it from a lower tier if needed); False if unknown."""
        if not self.ram.contains(key) and self.get(key) is None:
            return False
        return self.ram.pin(key)

    def unpin(self, key: str) -> None:
        self.ram.unpin(key)

    def clear(self) -> None:
        """Drop every entry of every tier, including the Redis records under this store's prefix."""
        for tier in self.tiers:
            tier.clear()
        with self._lock:
            self._tail_lengths.clear()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Write RAM entries into the disk tier and its index, and wait (up to ``timeout_s``) for Redis writes."""
        if self.disk is not None:
            for key, stored in self.ram.items():
                self.disk.put(key, stored)
            self.disk.flush()
        if self.remote is not None:
            self.remote.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """:meth:`flush`, then release the disk tier's files and stop the Redis writer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout_s)
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close(timeout_s)

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, puts, rejected, evictions (RAM), chunks (in RAM), ``{ram,disk,remote}_bytes``,
        ``{ram,disk,remote}_hits``, ``disk_evictions``, ``corrupt`` (disk + Redis records refused),
        ``remote_errors``, ``remote_dropped`` (writes not done). Tiers not configured report 0."""
        with self._lock:
            out = {
                "hits": self._stats.hits,
                "misses": self._stats.misses,
                "puts": self._stats.puts,
                "rejected": self._stats.rejected,
                "evictions": self.ram.evictions,
                "chunks": len(self.ram),
                **{f"{name}_hits": hits for name, hits in self._tier_hits.items()},
            }
        disk, remote = self.disk, self.remote  # tiers define __len__: test them against None, not for truth
        out |= {
            "ram_bytes": self.ram.nbytes,
            "disk_bytes": disk.nbytes if disk is not None else 0,
            "remote_bytes": remote.nbytes if remote is not None else 0,
            "disk_chunks": len(disk) if disk is not None else 0,
            "disk_evictions": disk.evictions if disk is not None else 0,
            "corrupt": (disk.corrupt if disk is not None else 0) + (remote.corrupt if remote is not None else 0),
            "remote_errors": remote.errors if remote is not None else 0,
            "remote_dropped": remote.dropped if remote is not None else 0,
        }
        return out

    def _demote(self, evicted: list[tuple[str, StoredChunk]]) -> None:
        """Entries leaving RAM go to the disk tier when there is one; otherwise they leave the store."""
        for key, stored in evicted:
            if self.disk is not None:
                self.disk.put(key, stored)
            else:
                logger.debug("chunk %s left the store", key[:12])


def _materialize(stored: StoredChunk) -> ChunkKV:
    if isinstance(stored, QuantizedChunk):
        return ChunkKV(*stored.dequantize())
    return stored


def _close_at_exit(ref: weakref.ref[ChunkStore]) -> None:
    store = ref()
    if store is not None:
        store.close(timeout_s=2.0)
