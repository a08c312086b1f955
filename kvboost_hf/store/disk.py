"""Disk tier: an LMDB environment shared by every process that opens the directory, written behind the requests.

Why LMDB rather than the earlier slot file + JSON index (measured in ``python -m kvboost_hf.bench tiers``):
LMDB gives concurrent readers in many processes, one serialised writer, and copy-on-write transactions that a
crash (SIGKILL, power loss after ``fsync``) cannot tear; a slot file shared between processes would need its own
cross-process allocator, index and recovery. Fetch latency is one memcpy out of the page cache either way.

Layout of ``directory``: LMDB's ``data.mdb`` and ``lock.mdb`` (the shared environment), :data:`WRITE_LOCK`,
:data:`OPENING_LOCK` and ``writers/`` (spills, below). The shared environment has three named databases:

* ``records``: key -> :mod:`kvboost_hf.store.codec` record (SHA-256 and the key it was stored under: a flipped
  byte, a torn or foreign value is a miss, counted in ``corrupt``, and deleted);
* ``meta``: key -> record length, hits and last use (eviction order: fewest hits, then least recent), plus the
  bytes in use under ``_BYTES``, updated in the same transactions as ``records`` (so every process agrees);
* ``tails``: parent key -> lengths of the unfinished chunks stored after it (see ``ChunkStore.note_tail``).

Writes (:meth:`DiskTier.put`, deletes, tail notes, hit counts) go through a :class:`~.base.BackgroundWriter`:
a request never waits on the disk; a full queue drops the write (counted); entries still queued are served from
memory. Each batch is one transaction, durable when it commits, so a process killed at any moment loses at most
the writes still queued. Failures never reach the caller: a full or read-only file system, a directory deleted
or a data file truncated under the store are logged once, counted in ``errors``, and leave the tier degraded
(failed writes) or disabled (every read a miss). Reads check that ``data.mdb`` still covers LMDB's used pages
before mapping them, so a file truncated by another program is a miss, not SIGBUS (a truncation racing the
check itself cannot be caught from Python).

LMDB may count pages it never writes (pages allocated and freed in one transaction, e.g. a record evicted by the
batch that wrote it), so every write transaction commits under the directory's :data:`WRITE_LOCK` and then
extends ``data.mdb`` over the pages counted; a check that finds the file short takes the same lock and looks
again before calling it truncated (a commit was in progress: counted in ``rechecks``, never a disabled tier).

The write lock is a lease, never waited on without bound: its holder writes its pid, process start time and
the time it took the lock into :data:`WRITE_LOCK` and clears them when it lets go. A background write waits at
most ``lock_wait_s`` for it (and not at all right after a try found it held), counted in ``lock_waits``; a
waiter that finds the holder past its ``lease_s`` logs it once with the holder's state. A holder that died
leaves its lease written: the next holder finishes what it left (extends ``data.mdb`` over the counted pages;
LMDB's robust mutex and copy-on-write pages make its unfinished transaction vanish) and counts it in
``lock_takeovers``.

Spills: a stopped or hung holder keeps LMDB's own writer mutex as well as the lock, and LMDB has one writer per
environment, so a batch that does not get the lock goes to this process's *spill*: an LMDB environment of its
own, ``writers/<pid>-<start ticks>/`` (:class:`_Spill`), that only this process writes (nobody else's stop can
block it), committed and read back like the shared one (``spill_writes``). Every process reads every spill
after a miss in the shared environment (:class:`_SpillReader`; the listing of ``writers/`` is looked at when
its mtime changes). Spilled entries are moved into the shared environment, :data:`MERGE_BATCH` at a time, with
the next commits that get the lock (the writer's batches, one slice per ``flush``, all of them at ``close``),
and removed from the spill once committed and read back there; the budget and the eviction order are then the
shared environment's. A spill whose owner ended (its :data:`OWNER_LOCK` ``flock`` is free: a killed process
included) is adopted the same way by any process that writes or flushes, then removed. A spill holds at most
``max_bytes / 4`` of records: so the directory holds at most ``max_bytes`` plus that much per process that
spilled; a batch the spill cannot take stays in memory and is tried again. Nothing in the shared environment's
format changes: a process without spills (or of an earlier version) uses the directory as before.
``flush`` and ``close`` return within their ``timeout_s`` (plus one commit started before it ran out).

Durability: ``flush`` returns True only when every chunk written since the last flush was committed and then
read back, byte for byte, from a new read transaction (of the shared environment under the lock, or of the
spill: what a reopened environment sees); a
chunk whose commit failed (a full file system: ``ENOSPC`` or a short write) or that did not read back is
counted in ``lost`` and makes the next ``flush`` return False.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb

from kvboost_hf.core.errors import ConfigError, KVBoostError
from kvboost_hf.store import codec
from kvboost_hf.store.base import CLOSE_TIMEOUT_S, BackgroundWriter, StorageTier, StoredChunk

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 30
_META = struct.Struct("<QId")  # record bytes, hits, last use (Unix seconds)
_BYTES = b"\0bytes"  # meta key of the bytes in use (never a chunk key: those are hex)
_U64 = struct.Struct("<Q")
_TAIL_PREFIX = "\0tail:"  # writer keys of tail notes (chunk keys are hex)
_DELETE = object()
_MAP_HEADROOM = 1.25  # LMDB map size over max_bytes: room for B-tree pages and freed pages awaiting reuse


class DiskTier(StorageTier):
    """Restart-surviving, multi-process tier under ``directory`` (see the module docstring).

    ``max_bytes`` bounds the bytes of records held (page-rounded); the LMDB file grows as needed, up to
    ``1.25 * max_bytes`` plus a little, and is never reserved up front; each process's spill holds at most
    ``max_bytes / 4`` more while another process holds the write lock. Tiers of one process on one directory
    share one LMDB environment and one spill (LMDB allows one per process; the first one's size limits apply).
    ``queue_size`` bounds the writes waiting for the disk. ``nbytes`` and ``len`` are the shared environment's
    (what every process sharing the directory sees); entries still in spills are ``stats()["spilled"]``.
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        queue_size: int = 256,
        lock_wait_s: float = 0.25,
        lease_s: float = 10.0,
    ):
        if max_bytes < 1:
            raise ConfigError(f"disk max_bytes must be >= 1, got {max_bytes}")
        if lock_wait_s <= 0 or lease_s <= 0:
            raise ConfigError(f"disk lock_wait_s and lease_s must be > 0, got {lock_wait_s}, {lease_s}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.lock_wait_s = lock_wait_s  # seconds a background write waits for another process's write lock
        self.lease_s = lease_s  # seconds a holder may keep the write lock before waiters report it
        self.lock_waits = 0  # batches that found the write lock held elsewhere and stayed in memory
        self.lock_takeovers = 0  # write locks found abandoned by a dead holder and finished
        self.lost = 0  # chunks whose write failed or did not read back after its commit
        self._unreported_lost = 0  # lost since the last flush (which then returns False)
        self._stale_holders: set[str] = set()  # leases held past their term already logged
        self._main_busy = False  # the last try found WRITE_LOCK held: the next one does not wait for it
        self.spill_writes = 0  # chunks written to this process's spill because another process held the lock
        self._spill_logged = False  # the first batch written to the spill was logged
        self._spill: _Spill | None = None  # this process's spill, opened on first need
        self._readers: dict[str, _SpillReader] = {}  # other processes' spills, by name
        self._readers_seen: tuple[int | None, float] = (None, 0.0)  # writers/ mtime, monotonic time of listing
        self._adopted: dict[str, bytes] = {}  # dead spills being merged: the last spill key merged
        self._spills_lock = threading.RLock()  # the readers' list and the spill's opening
        self._spills_closed = False  # after close: no spill opened again
        self._sources: tuple[list[Any], float] = ([], -_RECHECK_S)  # _spill_sources' answer and when it was made
        self._merged = 0  # spilled entries merged by the last write
        self.corrupt = 0
        self.evictions = 0
        self.errors = 0
        self.rechecks = 0  # checks that found data.mdb short while a commit was extending it, then intact
        self.disabled: str | None = None  # why every read is a miss and every write skipped, once that happened
        self._lock = threading.Lock()  # the environment's lifetime: reads and close
        self._hits: dict[str, int] = {}
        self._error_logged = False
        self._env: Any = None
        self._data_fd = -1
        self.read_only = False  # the directory cannot be written: reads served, nothing written
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if (self.directory / "data.mdb").exists() and not os.access(self.directory, os.W_OK):
                self._open_read_only()
            else:
                with _opening(self.directory):
                    try:
                        self._open()
                    except _DAMAGED as exc:
                        self._set_aside(exc)
        except (OSError, lmdb.Error, _Unusable, _LockBusy) as exc:
            self._disable(f"cannot open {self.directory} ({type(exc).__name__}: {exc})")
        self._writer = BackgroundWriter("disk", self._write_batch, queue_size=queue_size, retry_s=lock_wait_s)

    # ------------------------------------------------------------------ StorageTier
    def get(self, key: str) -> StoredChunk | None:
        pending = self._writer.pending(key)
        if pending is not None:
            return None if pending is _DELETE else pending
        record, source = None, None  # source: the spill it came from (None: the shared environment)
        with self._lock:
            if self._usable():
                try:
                    with self._env.begin(db=self._records, buffers=True) as txn:
                        buffer = txn.get(key.encode())
                        record = None if buffer is None else bytearray(buffer)
                except lmdb.Error as exc:
                    self._failed("read", exc)
        if record is None:
            spilled, source = self._spilled(_SPILL_RECORD + key.encode())
            if spilled is None:
                return None
            record = bytearray(spilled)
        try:
            entry = codec.decode(key, record)
        except codec.CorruptEntryError as exc:
            with self._lock:
                self.corrupt += 1
            logger.warning("disk tier: dropping corrupt entry %s... (%s)", key[:16], exc)
            if source is None:
                self.delete(key)
            elif source is self._spill:
                with contextlib.suppress(lmdb.Error):
                    self._spill.remove([_SPILL_RECORD + key.encode()])
            return None  # in another process's spill: a miss here, dropped where it is merged and read again
        with self._lock:
            self._hits[key] = self._hits.get(key, 0) + 1
        return entry

    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        """Queue ``entry`` for the disk (dropped and counted if the queue is full); never waits on I/O."""
        if self.disabled is None and not self.read_only:
            self._writer.submit(key, entry)
        return []

    def contains(self, key: str) -> bool:
        pending = self._writer.pending(key)
        if pending is not None:
            return pending is not _DELETE
        return self._meta_of(key) is not None or self._spilled(_SPILL_RECORD + key.encode())[0] is not None

    def delete(self, key: str) -> None:
        if self.disabled is None and not self.read_only:
            self._writer.submit(key, _DELETE, block_s=1.0)

    def clear(self) -> None:
        """Drop every entry (and tail note) after the queued writes land, in the shared environment (every
        process sharing it sees it) and this process's spill (other processes' spills are theirs)."""
        self._writer.flush()
        with self._lock:
            if self.read_only or not self._usable():
                return
            self._hits.clear()
            try:
                with self._transaction(self.lease_s) as txn:
                    for db in (self._records, self._meta, self._tails):
                        txn.drop(db, delete=False)
                if self._spill is not None:
                    self._spill.remove([name for name, _ in self._spill.take(-1)])
            except (lmdb.Error, _LockBusy) as exc:
                self._failed("clear", exc)

    @property
    def nbytes(self) -> int:
        with self._lock:
            if not self._usable():
                return 0
            with self._env.begin() as txn:
                return _used(txn, self._meta)

    def __len__(self) -> int:
        with self._lock:
            if not self._usable():
                return 0
            with self._env.begin(db=self._records) as txn:
                return txn.stat(self._records)["entries"]

    def stats(self) -> dict[str, int]:
        """``bytes`` and ``chunks`` (what every process sharing the directory sees), ``evictions``, ``errors``,
        ``dropped`` (writes not done), ``queued`` (writes not yet on disk), ``corrupt`` (records refused),
        ``rechecks`` (a short ``data.mdb`` seen during another commit, intact once it ended), ``lock_waits``
        (batches kept in memory because another process held the write lock), ``lock_takeovers`` (locks left by a
        dead holder), ``lost`` (chunks whose write failed or did not read back), ``spill_writes`` (chunks this
        process wrote to its spill while another held the lock), ``spilled`` (chunks in the spills of every process,
        not yet merged; not in ``chunks``), ``read_only`` (1 when the
        directory cannot be written: reads served, nothing written), ``disabled`` (1 once the tier
        gave up; not after a plain close)."""
        return {
            "bytes": self.nbytes,
            "chunks": len(self),
            "evictions": self.evictions,
            "errors": self.errors,
            "dropped": self.dropped,
            "queued": self.queued,
            "corrupt": self.corrupt,
            "rechecks": self.rechecks,
            "lock_waits": self.lock_waits,
            "lock_takeovers": self.lock_takeovers,
            "lost": self.lost,
            "spill_writes": self.spill_writes,
            "spilled": sum(source.entries() for source in self._spill_sources()),
            "read_only": int(self.read_only),
            "disabled": int(self.disabled not in (None, "closed")),
        }

    # ------------------------------------------------------------------ tails
    def note_tail(self, parent_key: str, lengths: frozenset[int]) -> None:
        """Queue ``lengths`` to be merged into the tail note of ``parent_key``."""
        if self.disabled is None and not self.read_only:
            self._writer.submit(_TAIL_PREFIX + parent_key, lengths)

    def tail_lengths(self, parent_key: str) -> set[int]:
        pending = self._writer.pending(_TAIL_PREFIX + parent_key)
        out = set(pending) if pending is not None else set()
        for source in self._spill_sources():
            with contextlib.suppress(lmdb.Error):
                out |= _unpack_lengths(source.get(_SPILL_TAIL + parent_key.encode()))
        with self._lock:
            if not self._usable():
                return out
            try:
                with self._env.begin(db=self._tails) as txn:
                    return out | _unpack_lengths(txn.get(_tail_name(parent_key)))
            except lmdb.Error as exc:
                self._failed("read", exc)
                return out

    # ------------------------------------------------------------------ lifecycle
    @property
    def dropped(self) -> int:
        """Writes not done because the queue was full or the tier closed."""
        return self._writer.dropped

    @property
    def queued(self) -> int:
        """Writes submitted and not yet committed."""
        return len(self._writer)

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait (up to ``timeout_s``) until queued writes are committed (to the shared environment, or to this
        process's spill while another process holds the write lock), then commit hit counts with one slice of
        spilled entries (:data:`MERGE_BATCH`) if the write lock is free. True only if everything queued before the call
        is on disk and no chunk was lost since the last flush (see the module docstring)."""
        deadline = time.monotonic() + timeout_s
        drained = self._writer.flush(timeout_s)
        self._merge_spills(deadline, adopt=True, slices=1)  # the rest: with later writes, flushes, the close
        with self._lock:
            lost, self._unreported_lost = self._unreported_lost, 0
        if lost:
            logger.warning("disk tier: %d chunks written to %s since the last flush were lost", lost, self.directory)
        return drained and not lost

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Commit queued writes, stop the writer and close LMDB, all within ``timeout_s`` (what could not be
        written in time is dropped, counted). Idempotent; later calls to any method are misses."""
        deadline = time.monotonic() + timeout_s
        self._writer.close(timeout_s)
        if self._writer.running:  # a write outlived the timeout: its environment must stay open under it
            logger.warning("disk tier: a write to %s is still running at close; leaving it open", self.directory)
            self.disabled = "closed"
            return
        self._merge_spills(deadline, adopt=False, slices=None)  # its own spill only: the others' are not its job
        self._close_spills()
        with self._lock:
            if self._env is not None and self.disabled is None and not (self.directory / "data.mdb").exists():
                logger.warning("disk tier: %s vanished while open; its entries are gone", self.directory)
            self._close_env()
            if self.disabled is None:
                self.disabled = "closed"

    def drop_page_cache(self) -> None:
        """Make the next reads come from the device (benchmarks of a cold tier): unmap, drop the file's cached
        pages, map again. Data is unaffected (every commit was synced). Pages stay cached while another tier of
        this process maps the same directory."""
        self._writer.flush()
        with self._lock:
            if self.read_only or not self._usable():
                return
            self._close_env()
            fd = os.open(self.directory / "data.mdb", os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            self._open()

    def indexed_keys(self) -> list[str]:
        """Keys stored (committed; verified only when read)."""
        with self._lock:
            if not self._usable():
                return []
            with self._env.begin(db=self._records) as txn:
                return [bytes(k).decode() for k in txn.cursor().iternext(keys=True, values=False)]

    def eviction_order(self) -> list[str]:
        """Committed keys in the order they would be evicted (hit counts not yet committed are left out)."""
        with self._lock:
            if not self._usable():
                return []
            with self._env.begin(db=self._meta) as txn:
                return [key for _, _, key in _by_eviction_order(txn, self._meta)]

    def hits_of(self, key: str) -> int:
        meta = self._meta_of(key)
        with self._lock:
            return (meta[1] if meta is not None else 0) + self._hits.get(key, 0)

    # ------------------------------------------------------------------ internals
    def _open(self) -> None:
        """Open (creating if needed) the environment and its databases. The files are checked before LMDB maps
        them (see :func:`_check_files`): :class:`_Truncated` for a ``data.mdb`` that must be set aside,
        :class:`_Unusable` for a directory that cannot be used as it is."""
        self._close_env()
        self._env = _acquire_env(self.directory, int(self.max_bytes * _MAP_HEADROOM) + (16 << 20))
        self._data_fd = os.open(self.directory / "data.mdb", os.O_RDWR)
        if not self._covers_used_pages():  # the environment may be another tier's, opened before a truncation
            raise _Truncated(f"{self.directory}/data.mdb is shorter than its used pages")
        self._page = self._env.stat()["psize"]
        self._records = self._meta = self._tails = None
        if self._open_databases(self.lock_wait_s):
            self._walk()

    def _open_read_only(self) -> None:
        """Open a directory this process cannot write (a read-only mount or permissions): LMDB without its lock
        file (which cannot be created or written there), reads served, writes skipped. A damaged file cannot be
        set aside here: :class:`_Unusable` (the tier disabled)."""
        self._data_fd = os.open(self.directory / "data.mdb", os.O_RDONLY)
        problem = _data_file_problem(self._data_fd)
        if problem is not None:
            raise _Unusable(f"{self.directory}/data.mdb: {problem} (read-only: cannot set it aside)")
        self.read_only = True
        self._env = lmdb.open(str(self.directory), readonly=True, lock=False, max_dbs=3)
        self._page = self._env.stat()["psize"]
        self._records, self._meta, self._tails = [self._env.open_db(name, create=False) for name in _DATABASES]
        logger.warning("disk tier: %s is read-only; serving its entries, writing nothing", self.directory)

    def _walk(self) -> None:
        """Read every key of every database (every branch and leaf page, not the records' overflow pages):
        LMDB's ``CorruptedError`` or ``PageNotFoundError`` for a damaged page, so that it is set aside at open
        instead of failing reads for good."""
        for db in (self._records, self._meta, self._tails):
            with self._env.begin(db=db) as txn:
                for _ in txn.cursor().iternext(keys=True, values=False):
                    pass

    def _open_databases(self, wait_s: float) -> bool:
        """Open the three databases if not yet done; False while another process holds the write lock (LMDB
        opens databases in a write transaction, which would wait without bound on LMDB's own writer mutex held
        by a stopped writer: until then reads are misses and writes stay queued)."""
        if self._records is not None:
            return True
        try:
            with self._write_locked(wait_s):
                dbs = [self._env.open_db(name) for name in _DATABASES]
        except _LockBusy:
            return False
        self._records, self._meta, self._tails = dbs
        return True

    def _set_aside(self, exc: Exception) -> None:
        """``data.mdb`` is not a usable LMDB file: keep it as ``data.mdb.damaged`` and start an empty one."""
        logger.warning("disk tier: %s/data.mdb is damaged (%s); moved aside, starting empty", self.directory, exc)
        self.corrupt += 1
        self._close_env()
        try:
            os.replace(self.directory / "data.mdb", self.directory / "data.mdb.damaged")
            self._open()
        except (OSError, lmdb.Error, _Truncated, _Unusable, _LockBusy) as again:  # damaged again: give up
            self._disable(f"cannot open {self.directory} ({type(again).__name__}: {again})")

    def _covers_used_pages(self) -> bool:
        """Whether the open ``data.mdb`` still holds every page its newest meta page counts, read with
        ``pread`` (reading it through LMDB's map would itself fault on a truncated file); looked at again under
        :data:`WRITE_LOCK` when short (see :func:`_settled_data_file_problem`)."""
        problem, rechecked = _settled_data_file_problem(self.directory, self._data_fd)
        if rechecked and problem is None:
            self.rechecks += 1
        if problem == BUSY:
            raise _LockBusy("a process in the middle of a commit", False)
        return problem is None

    @contextlib.contextmanager
    def _write_locked(self, wait_s: float | None = None) -> Iterator[None]:
        """Hold :data:`WRITE_LOCK` (waiting at most ``wait_s``, default ``lock_wait_s``: :class:`_LockBusy`
        otherwise, counted in ``lock_waits``); on leaving, ``data.mdb`` is extended over every page the newest
        meta page counts: LMDB leaves pages allocated and freed in one transaction unwritten, and readers must
        never find a file shorter than its counted pages unless it was truncated. Extending adds a hole of free
        pages (no data, no space on most file systems). A lock left by a dead holder is finished first."""
        try:
            with _write_lock(self.directory, self.lock_wait_s if wait_s is None else wait_s, self.lease_s) as left:
                self._main_busy = False
                if left:
                    self.lock_takeovers += 1
                    logger.warning(
                        "disk tier: took over %s/%s from a dead holder (%s)", self.directory, WRITE_LOCK, left
                    )
                    self._extend_over_counted()
                yield
                self._extend_over_counted()
        except _LockBusy as busy:
            self.lock_waits += 1
            self._main_busy = True
            if busy.stale and busy.lease not in self._stale_holders:
                self._stale_holders.add(busy.lease)
                logger.warning(
                    "disk tier: %s/%s is held past its lease by %s; writes go to this process's spill until it lets go",
                    self.directory,
                    WRITE_LOCK,
                    busy.holder,
                )
            raise

    def _extend_over_counted(self) -> None:
        """Grow ``data.mdb`` to the pages its newest meta page counts (call under :data:`WRITE_LOCK`: no other
        commit runs, so it only ever grows it)."""
        counted = (self._env.info()["last_pgno"] + 1) * self._page
        if os.fstat(self._data_fd).st_size < counted:
            os.ftruncate(self._data_fd, counted)

    @contextlib.contextmanager
    def _transaction(self, wait_s: float | None = None) -> Iterator[Any]:
        """A write transaction committed under :meth:`_write_locked`."""
        with self._write_locked(wait_s), self._env.begin(write=True) as txn:
            yield txn

    def _same_file(self) -> bool:
        """Whether ``data.mdb`` under the directory is still the file this tier opened (not deleted, or deleted
        and created again by another process)."""
        try:
            now = os.stat(self.directory / "data.mdb")
        except OSError:
            return False
        held = os.fstat(self._data_fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def _meta_of(self, key: str) -> tuple[int, int, float] | None:
        with self._lock:
            if not self._usable():
                return None
            try:
                with self._env.begin(db=self._meta) as txn:
                    raw = txn.get(key.encode())
            except lmdb.Error as exc:
                self._failed("read", exc)
                return None
        return _META.unpack(raw) if raw is not None and len(raw) == _META.size else None

    def _usable(self) -> bool:
        """Whether the environment may be touched (call under ``_lock``): open, enabled, and ``data.mdb`` still
        as long as the pages LMDB will map (a shorter file would raise SIGBUS on access)."""
        if self.disabled is not None or self._env is None:
            return False
        try:
            intact = self._covers_used_pages()
        except _LockBusy:
            return False  # short while another process commits and holds the lock: a miss for now
        except (OSError, lmdb.Error) as exc:
            self._disable(f"cannot inspect {self.directory} ({exc})")
            return False
        if not intact:
            self._disable(f"{self.directory}/data.mdb was truncated under the store")
        return intact and self._open_databases(0.0)

    def _replaced(self) -> bool:
        """Whether the directory's ``data.mdb`` was deleted or replaced under the tier; disables it if so (its
        writes would go to an unlinked file). Call under ``_lock``."""
        if self._same_file():
            return False
        self._disable(f"{self.directory}/data.mdb was deleted or replaced by another file while in use")
        return True

    def _write_batch(
        self, batch: list[tuple[str, Any]], lock_wait_s: float | None = None, adopt: bool = True
    ) -> list[tuple[str, Any]] | None:
        """One transaction: the batch's records, deletes and tail notes, hit counts, a slice of spilled entries
        (:meth:`_merge_slice`), and the evictions needed to stay within ``max_bytes``. Runs on the writer thread
        (and in flush/close with an empty batch). When another process holds the write lock, the records and
        tail notes go to this process's spill instead (:meth:`_spill_batch`) and what it could not take is
        returned (the writer keeps it and tries again); a batch that failed counts its chunks in ``lost``.
        ``adopt``: the slice may come from an ended process's spill."""
        self._merged = 0
        if self.read_only:
            return None
        wait = self._lock_wait(lock_wait_s)
        records, refused = codec.encode_each([(key, item) for key, item in batch if _is_chunk(key, item)])
        if refused:
            self._lose(len(refused))
            batch = [(key, item) for key, item in batch if key not in refused]
        if self._env is not None and not self._open_databases(wait):
            return self._spill_batch(batch, records)
        merging = self._merge_slice(adopt)
        with self._lock:  # held only for the checks: readers must not wait for the commit's fsync
            hits, self._hits = self._hits, {}
            if (not batch and not hits and merging is None) or not self._usable() or self._replaced():
                return None
        merged_records, merged_tails = _unspilled(merging[0] if merging is not None else [])
        try:
            try:
                unreadable = self._commit(batch + merged_tails, records + merged_records, hits, wait)
            except lmdb.MapFullError:
                self._evict_fraction(0.25)  # fragmentation: free a quarter of the budget and try once more
                unreadable = self._commit(batch + merged_tails, records + merged_records, hits, wait)
        except _LockBusy:
            with self._lock:
                for key, count in hits.items():  # counted again with the next commit
                    self._hits[key] = self._hits.get(key, 0) + count
            return self._spill_batch(batch, records)
        except (OSError, lmdb.Error) as exc:
            self._failed("write", exc)
            self._lose(len(records))
            return None
        if unreadable:
            logger.warning("disk tier: %d chunks committed to %s did not read back", unreadable, self.directory)
            self._lose(unreadable)
        elif merging is not None:  # in the shared environment now: out of the spill
            merging[1]()
            self._merged = len(merging[0])
        return None

    def _lock_wait(self, wait_s: float | None) -> float:
        """Seconds to wait for :data:`WRITE_LOCK`: none right after a try found it held (the writes go to the
        spill at once), else ``wait_s`` (default ``lock_wait_s``)."""
        if self._main_busy:
            return 0.0
        return self.lock_wait_s if wait_s is None else wait_s

    # ------------------------------------------------------------------ spills
    def _spill_batch(
        self, batch: list[tuple[str, Any]], records: list[tuple[str, bytearray]]
    ) -> list[tuple[str, Any]] | None:
        """Write the batch's ``records`` and tail notes to this process's spill (another process holds the write
        lock) and read them back; deletes stay queued. Returns what the writer keeps: the deletes, or the whole
        batch when the spill cannot take it (full, or it cannot be opened): its next try then waits for the lock
        again (``lock_wait_s``) instead of going to the spill at once, or a full spill would leave it only the
        instants no other process holds the lock, and the queue would fill and drop writes."""
        tails = [(key[len(_TAIL_PREFIX) :], item) for key, item in batch if key.startswith(_TAIL_PREFIX)]
        spill = self._own_spill() if records or tails else None
        unreadable = None
        if spill is not None:
            try:
                unreadable = spill.write(records, tails)
            except (OSError, lmdb.Error) as exc:
                self._failed("spill write", exc)
        if spill is None or unreadable is None:
            self._main_busy = False
            return batch
        if not self._spill_logged:
            self._spill_logged = True
            logger.warning(
                "disk tier: %s/%s is held by another process; writing to this process's spill %s until it is free",
                self.directory,
                WRITE_LOCK,
                spill.path,
            )
        self.spill_writes += len(records) - unreadable
        if unreadable:
            logger.warning("disk tier: %d chunks written to the spill %s did not read back", unreadable, spill.path)
            self._lose(unreadable)
        deletes = [(key, item) for key, item in batch if item is _DELETE]
        return deletes or None

    def _own_spill(self) -> _Spill | None:
        """This process's spill for the directory, opened (or created) on first need; None when it cannot be
        (an error counted)."""
        with self._spills_lock:
            if self._spill is None and not self._spills_closed:
                path = self.directory / SPILL_DIR / _spill_name()
                opener = functools.partial(_Spill, self.directory, max(self.max_bytes // _SPILL_SHARE, 1))
                try:
                    self._spill = _acquire(path, opener)
                    self._sources = ([], -_RECHECK_S)  # seen by the next read
                except (OSError, lmdb.Error) as exc:
                    self._failed("opening a spill", exc)
            return self._spill

    def _spill_sources(self) -> list[Any]:
        """This process's spill (if there is one) and readers of the other processes' spills, as of at most
        :data:`_RECHECK_S` ago (a spill another process just created is seen that much later: a miss meanwhile).
        Past that, ``writers/`` is listed again when its mtime changed or :data:`_RELIST_S` after the last
        listing (one ``stat`` otherwise)."""
        now = time.monotonic()
        sources, checked = self._sources
        if now - checked < _RECHECK_S:
            return sources
        try:
            stamp: int | None = os.stat(self.directory / SPILL_DIR).st_mtime_ns
        except OSError:
            stamp = None
        with self._spills_lock:
            if self._spills_closed:
                return []
            seen, at = self._readers_seen
            if stamp != seen or now - at > _RELIST_S:
                self._relist(stamp, now)
            sources = ([self._spill] if self._spill is not None else []) + list(self._readers.values())
            self._sources = (sources, now)
            return sources

    def _relist(self, stamp: int | None, now: float) -> None:
        """Open readers of the spills listed in ``writers/`` (this process's own: opened as its spill), close those
        no longer listed (call under ``_spills_lock``)."""
        try:
            names = {name for name in os.listdir(self.directory / SPILL_DIR) if not name.startswith(".")}
        except OSError:
            names = set()
        if _spill_name() in names:
            self._own_spill()  # left by an earlier tier of this process: merged from now on
        names.discard(_spill_name())
        for name in set(self._readers) - names:
            self._adopted.pop(name, None)
            _release_env(self._readers.pop(name))
        for name in names - set(self._readers):
            path = self.directory / SPILL_DIR / name
            with contextlib.suppress(OSError, lmdb.Error):  # removed meanwhile: gone at the next listing
                self._readers[name] = _acquire(path, functools.partial(_SpillReader, path))
        self._readers_seen = (stamp, now)

    def _spilled(self, name: bytes) -> tuple[bytes | None, Any]:
        """The value under spill key ``name`` in the first spill holding it and that spill, or ``(None, None)``."""
        for source in self._spill_sources():
            try:
                value = source.get(name)
            except lmdb.Error as exc:
                self._failed("spill read", exc)
                continue
            if value is not None:
                return value, source
        return None, None

    def _merge_slice(self, adopt: bool) -> tuple[list[tuple[bytes, bytes]], Callable[[], None]] | None:
        """Up to :data:`MERGE_BATCH` spilled entries to commit into the shared environment, and what to do once
        they are committed and read back: from this process's spill first (then removed from it), else from the
        spill of a process that ended (adopted: the place reached remembered; the spill removed once all of it
        was merged; only if ``adopt``). None when there is nothing to merge."""
        sources = self._spill_sources()
        if self._spill is not None:
            spill = self._spill
            entries = spill.take(MERGE_BATCH)
            if entries:
                return entries, functools.partial(spill.remove, [name for name, _ in entries])
        if not adopt:
            return None
        with self._spills_lock:
            for name, reader in list(self._readers.items()):
                if reader not in sources:
                    continue
                with reader.adoptable() as ended:
                    if not ended:
                        continue
                    entries = reader.after(self._adopted.get(name, b""), MERGE_BATCH)
                    if entries:
                        if name not in self._adopted:
                            logger.warning("disk tier: merging the spill %s of a process that ended", reader.path)
                        return entries, functools.partial(self._adopted.__setitem__, name, entries[-1][0])
                    self._remove_spill(name, reader)
        return None

    def _remove_spill(self, name: str, reader: _SpillReader) -> None:
        """Remove the spill ``name`` of an ended process, every entry of it merged (call holding its owner lock and
        ``_spills_lock``): renamed out of the listing first, so that no process opens it half removed."""
        gone = self.directory / SPILL_DIR / f".gone-{name}-{os.getpid()}"
        try:
            os.replace(reader.path, gone)
        except OSError:
            return
        shutil.rmtree(gone, ignore_errors=True)
        self._adopted.pop(name, None)
        self._sources = ([], -_RECHECK_S)
        _release_env(self._readers.pop(name))
        logger.info("disk tier: the spill %s was merged and removed", reader.path)

    def _merge_spills(self, deadline: float, adopt: bool, slices: int | None) -> None:
        """Commit hit counts with a slice of spilled entries (``adopt``: an ended process's spill may give it),
        then more slices, up to ``slices`` in all (None: no limit), while the write lock is free (waited for at
        most ``lock_wait_s``) and ``deadline`` (monotonic seconds) is not reached. A commit started before the
        deadline may end after it (one commit: milliseconds, more for an fsync on a busy disk)."""
        done = 0
        while True:
            wait = min(self.lock_wait_s, max(deadline - time.monotonic(), 0.0))
            if self._write_batch([], lock_wait_s=wait, adopt=adopt) is not None or not self._merged:
                return
            done += 1
            if done == slices or time.monotonic() >= deadline:
                return

    def _close_spills(self) -> None:
        """Let go of this process's spill (it stays on disk, adopted once no tier of this process has it) and of
        the readers; none is opened again."""
        with self._spills_lock:
            self._spills_closed = True
            self._sources = ([], -_RECHECK_S)
            for reader in self._readers.values():
                _release_env(reader)
            self._readers.clear()
            if self._spill is not None:
                _release_env(self._spill)
                self._spill = None

    def _lose(self, chunks: int) -> None:
        with self._lock:
            self.lost += chunks
            self._unreported_lost += chunks

    def _commit(
        self,
        batch: list[tuple[str, Any]],
        records: list[tuple[str, bytearray]],
        hits: dict,
        lock_wait_s: float | None = None,
    ) -> int:
        """Commit the batch (see :meth:`_write_batch`); the number of its records that a new read transaction,
        still under the lock, does not return byte for byte."""
        with self._write_locked(lock_wait_s):
            written = self._commit_locked(batch, records, hits)
            with self._env.begin(db=self._records, buffers=True) as txn:
                return sum(1 for key, record in written if txn.get(key.encode()) != record)

    def _commit_locked(
        self, batch: list[tuple[str, Any]], records: list[tuple[str, bytearray]], hits: dict
    ) -> list[tuple[str, bytearray]]:
        """The write transaction of :meth:`_commit`; the records it put."""
        now = time.time()
        written = []
        evicted: set[str] = set()  # by this batch: its own earlier records among them
        with self._env.begin(write=True) as txn:
            used = _used(txn, self._meta)
            for key, item in batch:
                if key.startswith(_TAIL_PREFIX):
                    name = _tail_name(key[len(_TAIL_PREFIX) :])
                    merged = _unpack_lengths(txn.get(name, db=self._tails)) | set(item)
                    txn.put(name, _pack_lengths(merged), db=self._tails)
                elif item is _DELETE:
                    used -= self._remove(txn, key.encode())
            for key, record in records:
                size = _pages(len(record), self._page)
                if size > self.max_bytes:
                    self._lose(1)  # larger than the whole tier
                    continue
                existing = txn.get(key.encode(), db=self._records)
                if existing is not None and codec.intact(key, existing):
                    continue  # stored already (by this process or another)
                if existing is not None:  # a damaged record (its delete may have been replaced by this put)
                    used -= self._remove(txn, key.encode())
                if used + size > self.max_bytes:
                    used -= self._evict(txn, used + size - self.max_bytes, evicted)
                txn.put(key.encode(), record, db=self._records)
                txn.put(key.encode(), _META.pack(len(record), 0, now), db=self._meta)
                written.append((key, record))
                used += size
            for key, count in hits.items():
                raw = txn.get(key.encode(), db=self._meta)
                if raw is not None and len(raw) == _META.size:
                    length, old, _ = _META.unpack(raw)
                    txn.put(key.encode(), _META.pack(length, old + count, now), db=self._meta)
            txn.put(_BYTES, _U64.pack(max(used, 0)), db=self._meta)
        return [(key, record) for key, record in written if key not in evicted]

    def _remove(self, txn: Any, key: bytes) -> int:
        """Delete one entry inside ``txn``; the page-rounded bytes it held (0 if absent)."""
        raw = txn.pop(key, db=self._meta)
        txn.delete(key, db=self._records)
        return _pages(_META.unpack(raw)[0], self._page) if raw is not None and len(raw) == _META.size else 0

    def _evict(self, txn: Any, needed: int, evicted: set[str] | None = None) -> int:
        """Remove entries in eviction order until ``needed`` bytes are freed (their keys added to ``evicted``);
        the bytes freed."""
        freed = 0
        for _, _, key in _by_eviction_order(txn, self._meta):
            if freed >= needed:
                break
            freed += self._remove(txn, key.encode())
            self.evictions += 1
            if evicted is not None:
                evicted.add(key)
        return freed

    def _evict_fraction(self, fraction: float) -> None:
        with self._transaction() as txn:
            used = _used(txn, self._meta)
            used -= self._evict(txn, int(self.max_bytes * fraction))
            txn.put(_BYTES, _U64.pack(max(used, 0)), db=self._meta)

    def _failed(self, what: str, exc: Exception) -> None:
        """Count a failed operation; the first one is a warning, later ones debug lines. A damaged page is also
        counted in ``corrupt`` (the next open of the directory sets the file aside)."""
        self.errors += 1
        if isinstance(exc, _DAMAGED):
            self.corrupt += 1
            if not self._error_logged:
                logger.warning(
                    "disk tier: a damaged page in %s/data.mdb (%s); the next open sets it aside", self.directory, exc
                )
        level = logging.DEBUG if self._error_logged else logging.WARNING
        self._error_logged = True
        logger.log(level, "disk tier: %s failed in %s (%s); serving from the other tiers", what, self.directory, exc)

    def _disable(self, reason: str) -> None:
        self.errors += 1
        self.disabled = reason
        logger.warning("disk tier disabled: %s; serving from the other tiers", reason)

    def _close_env(self) -> None:
        if self._env is not None:
            if self.read_only:  # its own environment, not shared (no lock file)
                self._env.close()
            else:
                _release_env(self._env)
            self._env = None
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1


_DATABASES = (b"records", b"meta", b"tails")
OPENING_LOCK = "open.lock"
WRITE_LOCK = "write.lock"


@contextlib.contextmanager
def _opening(directory: Path) -> Iterator[None]:
    """Hold the directory's :data:`OPENING_LOCK` (``flock``, exclusive) while the files are checked, opened or set
    aside: a ``data.mdb`` that another process is creating has no meta pages yet, and would otherwise look
    truncated here and be set aside under that process (each then writing a file the other never reads). A file
    of its own, so LMDB's record locks on ``lock.mdb`` are never touched."""
    with _flocked(directory / OPENING_LOCK, fcntl.LOCK_EX):
        yield


@contextlib.contextmanager
def _flocked(path: Path, operation: int) -> Iterator[None]:
    """Hold ``flock(operation)`` on ``path`` (created if needed) on a descriptor of its own: threads of one
    process exclude each other too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # releases the lock


def _settled_data_file_problem(directory: Path, fd: int) -> tuple[str | None, bool]:
    """:func:`_data_file_problem` of ``fd``, looked at again under :data:`WRITE_LOCK` if there is one: between
    a commit and the extension of the file over its counted pages (see ``DiskTier._write_locked``) the file is
    short without being damaged, and a holder that died there left its lease written (the file is then
    extended here, as it would have done). Returns the problem left and whether it looked again; the lock is
    waited for at most :data:`CHECK_WAIT_S` (a stopped holder: "busy", the caller treats it as a miss)."""
    problem = _data_file_problem(fd)
    if problem is None:
        return None, False
    try:
        with _write_lock(directory, CHECK_WAIT_S, CHECK_WAIT_S) as left:
            settled = _data_file_problem(fd)
            counted = _counted_size(fd)
            if settled is not None and left and counted is not None and os.fstat(fd).st_size < counted:
                logger.warning("disk tier: %s/data.mdb left short by a dead writer (%s); extended", directory, left)
                with open(directory / "data.mdb", "r+b") as data:
                    os.ftruncate(data.fileno(), counted)
                settled = _data_file_problem(fd)
    except _LockBusy:
        return BUSY, True
    if settled is None:
        logger.debug("disk tier: %s/data.mdb looked short during a commit (%s); intact after it", directory, problem)
    return settled, True


CHECK_WAIT_S = 2.0  # seconds a check of a short data.mdb waits for the write lock before calling it a miss
BUSY = "being written by a process that holds the write lock"


class _LockBusy(KVBoostError):
    """Another process held :data:`WRITE_LOCK` longer than the wait allowed; ``holder`` describes its lease,
    ``stale`` says it is past the lease."""

    def __init__(self, holder: str, stale: bool, lease: str = ""):
        super().__init__(f"{WRITE_LOCK} held by {holder}")
        self.holder = holder
        self.stale = stale
        self.lease = lease  # the lease as written (one per taking of the lock)


@contextlib.contextmanager
def _write_lock(directory: Path, wait_s: float, lease_s: float) -> Iterator[str]:
    """Hold :data:`WRITE_LOCK` (``flock``, exclusive, on a descriptor of its own: threads of one process exclude
    each other too), waiting at most ``wait_s`` (:class:`_LockBusy` then). While held, the file holds the lease
    ``"pid start-ticks taken-at lease_s"``; it is emptied on release. Yields the lease a previous holder left
    (it died holding the lock: the kernel released its ``flock``), or ``""``."""
    fd = os.open(directory / WRITE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    lease = os.pread(fd, _LEASE_BYTES, 0).decode(errors="replace").strip()
                    raise _LockBusy(*_describe_lease(lease), lease) from None
                time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
                pause = min(pause * 2, 0.02)
        left = os.pread(fd, _LEASE_BYTES, 0).decode(errors="replace").strip()
        lease = f"{os.getpid()} {_start_ticks(os.getpid())} {time.time():.3f} {lease_s:g}"
        _write_lease(fd, lease)
        try:
            yield left
        finally:
            _write_lease(fd, "")  # a clean release; a holder that dies leaves its lease for the next one
    finally:
        os.close(fd)  # releases the lock


_LEASE_BYTES = 64


def _write_lease(fd: int, lease: str) -> None:
    """Overwrite the lease in place (fixed width: once allocated, a full file system cannot refuse it); a
    lease that cannot be written only leaves waiters less to report."""
    with contextlib.suppress(OSError):
        os.pwrite(fd, lease.encode().ljust(_LEASE_BYTES), 0)


def _start_ticks(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (tells a reused pid apart), or -1."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


def _describe_lease(lease: str) -> tuple[str, bool]:
    """A lease as text (pid, state, how long held) and whether it is past its term."""
    try:
        pid_text, ticks_text, taken_text, term_text = lease.split()
        pid, ticks, taken, term = int(pid_text), int(ticks_text), float(taken_text), float(term_text)
    except ValueError:
        return "an unknown holder", False
    held = time.time() - taken
    if _start_ticks(pid) != ticks:
        state = "gone"
    else:
        try:
            code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            code = "?"
        state = {"T": "stopped", "t": "stopped", "D": "in uninterruptible I/O", "Z": "a zombie"}.get(code, "running")
    return f"process {pid} ({state}, holding it {held:.1f} s, lease {term:g} s)", held > term


_open_envs: dict[str, list[Any]] = {}  # real path -> [environment or spill, users]: LMDB allows one per process
_open_envs_lock = threading.Lock()


def _acquire_env(directory: Path, map_size: int) -> Any:
    """The process's LMDB environment for ``directory``, opened on first use (tiers in one process share it)."""

    def open_env() -> Any:
        _check_files(directory)  # only here: closing a descriptor of a mapped lock file drops LMDB's locks
        return lmdb.open(os.path.realpath(directory), map_size=map_size, max_dbs=3, max_readers=_MAX_READERS)

    return _acquire(directory, open_env)


def _acquire(path: Path, opener: Any) -> Any:
    """The process's one open object (an environment, a :class:`_Spill`, a :class:`_SpillReader`) for ``path``,
    made by ``opener()`` on first use and shared by the tiers of the process until each released it."""
    real = os.path.realpath(path)
    with _open_envs_lock:
        held = _open_envs.get(real)
        if held is None:
            held = _open_envs[real] = [opener(), 0]
        held[1] += 1
        return held[0]


def _release_env(env: Any) -> None:
    """Give back what :func:`_acquire` returned; the last user closes it."""
    with _open_envs_lock:
        for path, held in list(_open_envs.items()):
            if held[0] is env:
                held[1] -= 1
                if not held[1]:
                    del _open_envs[path]
                    env.close()
                return


# ---------------------------------------------------------------------------------------------------- spills
SPILL_DIR = "writers"  # under the directory: one spill environment per process that needed one
OWNER_LOCK = "owner.lock"  # in a spill: flocked by its owner while open (free: the owner ended)
_SPILL_BYTES = b"\0bytes"  # spill key of its page-rounded record bytes
_SPILL_COUNT = b"\0count"  # spill key of its number of records
_SPILL_RECORD = b"r"  # spill key prefixes: record, tail note
_SPILL_TAIL = b"t"
_SPILL_SHARE = 4  # a spill holds at most max_bytes / 4 of records
MERGE_BATCH = 64  # spilled entries moved into the shared environment per commit
_RELIST_S = 1.0  # seconds after which writers/ is listed again even if its mtime did not change
_RECHECK_S = 0.05  # seconds a reading of writers/ is used before its mtime is looked at again
_READER_MAP_SIZE = 1 << 40  # address space a reader maps for a spill (never more than the file is read)


def _spill_name() -> str:
    """This process's spill name: pid and start time (a reused pid gets another name)."""
    return f"{os.getpid()}-{_start_ticks(os.getpid())}"


class _Spill:
    """This process's own environment under ``<directory>/writers/<pid>-<start ticks>``: what its tiers write
    while another process holds :data:`WRITE_LOCK` (stopped, hung, or just slow), so that no process can stop
    another one's writes. Only this process writes it (LMDB's writer mutex of this environment is never wanted
    by another process); every process reads it (:class:`_SpillReader`). Its records are codec records like
    the shared environment's (checksummed, keyed), one database: ``b"r" + key`` -> record, ``b"t" + parent``
    -> packed tail lengths, ``_SPILL_BYTES`` -> page-rounded record bytes (at most ``budget``), ``_SPILL_COUNT``
    -> records. The owner holds
    :data:`OWNER_LOCK` (``flock``) while open: a spill whose lock is free belongs to a process that ended and
    is adopted by the next holder of :data:`WRITE_LOCK` (merged into the shared environment, then removed).
    Thread-safe (one lock around every transaction)."""

    def __init__(self, directory: Path, budget: int) -> None:
        self.budget = budget
        self.path = directory / SPILL_DIR / _spill_name()
        staging = self.path if self.path.exists() else directory / SPILL_DIR / f".{self.path.name}.new"
        staging.mkdir(parents=True, exist_ok=True)
        self._owner = os.open(staging / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an adopter may be removing it: not now
            self.env = lmdb.open(str(staging), map_size=int(budget * _MAP_HEADROOM) + (16 << 20), max_dbs=0)
            self._data_fd = os.open(staging / "data.mdb", os.O_RDWR)
            if staging != self.path:
                os.replace(staging, self.path)  # readers list it only once it is a whole environment
                _sync_directory(self.path.parent)  # its name survives a power loss like its commits
        except BaseException:
            os.close(self._owner)
            raise
        self._page = self.env.stat()["psize"]

    def write(self, records: list[tuple[str, bytearray]], tails: list[tuple[str, frozenset[int]]]) -> int | None:
        """Commit ``records`` (already there: skipped) and the tail notes in one transaction, then read the
        records back from a new read transaction; the number that did not read back byte for byte, or None (and
        nothing written) when the records would take the spill past its budget."""
        with self._lock:
            txn = self.env.begin(write=True)
            try:
                used = _used(txn, None, _SPILL_BYTES)
                count = _used(txn, None, _SPILL_COUNT)
                fresh = [(k, r) for k, r in records if txn.get(_SPILL_RECORD + k.encode()) is None]
                used += sum(_pages(len(record), self._page) for _, record in fresh)
                if used > self.budget:
                    return None
                for parent, lengths in tails:
                    name = _SPILL_TAIL + parent.encode()
                    txn.put(name, _pack_lengths(_unpack_lengths(txn.get(name)) | set(lengths)))
                for k, record in fresh:
                    txn.put(_SPILL_RECORD + k.encode(), record)
                txn.put(_SPILL_BYTES, _U64.pack(used))
                txn.put(_SPILL_COUNT, _U64.pack(count + len(fresh)))
                txn.commit()
            finally:
                txn.abort()  # after a commit: nothing (the transaction is already done)
            self._extend_over_counted()
        with self.env.begin(buffers=True) as check:
            return sum(1 for k, record in records if check.get(_SPILL_RECORD + k.encode()) != record)

    def take(self, count: int) -> list[tuple[bytes, bytes]]:
        """Up to ``count`` entries (spill key, value), records and tail notes, in key order."""
        with self._lock, self.env.begin() as txn:
            out = []
            for name, value in txn.cursor():
                if name not in (_SPILL_BYTES, _SPILL_COUNT):
                    out.append((bytes(name), bytes(value)))
                    if len(out) == count:
                        break
            return out

    def remove(self, names: list[bytes]) -> None:
        """Delete entries (merged into the shared environment) and their bytes."""
        with self._lock, self.env.begin(write=True) as txn:
            used = _used(txn, None, _SPILL_BYTES)
            count = _used(txn, None, _SPILL_COUNT)
            for name in names:
                value = txn.pop(name)
                if value is not None and name.startswith(_SPILL_RECORD):
                    used -= _pages(len(value), self._page)
                    count -= 1
            txn.put(_SPILL_BYTES, _U64.pack(max(used, 0)))
            txn.put(_SPILL_COUNT, _U64.pack(max(count, 0)))
        self._extend_over_counted()

    def get(self, name: bytes) -> bytes | None:
        with self._lock, self.env.begin() as txn:
            value = txn.get(name)
            return None if value is None else bytes(value)

    def entries(self) -> int:
        """Records held."""
        with self._lock, self.env.begin() as txn:
            return _used(txn, None, _SPILL_COUNT)

    def _extend_over_counted(self) -> None:
        """As :meth:`DiskTier._extend_over_counted`: readers never find the file shorter than its counted pages."""
        counted = (self.env.info()["last_pgno"] + 1) * self._page
        if os.fstat(self._data_fd).st_size < counted:
            os.ftruncate(self._data_fd, counted)

    def close(self) -> None:
        """Close it; the spill stays on disk (adopted once this process ends, or by its next tier)."""
        self.env.close()
        os.close(self._data_fd)
        os.close(self._owner)  # releases the owner lock


class _SpillReader:
    """Another process's spill, opened read-only. Every read first checks, with ``pread``, that ``data.mdb``
    covers the pages its meta page counts (else a miss: the owner is between a commit and extending the file,
    or the file was damaged), so a short file is never mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data_fd = os.open(path / "data.mdb", os.O_RDONLY)
        try:
            self.env = lmdb.open(str(path), readonly=True, map_size=_READER_MAP_SIZE, max_dbs=0)
        except BaseException:
            os.close(self._data_fd)
            raise

    def get(self, name: bytes) -> bytes | None:
        if _data_file_problem(self._data_fd) is not None:
            return None
        with self.env.begin() as txn:
            value = txn.get(name)
            return None if value is None else bytes(value)

    def after(self, start: bytes, count: int) -> list[tuple[bytes, bytes]]:
        """Up to ``count`` entries after spill key ``start`` (b"" from the first), in key order."""
        if _data_file_problem(self._data_fd) is not None:
            return []
        with self.env.begin() as txn:
            cursor = txn.cursor()
            out: list[tuple[bytes, bytes]] = []
            if not (cursor.set_range(start) if start else cursor.first()):
                return out
            for name, value in cursor:
                name = bytes(name)
                if name != start and name not in (_SPILL_BYTES, _SPILL_COUNT):
                    out.append((name, bytes(value)))
                    if len(out) == count:
                        break
            return out

    def entries(self) -> int:
        if _data_file_problem(self._data_fd) is not None:
            return 0
        with self.env.begin() as txn:
            return _used(txn, None, _SPILL_COUNT)

    @contextlib.contextmanager
    def adoptable(self) -> Iterator[bool]:
        """Whether the process that wrote it ended (its owner lock was free); while True, this process holds
        the owner lock (no owner can come back to it meanwhile)."""
        try:
            fd = os.open(self.path / OWNER_LOCK, os.O_RDWR)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
            else:
                yield True
        finally:
            os.close(fd)

    def close(self) -> None:
        self.env.close()
        os.close(self._data_fd)


class _Truncated(KVBoostError):
    """``data.mdb`` is shorter than the pages LMDB would map, or is not an LMDB file: set it aside."""


# what makes data.mdb unusable as it is: set aside at open (a damaged page found later: at the next open)
_DAMAGED = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError, _Truncated)


class _Unusable(KVBoostError):
    """The directory cannot be opened safely as it is (damaged lock file, no room for it): disable the tier."""


_MAX_READERS = 1024
_META_OFFSET = 16  # page header (64-bit LMDB)
_META_HEAD = struct.Struct("<II")  # magic, version
_META_PAGE_SIZE = struct.Struct("<I")  # the free DB's md_pad: the page size, at meta offset 24
_META_TAIL = struct.Struct("<QQ")  # last page number, transaction id, at meta offset 120
_DATA_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_LOCK_HEADER = 128  # the lock file's header; reader slots of 64 bytes follow
_LOCK_SLOT = 64
_lock_signature: bytes | None = None


def _counted_size(fd: int) -> int | None:
    """Bytes the newest valid meta page of the data file ``fd`` counts (``(last page + 1) * page size``), or
    None when the meta pages cannot be read."""
    first = os.pread(fd, _META_OFFSET + 136, 0)
    if len(first) < _META_OFFSET + 136:
        return None
    page = _META_PAGE_SIZE.unpack_from(first, _META_OFFSET + 24)[0]
    if page < 512 or page & (page - 1):
        return None
    newest = (-1, -1)
    for meta in (first, os.pread(fd, _META_OFFSET + 136, page)):
        if len(meta) < _META_OFFSET + 136 or _META_HEAD.unpack_from(meta, _META_OFFSET) != (_DATA_MAGIC, _DATA_VERSION):
            return None
        last_page, txn = _META_TAIL.unpack_from(meta, _META_OFFSET + 120)
        newest = max(newest, (txn, last_page))
    return (newest[1] + 1) * page


def _data_file_problem(fd: int) -> str | None:
    """Why the data file open as ``fd`` must not be mapped, or None: not both meta pages present, a meta page
    without LMDB's magic and version, or fewer bytes than the pages the newest meta page counts. Read with
    ``pread``, never through a map. The meta pages are read before the size: a commit writes its pages before
    its meta page, so a size read afterwards covers them (read first, it could predate a commit's growth)."""
    first = os.pread(fd, _META_OFFSET + 136, 0)
    if len(first) < _META_OFFSET + 136:
        return f"{os.fstat(fd).st_size} bytes, shorter than a meta page"
    page = _META_PAGE_SIZE.unpack_from(first, _META_OFFSET + 24)[0]
    if page < 512 or page & (page - 1):
        return f"page size {page} in the first meta page"
    metas = [first, os.pread(fd, _META_OFFSET + 136, page)]
    size = os.fstat(fd).st_size
    if size < 2 * page or len(metas[1]) < _META_OFFSET + 136:
        return f"{size} bytes with page size {page}: the two meta pages are not there"
    newest = (-1, 0)
    for meta in metas:
        if _META_HEAD.unpack_from(meta, _META_OFFSET) != (_DATA_MAGIC, _DATA_VERSION):
            return "a meta page without LMDB's magic number and version"
        last_page, txn = _META_TAIL.unpack_from(meta, _META_OFFSET + 120)
        newest = max(newest, (txn, last_page))
    if size < (newest[1] + 1) * page:
        return f"{size} bytes, shorter than its {newest[1] + 1} used pages of {page} bytes"
    return None


def _check_files(directory: Path) -> None:
    """Refuse what would kill the process once LMDB maps it (SIGBUS, SIGABRT, a hang): a ``data.mdb`` shorter
    than its pages or not LMDB's (:class:`_Truncated`), a ``lock.mdb`` whose header is not what this LMDB
    writes, and a lock file whose pages cannot be allocated (a full file system: :class:`_Unusable`)."""
    data = directory / "data.mdb"
    if data.exists() and data.stat().st_size > 0:
        fd = os.open(data, os.O_RDONLY)
        try:
            problem, _ = _settled_data_file_problem(directory, fd)
        finally:
            os.close(fd)
        if problem == BUSY:
            raise _Unusable(f"{data} is {BUSY} past {CHECK_WAIT_S:g} s")
        if problem is not None:
            raise _Truncated(f"{data}: {problem}")
    lock = directory / "lock.mdb"
    problem = _shared_lock_problem(lock)
    if problem is not None:
        raise _Unusable(f"{lock} {problem} (remove it when no process uses {directory})")
    if not hasattr(os, "posix_fallocate"):  # not on macOS: the check is skipped there
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:  # LMDB maps the lock file and writes to it: unallocated pages on a full file system would be SIGBUS
        os.posix_fallocate(fd, 0, _LOCK_HEADER + _MAX_READERS * _LOCK_SLOT)
    except OSError as exc:
        raise _Unusable(f"cannot allocate {lock} ({exc.strerror}): is the file system full?") from exc
    finally:
        os.close(fd)


def _shared_lock_problem(lock: Path) -> str | None:
    """What is wrong with a lock file that another process holds, or None. A lock file nobody holds is not
    checked: LMDB rebuilds it on open whatever it contains. Call only while this process has no environment on
    it (closing any descriptor of the file drops the process's locks on it)."""
    if not lock.exists() or lock.stat().st_size == 0:
        return None
    size = lock.stat().st_size
    with open(lock, "r+b") as f:
        header = f.read(_LOCK_HEADER)
        try:  # the byte LMDB locks exclusively when it is alone on the file
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            return None
        except OSError:
            pass
    if len(header) < _LOCK_HEADER or header[:8] != _expected_lock_signature():
        return "is not a lock file of this LMDB build"
    if struct.unpack_from("<I", header, 56)[0] > (size - _LOCK_HEADER) // _LOCK_SLOT:
        return "counts more readers than it has slots"
    return None


def _expected_lock_signature() -> bytes:
    """Magic and format words that this process's LMDB writes at the start of a lock file (read once from a
    scratch environment)."""
    global _lock_signature
    if _lock_signature is None:
        with tempfile.TemporaryDirectory(prefix="kvboost-lmdb-") as scratch:
            lmdb.open(scratch, map_size=1 << 20, max_readers=_MAX_READERS).close()
            _lock_signature = (Path(scratch) / "lock.mdb").read_bytes()[:8]
    return _lock_signature


def _is_chunk(key: str, item: Any) -> bool:
    return item is not _DELETE and not key.startswith(_TAIL_PREFIX)


def _tail_name(parent_key: str) -> bytes:
    """LMDB key of a tail note (never empty: LMDB refuses empty keys; the start of a prompt has parent "")."""
    return b"t:" + parent_key.encode()


def _pages(length: int, page: int) -> int:
    return -(-length // page) * page


def _used(txn: Any, meta_db: Any, name: bytes = _BYTES) -> int:
    """Bytes in use as counted under ``name`` in ``meta_db`` (None: the default database)."""
    raw = txn.get(name) if meta_db is None else txn.get(name, db=meta_db)
    return _U64.unpack(raw)[0] if raw is not None and len(raw) == _U64.size else 0


def _by_eviction_order(txn: Any, db: Any) -> list[tuple[int, float, str]]:
    """``(hits, last use, key)`` of every entry, fewest hits then least recent first."""
    items = []
    for key, raw in txn.cursor(db=db):
        if key != _BYTES:  # a malformed value (never written by this code) goes first
            _, hits, last = _META.unpack(raw) if len(raw) == _META.size else (0, -1, 0.0)
            items.append((hits, last, bytes(key).decode(errors="replace")))
    items.sort()
    return items


def _sync_directory(path: Path) -> None:
    """``fsync`` a directory (its entries: a rename in it is durable once this returns)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unspilled(entries: list[tuple[bytes, bytes]]) -> tuple[list[tuple[str, bytearray]], list[tuple[str, Any]]]:
    """Spill entries as a commit takes them: ``(key, record)`` pairs and tail-note batch items."""
    records = [(name[1:].decode(), bytearray(value)) for name, value in entries if name.startswith(_SPILL_RECORD)]
    tails = [
        (_TAIL_PREFIX + name[1:].decode(), frozenset(_unpack_lengths(value)))
        for name, value in entries
        if name.startswith(_SPILL_TAIL)
    ]
    return records, tails


def _pack_lengths(lengths: set[int]) -> bytes:
    return struct.pack(f"<{len(lengths)}I", *sorted(lengths))


def _unpack_lengths(raw: bytes | None) -> set[int]:
    if not raw or len(raw) % 4:
        return set()
    return set(struct.unpack(f"<{len(raw) // 4}I", raw))
