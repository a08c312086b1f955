"""Stage 3: the chunk store, a stack of tiers behind one small interface.

:class:`ChunkStore` is what the cache talks to: ``get``/``get_many``/``put``/``contains``/``pin``. It owns

* a RAM tier (:class:`RamTier`, ``max_bytes``), always;
* a disk tier (:class:`~kvboost_hf.store.disk.DiskTier`) with ``disk_cache_dir``: every ``put`` is written
  through to it in the background (a request never waits on the disk), so a restart, or another process on the
  same directory, finds every entry whose write was not still queued; RAM evictions of entries already on disk
  just drop them; disk hits are promoted back into RAM;
* a remote tier (:class:`~kvboost_hf.store.remote.RemoteTier`) with ``remote_url``: every ``put`` is also
  written there in the background (other replicas see new chunks at once); its hits are promoted into RAM and
  the disk; when Redis comes back after an outage, the RAM entries are published again.

No request fails or waits because of a lower tier: their failures are counted and logged, and lookups go on
from the tiers that work. With ``kv_cache_bits`` 8 or 4 every tier holds the KIVI-quantized form (RAM included:
that is the saving); ``get`` dequantises to the dtype the entry was put with. The live cache never sees
quantized tensors; a chunk that cannot be quantized (inf/NaN, values beyond float16 statistics) is not stored
(counted in ``skipped``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
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
    skipped: int = 0


MAX_TAIL_PARENTS = 65536


class ChunkStore:
    """Chunk K/V store: RAM (``max_bytes``), then optional disk and Redis tiers (see the module docstring).

    Args:
        max_bytes: RAM budget in bytes (of the stored form: quantized bytes with ``kv_cache_bits`` < 16).
        kv_cache_bits: 16 keeps K/V as computed; 8 or 4 stores KIVI-quantized K/V in every tier.
        kv_group_size: quantization group in tokens (keys) and channels (values).
        disk_cache_dir: enables the disk tier in that directory (shared safely by several processes).
        disk_max_bytes: bytes of records the disk tier may hold (the file grows as needed, never reserved).
        remote_url: enables the Redis tier (``redis://`` or ``rediss://``, credentials in the URL).
        remote_prefix: prefix of every Redis key this store reads and writes.
        remote_ttl_s: expiry of every Redis key written (None: Redis's eviction only).
        remote_read_timeout_s: longest a Redis lookup may wait for a reply before it is a miss.
        remote_hmac_key: secret sealing Redis records with HMAC-SHA256; records without a valid seal are refused.
        device: where RAM entries live and where ``get`` returns them.

    Thread-safe. Never returns K/V that failed verification: a damaged disk or Redis record is a miss.
    After :meth:`close`, lookups see RAM only.
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
        remote_ttl_s: float | None = None,
        remote_read_timeout_s: float = 0.25,
        remote_hmac_key: bytes | str | None = None,
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
        self.remote = (
            RemoteTier(
                remote_url,
                prefix=remote_prefix,
                ttl_s=remote_ttl_s,
                read_timeout_s=remote_read_timeout_s,
                hmac_key=remote_hmac_key,
                on_reconnect=self._republish,
            )
            if remote_url
            else None
        )
        self._stats = StoreStats()
        self._tier_hits = {"ram": 0, "disk": 0, "remote": 0}
        self._tail_lengths: OrderedDict[str, set[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._skip_logged = False
        if self.disk is not None or self.remote is not None:
            atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def tiers(self) -> list[StorageTier]:
        """Tiers consulted now, fastest first (RAM only once closed)."""
        if self._closed:
            return [self.ram]
        return [tier for tier in (self.ram, self.disk, self.remote) if tier is not None]

    def get(self, key: str) -> ChunkKV | None:
        """The entry under ``key`` from the fastest tier holding it, dequantised, or None (counted as a miss)."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        """:meth:`get` for several keys: each tier is asked once for all keys it may hold (one Redis round
        trip for the lot). Entries found below RAM are promoted into RAM (and into the disk from Redis)."""
        found: list[StoredChunk | None] = [None] * len(keys)
        for tier in self.tiers:
            missing = [i for i, stored in enumerate(found) if stored is None]
            if not missing:
                break
            if isinstance(tier, RemoteTier):
                answers = tier.get_many([keys[i] for i in missing])
            else:
                answers = [tier.get(keys[i]) for i in missing]
            for i, stored in zip(missing, answers, strict=True):
                if stored is None:
                    continue
                with self._lock:
                    self._tier_hits[tier.name] += 1
                if tier is not self.ram:
                    stored = stored.to(self.device)
                    if tier is self.remote and self.disk is not None:
                        self.disk.put(keys[i], stored)
                    self._demote(self.ram.put(keys[i], stored))
                found[i] = stored
        hits = sum(stored is not None for stored in found)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
        return [None if stored is None else _materialize(stored) for stored in found]

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in some tier (RAM and disk first; one Redis round trip for the rest)."""
        out = [
            self.ram.contains(key) or (self.disk is not None and not self._closed and self.disk.contains(key))
            for key in keys
        ]
        missing = [i for i, present in enumerate(out) if not present]
        if missing and self.remote is not None and not self._closed:
            for i, present in zip(missing, self.remote.contains_many([keys[i] for i in missing]), strict=True):
                out[i] = present
        return out

    def put(self, key: str, entry: ChunkKV) -> None:
        """Store ``entry`` under ``key`` (quantized if configured) in RAM, and queue it for the disk and Redis;
        a key already in RAM is only touched. A chunk that cannot be quantized is skipped (counted)."""
        stored: StoredChunk
        if self.kv_cache_bits == 16:
            stored = entry.to(self.device)
        else:
            try:
                stored = quantize_chunk(entry.keys, entry.values, self.kv_cache_bits, self.kv_group_size)
            except ValueError as exc:  # inf/NaN or beyond float16 statistics: storing is optional, serving is not
                with self._lock:
                    self._stats.skipped += 1
                    first, self._skip_logged = not self._skip_logged, True
                logger.log(logging.WARNING if first else logging.DEBUG, "chunk %s not stored: %s", key[:12], exc)
                return
            stored = stored.to(self.device)
        with self._lock:
            self._stats.puts += 1
        lower = not self._closed and not self.ram.contains(key)
        if lower and self.disk is not None and not self.disk.contains(key):
            self.disk.put(key, stored)
        self._demote(self.ram.put(key, stored))
        if not self.ram.contains(key) and (self.disk is None or self._closed or not self.disk.contains(key)):
            with self._lock:
                self._stats.rejected += 1
        if lower and self.remote is not None:
            self.remote.put(key, stored)

    def note_tail(self, parent_key: str | None, num_tokens: int) -> None:
        """Remember that a partial chunk of ``num_tokens`` tokens was stored after ``parent_key`` (None: at the
        start), so a later prompt can find it without knowing its length. Kept in process memory (at most
        ``MAX_TAIL_PARENTS`` parents, least recently noted forgotten first) and written to the disk and Redis
        tiers, so that a restart or another replica finds it too; the entry itself lives in the tiers."""
        parent = parent_key or ""
        with self._lock:
            lengths = self._tail_lengths.pop(parent, set())
            lengths.add(num_tokens)
            self._tail_lengths[parent] = lengths
            while len(self._tail_lengths) > MAX_TAIL_PARENTS:
                self._tail_lengths.popitem(last=False)
            noted = frozenset(lengths)
        if not self._closed:
            for tier in (self.disk, self.remote):
                if tier is not None:
                    tier.note_tail(parent, noted)

    def tail_lengths(self, parent_key: str | None) -> list[int]:
        """Lengths (tokens) of the partial chunks noted after ``parent_key`` in any tier, longest first."""
        parent = parent_key or ""
        with self._lock:
            lengths = set(self._tail_lengths.get(parent, ()))
        if not self._closed:
            for tier in (self.disk, self.remote):
                if tier is not None:
                    lengths |= tier.tail_lengths(parent)
        return sorted(lengths, reverse=True)

    def pin(self, key: str) -> bool:
        """Keep ``key`` resident in RAM (loading it from a lower tier if needed); False if unknown."""
        if not self.ram.contains(key) and self.get(key) is None:
            return False
        return self.ram.pin(key)

    def unpin(self, key: str) -> None:
        self.ram.unpin(key)

    def clear(self, remote: bool = False) -> None:
        """Drop every entry of RAM and the disk tier (shared with other processes on that directory). Redis
        records under this store's prefix, other replicas' included, are deleted only with ``remote=True``."""
        for tier in self.tiers:
            if tier is not self.remote or remote:
                tier.clear()
        with self._lock:
            self._tail_lengths.clear()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (up to ``timeout_s`` per tier) until queued disk and Redis writes are done; RAM entries missing
        from the disk (their write was dropped from a full queue) are queued again first."""
        if self._closed:
            return
        if self.disk is not None:
            for key, stored in self.ram.items():
                if not self.disk.contains(key):
                    self.disk.put(key, stored)
            self.disk.flush(timeout_s)
        if self.remote is not None:
            self.remote.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """:meth:`flush`, then close the disk tier and stop the Redis writer. Idempotent; afterwards lookups see
        RAM only and puts stay in RAM."""
        self.flush(timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.disk is not None:
            self.disk.close(timeout_s)
        if self.remote is not None:
            self.remote.close(timeout_s)

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, puts, rejected, skipped (not quantizable), evictions (RAM), chunks (in RAM),
        ``{ram,disk,remote}_bytes``, ``{ram,disk,remote}_hits``, ``disk_chunks``, ``disk_evictions``, ``corrupt``
        (disk + Redis records refused), ``disk_errors``, ``disk_dropped`` and ``remote_dropped`` (writes not
        done), ``disk_queued`` (writes not yet on disk), ``disk_disabled`` (1 once the disk tier gave up),
        ``remote_errors``, ``remote_republished``. Tiers not configured report 0."""
        with self._lock:
            out = {
                "hits": self._stats.hits,
                "misses": self._stats.misses,
                "puts": self._stats.puts,
                "rejected": self._stats.rejected,
                "skipped": self._stats.skipped,
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
            "disk_errors": disk.errors if disk is not None else 0,
            "disk_dropped": disk.dropped if disk is not None else 0,
            "disk_queued": disk.queued if disk is not None else 0,
            "disk_disabled": int(disk is not None and disk.disabled not in (None, "closed")),
            "corrupt": (disk.corrupt if disk is not None else 0) + (remote.corrupt if remote is not None else 0),
            "remote_errors": remote.errors if remote is not None else 0,
            "remote_dropped": remote.dropped if remote is not None else 0,
            "remote_republished": remote.republished if remote is not None else 0,
        }
        return out

    def _demote(self, evicted: list[tuple[str, StoredChunk]]) -> None:
        """Entries leaving RAM: dropped when the disk tier holds them (or there is none), else queued for it."""
        for key, stored in evicted:
            if self.disk is not None and not self._closed and not self.disk.contains(key):
                self.disk.put(key, stored)

    def _republish(self) -> None:
        """Redis answers again after an outage (maybe restarted empty): write the tail notes this process knows
        and the RAM entries there again."""
        if self.remote is not None and not self._closed:
            with self._lock:
                tails = [(parent, frozenset(lengths)) for parent, lengths in self._tail_lengths.items()]
            for parent, lengths in tails:
                self.remote.note_tail(parent, lengths)
            self.remote.republish(self.ram.items())


def _materialize(stored: StoredChunk) -> ChunkKV:
    if isinstance(stored, QuantizedChunk):
        return ChunkKV(*stored.dequantize())
    return stored


def _close_at_exit(ref: weakref.ref[ChunkStore]) -> None:
    store = ref()
    if store is not None:
        store.close(timeout_s=2.0)
