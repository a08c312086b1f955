"""Disk tier: fixed-size slots in one pre-sized file read and written through mmap, and a JSON index.

Files in ``directory``:

* ``slots.bin``: ``num_slots * slot_bytes`` bytes (``num_slots = max_bytes // slot_bytes``), its blocks
  reserved with ``posix_fallocate`` when it is opened. Each entry is one
  :mod:`kvboost_hf.store.codec` record spread over as many slots as it needs (not necessarily consecutive ones);
  an entry larger than the whole file is refused.
* ``index.json``: geometry, and for every entry its slots, record length, hits and recency tick. Written
  atomically (temporary file, fsync, ``os.replace``) after every change of membership, and on :meth:`flush`
  and :meth:`close` (so hits counted since the last write are lost if the process is killed, never entries).
* ``lock``: an exclusive ``flock`` so that one process at a time owns the directory.

Invariants: the file never grows past ``max_bytes``; an entry is returned only if its record's SHA-256 and key
verify (a torn write, flipped bits, a truncated file or an index older than the slots are all detected: the
entry is dropped, counted in ``corrupt``, logged, and the read is a miss). Data is written before the index
that points at it, so a process killed at any moment leaves a directory that reopens consistently.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import json
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from kvboost_hf.store import codec
from kvboost_hf.store.base import FrequencyRecencyOrder, StorageTier, StoredChunk

logger = logging.getLogger(__name__)

INDEX_FORMAT = 1
MAX_DEFAULT_SLOT_BYTES = 256 << 10
DEFAULT_MAX_BYTES = 8 << 30


@dataclass
class _Placement:
    slots: list[int]
    length: int  # record bytes


class DiskTier(StorageTier):
    """Bounded, restart-surviving tier under ``directory`` (see the module docstring for the layout).

    ``max_bytes`` bounds the slot file; ``slot_bytes`` (a multiple of the page size, by default
    :func:`default_slot_bytes`) is the allocation unit and
    is fixed when the directory is created: reopening with other geometry starts an empty store. Eviction is
    frequency-then-recency like the RAM tier; being the last local tier, it drops its victims (``put`` returns
    only a refused entry). ``nbytes`` counts whole slots in use.
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        slot_bytes: int | None = None,
    ) -> None:
        if slot_bytes is None:
            slot_bytes = default_slot_bytes(max_bytes)
        if slot_bytes <= 0 or slot_bytes % mmap.PAGESIZE:
            raise ValueError(f"slot_bytes must be a positive multiple of {mmap.PAGESIZE}, got {slot_bytes}")
        if max_bytes < slot_bytes:
            raise ValueError(f"disk max_bytes ({max_bytes}) must hold at least one slot of {slot_bytes} bytes")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.slot_bytes = slot_bytes
        self.num_slots = max_bytes // slot_bytes
        self.max_bytes = self.num_slots * slot_bytes
        self.corrupt = 0
        self.evictions = 0
        self._lock = threading.RLock()
        self._index_path = self.directory / "index.json"
        self._lock_file = open(self.directory / "lock", "a+b")  # noqa: SIM115 (held for the tier's lifetime)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"disk cache directory {self.directory} is in use by another process") from None
        self._file = open(self.directory / "slots.bin", "a+b")  # noqa: SIM115 (mapped for the tier's lifetime)
        self._allocate()
        self._mm = mmap.mmap(self._file.fileno(), self.max_bytes)
        self._finalizer = weakref.finalize(self, _release, self._mm, self._file, self._lock_file)
        self._entries: dict[str, _Placement] = {}
        self._order = FrequencyRecencyOrder()
        self._free: list[int] = []
        self._dirty = False
        self._load_index()

    # ------------------------------------------------------------------ StorageTier
    def get(self, key: str) -> StoredChunk | None:
        with self._lock:
            placement = self._entries.get(key)
            if placement is None:
                return None
            record = self._read(placement)
        try:
            entry = codec.decode(key, record)
        except codec.CorruptEntryError as exc:
            with self._lock:
                if self._entries.get(key) is placement:
                    self._drop_corrupt(key, str(exc))
            return None
        with self._lock:
            if key in self._order:
                self._order.touch(key, hit=True)
                self._dirty = True
        return entry

    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        with self._lock:
            if key in self._entries:
                self._order.touch(key, hit=False)
                self._dirty = True
                return []
        record = codec.encode(key, entry)  # outside the lock: hashing megabytes must not block readers
        needed = -(-len(record) // self.slot_bytes)
        with self._lock:
            if key in self._entries:
                return []
            if needed > self.num_slots:
                return [(key, entry)]
            while len(self._free) < needed:
                victim = self._order.pop_victim()
                if victim is None:
                    return [(key, entry)]
                self._release_slots(self._entries.pop(victim))
                self.evictions += 1
            slots = [heapq.heappop(self._free) for _ in range(needed)]
            self._write(slots, record)
            self._entries[key] = _Placement(slots, len(record))
            self._order.add(key)
            self._save_index()
        return []

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> None:
        with self._lock:
            placement = self._entries.pop(key, None)
            if placement is not None:
                self._order.discard(key)
                self._release_slots(placement)
                self._save_index()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._order.clear()
            self._free = list(range(self.num_slots))
            self._save_index()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return (self.num_slots - len(self._free)) * self.slot_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Persist hit counts and recency gathered since the last index write."""
        with self._lock:
            if self._dirty:
                self._save_index()

    def close(self) -> None:
        """Flush the index and release the mapping, the files and the directory lock. Idempotent."""
        with self._lock:
            if not self._finalizer.alive:
                return
            self.flush()
            self._finalizer()

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget this file's cached pages, so that the next reads come from the device
        (benchmarks of a cold disk tier; data is unaffected: every write was already flushed)."""
        with self._lock:
            self._mm.madvise(mmap.MADV_DONTNEED)
            os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def indexed_keys(self) -> list[str]:
        """Keys currently indexed (verified only when read)."""
        with self._lock:
            return list(self._entries)

    def eviction_order(self) -> list[str]:
        with self._lock:
            return self._order.order()

    def hits_of(self, key: str) -> int:
        with self._lock:
            return self._order.state(key)[0]

    # ------------------------------------------------------------------ internals
    def _allocate(self) -> None:
        """Make ``slots.bin`` exactly ``max_bytes`` long with its blocks reserved: writing through the mapping
        into a hole of a full file system would kill the process with SIGBUS."""
        fd = self._file.fileno()
        if os.fstat(fd).st_size > self.max_bytes:
            os.ftruncate(fd, self.max_bytes)
        try:
            os.posix_fallocate(fd, 0, self.max_bytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._file.close()
                self._lock_file.close()
                raise RuntimeError(f"no space for a {self.max_bytes}-byte disk cache in {self.directory}") from exc
            logger.warning("disk tier: cannot reserve blocks in %s (%s); the file stays sparse", self.directory, exc)
            os.ftruncate(fd, self.max_bytes)

    def _read(self, placement: _Placement) -> bytearray:
        record = bytearray(placement.length)
        out = memoryview(record)
        with memoryview(self._mm) as mapped:
            for i, slot in enumerate(placement.slots):
                start = i * self.slot_bytes
                size = min(self.slot_bytes, placement.length - start)
                out[start : start + size] = mapped[slot * self.slot_bytes : slot * self.slot_bytes + size]
        return record

    def _write(self, slots: list[int], record: bytearray) -> None:
        data = memoryview(record)
        with memoryview(self._mm) as mapped:
            for i, slot in enumerate(slots):
                chunk = data[i * self.slot_bytes : (i + 1) * self.slot_bytes]
                mapped[slot * self.slot_bytes : slot * self.slot_bytes + len(chunk)] = chunk
        for slot in slots:  # durable before the index that points at it
            self._mm.flush(slot * self.slot_bytes, self.slot_bytes)

    def _release_slots(self, placement: _Placement) -> None:
        for slot in placement.slots:
            heapq.heappush(self._free, slot)

    def _drop_corrupt(self, key: str, reason: str) -> None:
        self.corrupt += 1
        logger.warning("disk tier: dropping corrupt entry %s... (%s)", key[:16], reason)
        self.delete(key)

    def _save_index(self) -> None:
        entries = {}
        for key, placement in self._entries.items():
            hits, tick = self._order.state(key)
            entries[key] = {"slots": placement.slots, "length": placement.length, "hits": hits, "tick": tick}
        document = {
            "format": INDEX_FORMAT,
            "record_version": codec.FORMAT_VERSION,
            "slot_bytes": self.slot_bytes,
            "num_slots": self.num_slots,
            "entries": entries,
        }
        tmp = self._index_path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(document, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._index_path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._dirty = False

    def _load_index(self) -> None:
        """Adopt the saved index, keeping only entries whose placement and header look right."""
        document = self._read_index_document()
        used: dict[int, str] = {}
        rejected: set[str] = set()
        for key, item in document.items():
            placement = self._plausible_placement(key, item)
            if placement is None:
                rejected.add(key)
                continue
            for slot in placement.slots:
                if slot in used:  # two entries claim one slot: at most one of them is intact, trust neither
                    rejected.update((key, used[slot]))
                used[slot] = key
            self._entries[key] = placement
            self._order.add(key, int(item["hits"]), int(item["tick"]))
        for key in rejected:
            if self._entries.pop(key, None) is not None:
                self._order.discard(key)
        if rejected:
            self.corrupt += len(rejected)
            logger.warning("disk tier: dropped %d index entries that no longer match %s", len(rejected), self.directory)
        in_use = {slot for placement in self._entries.values() for slot in placement.slots}
        self._free = [slot for slot in range(self.num_slots) if slot not in in_use]
        self._save_index()

    def _read_index_document(self) -> dict[str, dict]:
        if not self._index_path.exists():
            return {}
        try:
            document = json.loads(self._index_path.read_text(encoding="utf-8"))
            geometry = (document["format"], document["record_version"], document["slot_bytes"], document["num_slots"])
            entries = document["entries"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("disk tier: unreadable index in %s (%s); starting empty", self.directory, exc)
            return {}
        if geometry != (INDEX_FORMAT, codec.FORMAT_VERSION, self.slot_bytes, self.num_slots):
            logger.warning("disk tier: %s was created with other settings %s; starting empty", self.directory, geometry)
            return {}
        return entries if isinstance(entries, dict) else {}

    def _plausible_placement(self, key: str, item: object) -> _Placement | None:
        try:
            slots = [int(s) for s in item["slots"]]  # type: ignore[index]
            length = int(item["length"])  # type: ignore[index]
            int(item["hits"]), int(item["tick"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return None
        if not slots or len(set(slots)) != len(slots) or not all(0 <= s < self.num_slots for s in slots):
            return None
        if not (len(slots) - 1) * self.slot_bytes < length <= len(slots) * self.slot_bytes:
            return None
        start = slots[0] * self.slot_bytes
        if codec.peek(self._mm[start : start + min(length, 4096)]) != (key, length):
            return None
        return _Placement(slots, length)


def default_slot_bytes(max_bytes: int) -> int:
    """About ``max_bytes / 1024``, a multiple of the page size, between one page and 256 KiB."""
    return max(mmap.PAGESIZE, min(MAX_DEFAULT_SLOT_BYTES, max_bytes // 1024 // mmap.PAGESIZE * mmap.PAGESIZE))


def _release(mm: mmap.mmap, *files: object) -> None:
    mm.close()
    for f in files:
        with contextlib.suppress(OSError):
            f.close()  # type: ignore[attr-defined]  # closing the lock file releases the flock
