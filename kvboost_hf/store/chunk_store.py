"""Stage 3: the chunk store, an ordered list of tiers behind one small interface.

:class:`ChunkStore` is what the cache talks to: ``get``/``get_many``/``put``/``contains``/``pin``. Its first tier
is RAM (:class:`~kvboost_hf.store.ram.RamTier`, ``max_bytes``); the tiers below it (disk and Redis from a
:class:`~kvboost_hf.store.config.StoreConfig`, plus any given as ``tiers``) follow one policy, whatever their
class (:class:`~kvboost_hf.store.base.StorageTier` says how a tier declares what it is):

* every ``put`` is written through to every lower tier in the background (a request never waits on a lower
  tier), so a restart, another process on the same directory or another replica finds it;
* a hit in a lower tier is promoted into every faster tier; RAM's evictions go to the local lower tiers that
  miss them (a write dropped from a full queue is retried there);
* a tier that lost its entries (a Redis restarted empty) gets the RAM entries and tail notes again.

No request fails or waits because of a lower tier: their failures are counted and logged, and lookups go on
from the tiers that work; ``stats()`` never raises (a tier whose counters fail is reported degraded). With
``kv_cache_bits`` 8 or 4 every tier holds the KIVI-quantized form (RAM included: that is the saving); ``get``
dequantises to the dtype the entry was put with. The live cache never sees quantized tensors; a chunk that
cannot be quantized (inf/NaN, values beyond float16 statistics) is not stored (counted in ``skipped``).

A ``put`` of CUDA K/V into page-locked RAM never waits on the device: the chunk *lands*
(:mod:`~kvboost_hf.store.landing`: one pinned block, an asynchronous copy, an event after it). A landing chunk is
contained but in no tier; the first store operation (``put``, ``get``, ``contains``, ``stats``) that finds its copy
complete puts it in RAM and writes it through as a synchronous ``put`` would, a ``get`` of it waits for its copy,
``flush``/``close`` wait for every copy and ``clear`` drops them. No tier sees the host bytes before they landed.
Quantized puts (``kv_cache_bits`` 8 or 4) stay synchronous: quantizing reads statistics back from the device.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.errors import ArgumentTypeError
from kvboost_hf.store import codec
from kvboost_hf.store.base import CLOSE_TIMEOUT_S, StorageTier, StoredChunk
from kvboost_hf.store.config import StoreConfig
from kvboost_hf.store.landing import Landing, start_landing
from kvboost_hf.store.quantization import QuantizedChunk, quantize_chunk
from kvboost_hf.store.ram import GpuTier, RamTier

if TYPE_CHECKING:  # the typed accessors below; the store itself never tests a tier's class
    from kvboost_hf.store.disk import DiskTier
    from kvboost_hf.store.remote import RemoteTier

__all__ = ["ChunkKV", "ChunkStore", "RamTier", "StorageTier", "StoreConfig", "StoredChunk"]

logger = logging.getLogger(__name__)


@dataclass
class StoreStats:
    """Counters since the store was created."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0
    skipped: int = 0
    stats_errors: int = 0


MAX_TAIL_PARENTS = 65536
_REPORTED = {  # counters reported (0 when the tier is absent) so that dashboards see a fixed set of keys
    "gpu": ("bytes", "hits"),
    "ram": ("bytes", "hits"),
    "disk": ("bytes", "hits", "chunks", "evictions", "errors", "dropped", "queued", "disabled", "rechecks", "lost"),
    "remote": ("bytes", "hits", "errors", "dropped", "republished"),
}


class ChunkStore:
    """Chunk K/V store: RAM, then lower tiers fastest first (see the module docstring).

    Args:
        config: the store's settings (:class:`StoreConfig`; None: its defaults, a 2 GiB RAM tier only).
        tiers: more tiers below those the settings enable, fastest first.

    Thread-safe. Never returns K/V that failed verification (a damaged disk or Redis record is a miss), nor a
    landing chunk's host bytes before its copy completed.
    After :meth:`close`, lookups see RAM only.
    """

    def __init__(self, config: StoreConfig | None = None, *, tiers: Sequence[StorageTier] = ()) -> None:
        config = config if config is not None else StoreConfig()
        if not isinstance(config, StoreConfig):
            kind = type(config).__name__
            raise ArgumentTypeError(
                f"ChunkStore takes a StoreConfig, got {kind}: write ChunkStore(StoreConfig({config!r}))"
            )
        self.config = config
        self.kv_cache_bits = config.kv_cache_bits
        self.kv_group_size = config.kv_group_size
        self.device = torch.device(config.device)
        self.pin_memory = config.pins_memory
        self.ram = RamTier(config.max_bytes)
        gpu_device = config.gpu_tier_device
        self.gpu = GpuTier(config.gpu_max_bytes or 0, gpu_device) if gpu_device is not None else None
        self._lower: list[StorageTier] = [*config.build_tiers(), *tiers]
        self._stats = StoreStats()
        self._tier_hits = {tier.name: 0 for tier in self.all_tiers}
        self._degraded: set[str] = set()
        self._tail_lengths: OrderedDict[str, set[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._landing: dict[str, Landing] = {}  # put order; read and changed under _landing_lock only
        self._landing_lock = threading.Lock()  # held while an entry lands: it is always landing or in the tiers
        self._closed = False
        self._skip_logged = False
        for tier in self._lower:
            tier.on_reconnect = lambda tier=tier: self._republish(tier)
        if self._lower:
            atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_config(cls, config: StoreConfig, tiers: Sequence[StorageTier] = ()) -> ChunkStore:
        """``ChunkStore(config, tiers=tiers)``, the spelling of earlier versions."""
        return cls(config, tiers=tiers)

    @property
    def all_tiers(self) -> list[StorageTier]:
        """Every tier, fastest first, open or not."""
        return [*self._in_process, *self._lower]

    @property
    def tiers(self) -> list[StorageTier]:
        """Tiers consulted now, fastest first (the GPU tier and RAM only once closed)."""
        return self._in_process if self._closed else self.all_tiers

    @property
    def _in_process(self) -> list[StorageTier]:
        """The tiers in this process's memory: the GPU tier (if any), then RAM."""
        return [self.ram] if self.gpu is None else [self.gpu, self.ram]

    def _below_ram(self) -> list[StorageTier]:
        """The open tiers below RAM (disk, Redis, given tiers), fastest first."""
        return [] if self._closed else self._lower

    def tier(self, name: str) -> StorageTier | None:
        """The tier called ``name`` (``"ram"``, ``"disk"``, ``"remote"``...), or None."""
        return next((tier for tier in self.all_tiers if tier.name == name), None)

    @property
    def disk(self) -> DiskTier | None:
        """The tier named ``"disk"`` (a typed accessor for callers and tests)."""
        return self.tier("disk")  # type: ignore[return-value]

    @property
    def remote(self) -> RemoteTier | None:
        """The tier named ``"remote"`` (a typed accessor for callers and tests)."""
        return self.tier("remote")  # type: ignore[return-value]

    def get(self, key: str, device: torch.device | None = None) -> ChunkKV | None:
        """The entry under ``key`` from the fastest tier holding it, dequantised, or None (counted as a miss).
        ``device``: where a quantized entry is dequantized (its compressed bytes copied there first); None: where
        its tier holds it. Unquantized entries are returned where they are held (the caller copies them once)."""
        return self.get_many([key], device)[0]

    def get_many(self, keys: Sequence[str], device: torch.device | None = None) -> list[ChunkKV | None]:
        """:meth:`get` for several keys: each tier is asked once for the keys still missing (one Redis round
        trip for the lot). An entry found in a lower tier is promoted into every faster one."""
        if self._landing:  # a chunk read right after its put: its copy is waited for unless the GPU tier serves it
            self._land(waiting=frozenset(key for key in keys if self.gpu is None or not self.gpu.contains(key)))
        found: list[StoredChunk | None] = [None] * len(keys)
        tiers = self.tiers
        for level, tier in enumerate(tiers):
            missing = [i for i, stored in enumerate(found) if stored is None]
            if not missing:
                break
            for i, stored in zip(missing, tier.get_many([keys[i] for i in missing]), strict=True):
                if stored is None:
                    continue
                with self._lock:
                    self._tier_hits[tier.name] += 1
                found[i] = self._promote(keys[i], stored, tiers[:level]) if level else stored
        hits = sum(stored is not None for stored in found)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
        return [None if stored is None else _materialize(stored, device) for stored in found]

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is landing or in some tier (each tier asked once for the keys not found above it)."""
        self._land()
        with self._landing_lock:
            out = [key in self._landing for key in keys]
        for tier in self.tiers:
            missing = [i for i, present in enumerate(out) if not present]
            if not missing:
                break
            for i, present in zip(missing, tier.contains_many([keys[i] for i in missing]), strict=True):
                out[i] = present
        return out

    def put(self, key: str, entry: ChunkKV) -> None:
        """Store ``entry`` under ``key`` (quantized if configured) in RAM, and queue it for every lower tier;
        a key already in RAM is only touched. A chunk that cannot be quantized, or whose dtypes no tier can encode
        (:func:`~kvboost_hf.store.codec.storable`: it would fail the disk or Redis batch it joined), is skipped
        (counted in ``skipped``): storing is optional, serving is not. CUDA K/V bound for page-locked RAM land
        (see the module docstring): the GPU tier gets them now, RAM and the lower tiers once their copy completed."""
        stored: StoredChunk
        self._land()
        if not codec.storable(entry):
            self._skip(key, f"unsupported K/V dtypes {entry.keys.dtype}, {entry.values.dtype}")
            return
        if self.kv_cache_bits == 16 and self._lands(key, entry, write_through=True):
            with self._lock:
                self._stats.puts += 1
            if self.gpu is not None:
                self._put_gpu(key, entry.to(self.gpu.device))
            return
        if self.kv_cache_bits == 16:
            stored = self._place(entry)
        else:
            try:
                stored = quantize_chunk(entry.keys, entry.values, self.kv_cache_bits, self.kv_group_size)
            except ValueError as exc:  # inf/NaN or beyond float16 statistics
                self._skip(key, str(exc))
                return
            stored = self._place(stored)
        with self._lock:
            self._stats.puts += 1
        self._settle(key, stored, entry if self.kv_cache_bits == 16 else stored)

    def _settle(self, key: str, stored: StoredChunk, gpu_form: StoredChunk | None) -> None:
        """The tiers' part of a put of ``stored`` (RAM's form): written through to the local lower tiers unless RAM
        holds ``key``, ``gpu_form`` into the GPU tier (None: it is there already), into RAM (``rejected`` when no
        tier kept it), then queued for the remote tiers."""
        lower = self._below_ram() if not self.ram.contains(key) else []
        for tier in lower:
            if tier.local:
                _write_unless_held(tier, key, stored)
        if self.gpu is not None and gpu_form is not None:
            self._put_gpu(key, gpu_form.to(self.gpu.device))
        self._demote(self.ram.put(key, stored))
        if not self.ram.contains(key) and not any(tier.contains(key) for tier in self._local_lower()):
            with self._lock:
                self._stats.rejected += 1
        for tier in lower:
            if not tier.local:
                tier.put(key, stored)

    def _skip(self, key: str, reason: str) -> None:
        """Count a chunk not stored (``skipped``); the first is a warning, later ones debug lines."""
        with self._lock:
            self._stats.skipped += 1
            first, self._skip_logged = not self._skip_logged, True
        logger.log(logging.WARNING if first else logging.DEBUG, "chunk %s not stored: %s", key[:12], reason)

    def note_tail(self, parent_key: str | None, num_tokens: int) -> None:
        """Remember that a partial chunk of ``num_tokens`` tokens was stored after ``parent_key`` (None: at the
        start), so a later prompt can find it without knowing its length. Kept in process memory (at most
        ``MAX_TAIL_PARENTS`` parents, least recently noted forgotten first) and written to the lower tiers, so
        that a restart or another replica finds it too; the entry itself lives in the tiers."""
        parent = parent_key or ""
        with self._lock:
            lengths = self._tail_lengths.pop(parent, set())
            lengths.add(num_tokens)
            self._tail_lengths[parent] = lengths
            while len(self._tail_lengths) > MAX_TAIL_PARENTS:
                self._tail_lengths.popitem(last=False)
            noted = frozenset(lengths)
        for tier in self._below_ram():
            tier.note_tail(parent, noted)

    def tail_lengths(self, parent_key: str | None) -> list[int]:
        """Lengths (tokens) of the partial chunks noted after ``parent_key`` in any tier, longest first."""
        parent = parent_key or ""
        with self._lock:
            lengths = set(self._tail_lengths.get(parent, ()))
        for tier in self._below_ram():
            lengths |= tier.tail_lengths(parent)
        return sorted(lengths, reverse=True)

    def pin(self, key: str) -> bool:
        """Keep ``key`` resident in RAM (landing it, or loading it from a lower tier, if needed); False if unknown."""
        self._land(waiting=frozenset((key,)))
        if not self.ram.contains(key) and self.get(key) is None:
            return False
        return self.ram.pin(key)

    def unpin(self, key: str) -> None:
        self.ram.unpin(key)

    def clear(self, remote: bool = False) -> None:
        """Drop every entry of the tiers this process owns or shares only by directory (RAM, disk: other
        processes on that directory see it), and the landing ones (once their copies completed). Tiers shared over
        the network (Redis records under this store's prefix, other replicas' included) are cleared only with
        ``remote=True``."""
        with self._landing_lock:
            for landing in self._landing.values():
                landing.done.synchronize()
            self._landing.clear()
        for tier in self.tiers:
            if remote or not tier.shared:
                tier.clear()
        with self._lock:
            self._tail_lengths.clear()

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Land every landing entry (waiting for its copy), then wait (up to ``timeout_s`` per tier) until queued
        writes to the lower tiers are done; RAM entries missing from a local lower tier (their write was dropped
        from a full queue) are queued again first."""
        self._land(waiting=None)
        if self._closed:
            return
        for tier in self._lower:
            if tier.local:
                for key, stored in self.ram.items():
                    _write_unless_held(tier, key, stored)
            tier.flush(timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """:meth:`flush`, then close the lower tiers, each tier within ``timeout_s`` in all. Idempotent;
        afterwards lookups see RAM only and puts stay in RAM."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for tier in self._lower:
            tier.close(max(deadline - time.monotonic(), 0.0))

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters; never raises. hits, misses, puts, rejected, skipped (not quantizable), evictions and
        chunks (RAM), ``landing`` and ``landing_bytes`` (chunks whose copy into RAM is in flight, and their bytes),
        ``corrupt`` (records refused by every tier), ``<tier>_hits`` and each tier's own counters
        as ``<tier>_<counter>`` (:meth:`StorageTier.stats`: ``disk_queued``, ``remote_republished``...; the
        usual ram, disk and remote counters read 0 when the tier is absent). A tier whose counters cannot be
        read (damaged storage) reports ``<tier>_degraded`` 1 and counts in ``stats_errors``."""
        self._land()
        with self._landing_lock:
            landing = [landing.entry.nbytes for landing in self._landing.values()]
        out: dict[str, int] = {f"{name}_{counter}": 0 for name, counters in _REPORTED.items() for counter in counters}
        out |= {"landing": len(landing), "landing_bytes": sum(landing)}
        corrupt = 0
        for tier in self.all_tiers:
            try:
                counters = tier.stats()
            except Exception as exc:  # stats feed /metrics and /v1/warm: a damaged tier must not fail them
                self._stats_failed(tier.name, exc)
                out[f"{tier.name}_degraded"] = 1
                continue
            corrupt += counters.pop("corrupt", 0)
            out |= {f"{tier.name}_{counter}": value for counter, value in counters.items()}
        with self._lock:
            out |= {f"{name}_hits": hits for name, hits in self._tier_hits.items()}
            out |= dataclasses.asdict(self._stats)
        out |= {"evictions": out.get("ram_evictions", 0), "chunks": out.get("ram_chunks", 0), "corrupt": corrupt}
        return out

    def _stats_failed(self, name: str, exc: Exception) -> None:
        with self._lock:
            self._stats.stats_errors += 1
            first = name not in self._degraded
            self._degraded.add(name)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(
            level, "%s tier: its counters cannot be read (%s: %s); reported degraded", name, type(exc).__name__, exc
        )

    def _local_lower(self) -> list[StorageTier]:
        return [tier for tier in self._below_ram() if tier.local]

    def _place(self, stored: StoredChunk) -> StoredChunk:
        """``stored`` in the form RAM keeps: on ``device``, page-locked when ``pin_memory``."""
        if self.pin_memory:
            return stored.pinned()
        return stored.to(self.device)

    def _promote(self, key: str, stored: StoredChunk, faster: list[StorageTier]) -> StoredChunk:
        """Put a hit of a lower tier into every tier of ``faster`` (fastest first); returns the form the fastest
        holds. A RAM hit goes to the GPU tier by an asynchronous copy (ordered before any use on the stream)."""
        if self.ram in faster:  # a hit below RAM: into RAM's form first
            stored = self._place(stored)
        for tier in reversed(faster):
            if tier is self.ram:
                self._demote(self.ram.put(key, stored))
            elif self.gpu is not None and tier is self.gpu:
                stored = stored.to(self.gpu.device, non_blocking=True)
                self._put_gpu(key, stored)
            else:
                tier.put(key, stored)
        return stored

    def _put_gpu(self, key: str, stored: StoredChunk) -> None:
        """Into the GPU tier; what it evicts or refuses goes to RAM when RAM does not hold it already (CUDA K/V
        bound for page-locked RAM land there: :meth:`_lands`)."""
        assert self.gpu is not None
        for evicted_key, evicted in self.gpu.put(key, stored):
            if not self.ram.contains(evicted_key) and not self._lands(evicted_key, evicted, write_through=False):
                self._demote(self.ram.put(evicted_key, self._place(evicted)))

    def _lands(self, key: str, stored: StoredChunk, write_through: bool) -> bool:
        """Whether ``key`` is landing: already, or now, ``stored`` being CUDA K/V bound for page-locked RAM (see
        :class:`~kvboost_hf.store.landing.Landing` for ``write_through``). False: the caller stores it synchronously."""
        if not (self.pin_memory and isinstance(stored, ChunkKV)):
            return False
        with self._landing_lock:
            if key in self._landing:
                return True
            landing = start_landing(stored, write_through)
            if landing is not None:
                self._landing[key] = landing
            return landing is not None

    def _land(self, waiting: frozenset[str] | None = frozenset()) -> None:
        """Move the landing entries whose copy completed into the tiers (:meth:`_settle` for a put, RAM only for a
        GPU tier eviction), in put order; those under ``waiting`` keys (None: all) are waited for first."""
        if not self._landing:  # read without the lock: an entry added meanwhile lands at a later call
            return
        with self._landing_lock:
            for key, landing in list(self._landing.items()):
                if waiting is None or key in waiting:
                    landing.done.synchronize()
                elif not landing.done.query():
                    continue
                del self._landing[key]
                if landing.write_through:
                    self._settle(key, landing.entry, None)
                else:
                    self._demote(self.ram.put(key, landing.entry))

    def _demote(self, evicted: list[tuple[str, StoredChunk]]) -> None:
        """Entries leaving RAM: queued for the local lower tiers that do not hold them (else just dropped)."""
        for tier in self._local_lower():
            for key, stored in evicted:
                _write_unless_held(tier, key, stored)

    def _republish(self, tier: StorageTier) -> None:
        """``tier`` answers again after losing its entries (a Redis restarted empty): write the tail notes this
        process knows and the RAM entries there again."""
        if self._closed:
            return
        with self._lock:
            tails = [(parent, frozenset(lengths)) for parent, lengths in self._tail_lengths.items()]
        for parent, lengths in tails:
            tier.note_tail(parent, lengths)
        tier.republish(self.ram.items())


def _write_unless_held(tier: StorageTier, key: str, stored: StoredChunk) -> None:
    if not tier.contains(key):
        tier.put(key, stored)


def _materialize(stored: StoredChunk, device: torch.device | None) -> ChunkKV:
    if isinstance(stored, QuantizedChunk):
        on_device = stored if device is None else stored.to(device, non_blocking=True)
        return ChunkKV(*on_device.dequantize())
    return stored


def _close_at_exit(ref: weakref.ref[ChunkStore]) -> None:
    store = ref()
    if store is not None:
        store.close(timeout_s=2.0)
