"""Disk tier (LMDB, written behind the requests): round trips, restart, budgets, several processes on one
directory, and damage of every kind (flipped bytes, truncation under an open store, garbage files, a writer
killed with SIGKILL) never yields wrong K/V nor fails the caller."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same, flip_inside_record, key, make_entry, python_child, run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store import codec
from kvboost_hf.store.disk import DiskTier


@pytest.fixture
def tier(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    yield disk
    disk.close()


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(tier: DiskTier, bits: int, dtype: torch.dtype):
    entries = {key(i): make_entry(tokens=20 + i, bits=bits, dtype=dtype, seed=i) for i in range(5)}
    for k, entry in entries.items():
        assert tier.put(k, entry) == []
        got = tier.get(k)  # served while queued, before the writer committed it
        assert got is not None
        assert_same(got, entry)
    assert tier.flush()
    assert tier.queued == 0 and len(tier) == 5
    for k, entry in entries.items():
        got = tier.get(k)
        assert got is not None
        assert_same(got, entry)
    assert tier.get(key(99)) is None and not tier.contains(key(99))


def test_restart_keeps_entries_hits_and_recency(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    for i in range(4):
        disk.put(key(i), make_entry(seed=i))
        disk.flush()  # distinct commit times: recency order 0, 1, 2, 3
    for _ in range(3):
        disk.get(key(0))
    disk.get(key(2))
    disk.close()
    reopened = DiskTier(tmp_path, max_bytes=1 << 20)
    try:
        assert reopened.eviction_order() == [key(1), key(3), key(2), key(0)]
        assert reopened.hits_of(key(0)) == 3
        for i in range(4):
            got = reopened.get(key(i))
            assert got is not None
            assert_same(got, make_entry(seed=i))
    finally:
        reopened.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=25),
    reads=st.lists(st.integers(0, 24), max_size=10),
)
def test_budget_holds_and_frequent_entries_survive(tmp_path_factory, sizes: list[int], reads: list[int]):
    disk = DiskTier(tmp_path_factory.mktemp("budget"), max_bytes=24 << 12)
    try:
        for i, tokens in enumerate(sizes):
            disk.put(key(i), make_entry(tokens=tokens, seed=i))
            for r in reads:
                if r < i:
                    disk.get(key(r))
            disk.flush()
            assert disk.nbytes <= disk.max_bytes
            too_big = len(codec.encode(key(i), make_entry(tokens=tokens, seed=i))) > disk.max_bytes
            assert disk.contains(key(i)) != too_big  # the newest entry is kept unless it cannot fit at all
        for k in disk.indexed_keys():
            got = disk.get(k)
            assert got is not None
            i = int(k, 16)
            assert_same(got, make_entry(tokens=sizes[i], seed=i))
    finally:
        disk.close()


def test_flipped_byte_is_dropped_and_logged(tmp_path: Path, caplog):
    entries = {i: make_entry(tokens=300, seed=i) for i in (1, 2)}
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    for i, entry in entries.items():
        disk.put(key(i), entry)
    disk.close()
    flip_inside_record(tmp_path, codec.encode(key(1), entries[1]), 5000)
    reopened = DiskTier(tmp_path, max_bytes=1 << 20)
    try:
        with caplog.at_level(logging.WARNING, logger="kvboost_hf.store.disk"):
            assert reopened.get(key(1)) is None
        assert "corrupt" in caplog.text and reopened.corrupt == 1
        reopened.flush()
        assert not reopened.contains(key(1))  # deleted
        got = reopened.get(key(2))
        assert got is not None
        assert_same(got, entries[2])
    finally:
        reopened.close()


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "lock_garbage"])
def test_damaged_files_open_and_serve_nothing_wrong(tmp_path: Path, damage: str):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    for i in range(6):
        disk.put(key(i), make_entry(tokens=200, seed=i))
    disk.close()
    data = tmp_path / "data.mdb"
    if damage == "garbage":
        data.write_bytes(os.urandom(data.stat().st_size))
    elif damage == "empty":
        data.write_bytes(b"")
    elif damage == "truncated":
        os.truncate(data, data.stat().st_size // 3)
    else:
        (tmp_path / "lock.mdb").write_bytes(os.urandom(4096))
    reopened = DiskTier(tmp_path, max_bytes=1 << 20)  # never raises
    try:
        served = 0
        for i in range(6):
            got = reopened.get(key(i))
            if got is not None:
                assert_same(got, make_entry(tokens=200, seed=i))
                served += 1
        assert served == (6 if damage == "lock_garbage" else 0)
        reopened.put(key(10), make_entry(seed=10))
        assert reopened.flush() and reopened.disabled is None
        assert reopened.get(key(10)) is not None
    finally:
        reopened.close()


_TRUNCATE_UNDER_OPEN_STORE = textwrap.dedent(
    """
    import os, sys
    from chunks import make_entry
    from kvboost_hf.store.disk import DiskTier

    disk = DiskTier(sys.argv[1], max_bytes=1 << 22)
    for i in range(8):
        disk.put(f"{i:064x}", make_entry(tokens=400, seed=i))
    disk.flush()
    os.truncate(os.path.join(sys.argv[1], "data.mdb"), 3 * 4096)
    served = sum(disk.get(f"{i:064x}") is not None for i in range(8))
    disk.put(f"{99:064x}", make_entry(seed=99))
    disk.flush()
    disk.close()
    print(served, disk.disabled is not None)
    """
)


def test_truncating_the_file_under_an_open_store_is_a_miss_not_sigbus(tmp_path: Path):
    done = run_python(_TRUNCATE_UNDER_OPEN_STORE, str(tmp_path))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["0", "True"]


_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from chunks import make_entry
    from kvboost_hf.store.disk import DiskTier

    directory, me, other, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    disk = DiskTier(directory, max_bytes=1 << 24)
    for i in range(n):
        disk.put(f"{me * 1000 + i:064x}", make_entry(tokens=100, seed=me * 1000 + i))
    disk.flush()
    seen, deadline = {}, time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        for i in range(n):
            k = other * 1000 + i
            got = disk.get(f"{k:064x}") if k not in seen else None
            if got is not None:
                want = make_entry(tokens=100, seed=k)
                seen[k] = bool((got.keys == want.keys).all() and (got.values == want.values).all())
        time.sleep(0.01)
    disk.close()
    print(json.dumps({"seen": len(seen), "exact": all(seen.values())}))
    """
)


def test_two_processes_share_one_directory(tmp_path: Path):
    n = 30
    procs = [python_child(_WORKER, tmp_path, a, b, n) for a, b in ((1, 2), (2, 1))]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results == [{"seen": n, "exact": True}] * 2
    disk = DiskTier(tmp_path, max_bytes=1 << 24)
    try:
        assert len(disk) == 2 * n
    finally:
        disk.close()


_SHARING_WRITER = textwrap.dedent(
    """
    import json, sys, threading
    from chunks import make_entry
    from kvboost_hf.store.disk import DiskTier

    directory, (me, rounds, per, max_bytes) = sys.argv[1], map(int, sys.argv[2:6])
    disk = DiskTier(directory, max_bytes=max_bytes)
    done = threading.Event()

    def check_while_writing() -> None:  # every read checks data.mdb while the writers (this one too) commit
        while not done.is_set():
            disk.contains("f" * 64)

    reader = threading.Thread(target=check_while_writing)
    reader.start()
    for r in range(rounds):
        for i in range(per):
            k = (me * 1000 + r) * 1000 + i
            disk.put(f"{k:064x}", make_entry(tokens=60 + k % 80, seed=k))
        disk.flush()
    done.set()
    reader.join()
    print(json.dumps({**disk.stats(), "reason": disk.disabled}))
    disk.close()
    """
)


@pytest.mark.parametrize("budget", ["roomy", "evicting"])
def test_processes_sharing_a_directory_keep_persisting(tmp_path: Path, budget: str):
    """Three processes write and flush 10 x 40 chunks each into one directory while a thread of each reads
    (every read checks data.mdb): none disables its tier, and everything flushed is on disk (roomy budget), or
    what is on disk fits the budget and reads back exactly (a budget of ~13 chunks: batches of 16 evict records
    they wrote, which leaves pages LMDB counts but never writes)."""
    processes, rounds, per = 3, 10, 40
    max_bytes = 1 << 28 if budget == "roomy" else 1 << 19
    procs = [python_child(_SHARING_WRITER, tmp_path, me, rounds, per, max_bytes) for me in range(1, processes + 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["reason"] is None and stats["errors"] == 0 and stats["dropped"] == 0, stats
    assert not (tmp_path / "data.mdb.damaged").exists()
    disk = DiskTier(tmp_path, max_bytes=max_bytes)
    try:
        keys = disk.indexed_keys()
        if budget == "roomy":
            assert len(keys) == processes * rounds * per
        else:
            assert keys and disk.nbytes <= max_bytes
        for k in keys:
            got = disk.get(k)
            assert got is not None
            assert_same(got, make_entry(tokens=60 + int(k, 16) % 80, seed=int(k, 16)))
        assert disk.disabled is None and disk.corrupt == 0
    finally:
        disk.close()


def test_batches_that_evict_their_own_records_stay_readable_after_a_restart(tmp_path: Path):
    """A batch larger than the budget evicts records it wrote itself: LMDB then counts pages it never wrote to
    data.mdb. The tier stays enabled, and a restart opens the file instead of setting it aside as truncated."""
    disk = DiskTier(tmp_path, max_bytes=200_000)
    for r in range(20):
        for i in range(20):
            disk.put(key(r * 100 + i), make_entry(tokens=100 + i, seed=i))
        assert disk.flush()
        assert disk.disabled is None, disk.disabled
    kept = disk.indexed_keys()
    disk.close()
    reopened = DiskTier(tmp_path, max_bytes=200_000)
    try:
        assert reopened.disabled is None and reopened.corrupt == 0
        assert reopened.indexed_keys() == kept and kept
        for k in kept:
            got = reopened.get(k)
            assert got is not None
            assert_same(got, make_entry(tokens=100 + int(k, 16) % 100, seed=int(k, 16) % 100))
    finally:
        reopened.close()


def test_a_short_file_seen_during_another_commit_is_looked_at_again(tmp_path: Path):
    """Between a commit and the extension of data.mdb over the pages it counts, the file is short without being
    damaged. Simulated here by a process holding the write lock with the file cut short for one second: a read
    meanwhile waits for the lock, finds the file whole, serves the entry and counts a recheck."""
    from kvboost_hf.store.disk import WRITE_LOCK

    disk = DiskTier(tmp_path, max_bytes=1 << 22)
    try:
        disk.put(key(1), make_entry(tokens=400, seed=1))
        assert disk.flush()
        holder = python_child(textwrap.dedent(f"""
                import fcntl, os, time
                from pathlib import Path
                directory = Path({str(tmp_path)!r})
                fd = os.open(directory / {WRITE_LOCK!r}, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
                data = directory / "data.mdb"
                whole = data.read_bytes()
                os.truncate(data, 2 * 4096)  # the meta pages stay: they count pages the file no longer has
                print("short", flush=True)
                time.sleep(1.0)
                data.write_bytes(whole)
                os.close(fd)
            """), stderr=None)  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline().strip() == "short"
        got = disk.get(key(1))
        holder.communicate(timeout=60)
        assert got is not None
        assert_same(got, make_entry(tokens=400, seed=1))
        assert disk.disabled is None and disk.rechecks == 1 and disk.stats()["rechecks"] == 1
    finally:
        disk.close()


_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from chunks import make_entry
    from kvboost_hf.store.disk import DiskTier

    disk = DiskTier(sys.argv[1], max_bytes=1 << 22)
    for i in range(5):
        disk.put(f"{i:064x}", make_entry(tokens=200 + i % 50, seed=i))
    disk.flush()
    print("ready", flush=True)
    i = 5
    while True:
        disk.put(f"{i:064x}", make_entry(tokens=200 + i % 50, seed=i))
        i += 1
    """
)


def test_opening_waits_while_another_process_creates_the_files(tmp_path: Path):
    """A process opening the directory holds its opening lock until data.mdb has its meta pages; a tier opened
    meanwhile (here: the lock held by another process with a half-written, 100-byte data.mdb, as during creation)
    waits for it instead of setting the file aside, then opens what that process finished."""
    from kvboost_hf.store.disk import OPENING_LOCK

    holder = python_child(textwrap.dedent(f"""
            import fcntl, os, sys, time
            from pathlib import Path
            from kvboost_hf.store.disk import DiskTier
            directory = Path({str(tmp_path)!r})
            fd = os.open(directory / {OPENING_LOCK!r}, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            (directory / "data.mdb").write_bytes(b"x" * 100)  # as LMDB creating the file, before its meta pages
            print("locked", flush=True)
            time.sleep(1.0)
            (directory / "data.mdb").unlink()
            os.close(fd)
            tier = DiskTier(directory, max_bytes=1 << 20)  # creates the real file
            tier.close()
            print("done", flush=True)
        """), stderr=None)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    try:
        assert disk.disabled is None and disk.corrupt == 0  # nothing set aside: it waited for the lock
        assert not (tmp_path / "data.mdb.damaged").exists()
        disk.put(key(1), make_entry())
        assert disk.flush() and disk.get(key(1)) is not None
    finally:
        disk.close()
        holder.communicate(timeout=60)


def test_writer_killed_at_any_moment_leaves_a_consistent_store(tmp_path: Path):
    delay_s = random.uniform(0.05, 1.0)  # any moment: the outcome must not depend on it
    proc = python_child(_KILLED_WRITER, tmp_path, stderr=None)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    disk = DiskTier(tmp_path, max_bytes=1 << 22)
    try:
        keys = disk.indexed_keys()
        assert len(keys) >= 5, "entries committed before the kill must survive it"
        for k in keys:
            got = disk.get(k)
            assert got is not None
            i = int(k, 16)
            assert_same(got, make_entry(tokens=200 + i % 50, seed=i))
        disk.put(key(10**6), make_entry(seed=5))
        disk.flush()
        assert disk.get(key(10**6)) is not None and disk.corrupt == 0
    finally:
        disk.close()


def test_use_after_close_is_a_miss(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    disk.put(key(1), make_entry())
    disk.close()
    disk.close()
    assert disk.get(key(1)) is None and not disk.contains(key(1)) and len(disk) == 0
    disk.put(key(2), make_entry())
    assert disk.tail_lengths("") == set()


def test_unopenable_directory_disables_the_tier(tmp_path: Path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="kvboost_hf.store.disk"):
        disk = DiskTier(blocker, max_bytes=1 << 20)
    assert disk.disabled is not None and "disabled" in caplog.text
    disk.put(key(1), make_entry())
    assert disk.get(key(1)) is None and disk.flush()
    disk.close()


def test_directory_deleted_while_open_disables_the_tier(tmp_path: Path, caplog):
    directory = tmp_path / "cache"
    disk = DiskTier(directory, max_bytes=1 << 20)
    disk.put(key(1), make_entry())
    disk.flush()
    for name in os.listdir(directory):
        os.unlink(directory / name)
    os.rmdir(directory)
    with caplog.at_level(logging.WARNING, logger="kvboost_hf.store.disk"):
        disk.put(key(2), make_entry(seed=2))
        disk.flush()
        assert disk.disabled is not None and disk.get(key(1)) is None
        disk.close()
    assert "deleted" in caplog.text


def test_tail_notes_survive_a_restart(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    disk.note_tail("ab" * 32, frozenset({5}))
    disk.note_tail("ab" * 32, frozenset({5, 9}))
    disk.note_tail("", frozenset({3}))
    assert disk.tail_lengths("ab" * 32) == {5, 9}
    disk.close()
    reopened = DiskTier(tmp_path, max_bytes=1 << 20)
    try:
        assert reopened.tail_lengths("ab" * 32) == {5, 9} and reopened.tail_lengths("") == {3}
        assert reopened.tail_lengths("cd" * 32) == set()
    finally:
        reopened.close()


def test_two_tiers_of_one_process_share_the_directory(tmp_path: Path):
    first = DiskTier(tmp_path, max_bytes=1 << 20)
    second = DiskTier(tmp_path, max_bytes=1 << 20)
    try:
        first.put(key(1), make_entry(seed=1))
        first.flush()
        got = second.get(key(1))
        assert got is not None
        assert_same(got, make_entry(seed=1))
        first.close()
        second.put(key(2), make_entry(seed=2))
        assert second.flush() and second.get(key(2)) is not None and second.get(key(1)) is not None
    finally:
        first.close()
        second.close()


def test_malformed_metadata_never_reaches_the_caller(tier: DiskTier):
    """Metadata this code never writes (wrong sizes) is treated as absent or as the first victim."""
    for i in range(3):
        tier.put(key(i), make_entry(seed=i))
    tier.flush()
    with tier._env.begin(write=True, db=tier._meta) as txn:  # damage the shared environment directly
        txn.put(key(1).encode(), b"short")
        txn.put(b"\0bytes", b"?")
    assert not tier.contains(key(1)) and tier.get(key(0)) is not None
    assert tier.eviction_order()[0] == key(1)  # the malformed entry is the first victim
    for i in range(5, 8):
        tier.put(key(i), make_entry(tokens=1500, seed=i))  # 576 KB records: each one forces evictions
        assert tier.flush()
    assert tier.errors == 0 and tier.contains(key(7)) and tier.nbytes <= tier.max_bytes


def test_an_entry_no_record_can_hold_is_lost_alone_and_flush_says_so(tier: DiskTier):
    """The codec refuses int32 K/V: that entry is counted lost (flush False); its batch-mates are committed (the
    batch was lost and flush said True)."""
    bad = ChunkKV(torch.zeros(2, 3, 4, 8, dtype=torch.int32), torch.zeros(2, 3, 4, 8, dtype=torch.int32))
    for i in range(6):
        tier.put(key(i), bad if i == 3 else make_entry(seed=i))
    assert not tier.flush(5)
    assert tier.stats()["lost"] == 1 and sorted(tier.indexed_keys()) == sorted(key(i) for i in (0, 1, 2, 4, 5))
    assert tier.flush(5)  # counted once


def test_an_entry_larger_than_the_tier_is_counted_lost(tmp_path: Path):
    with contextlib.closing(DiskTier(tmp_path, max_bytes=4096)) as tier:
        tier.put(key(1), make_entry(tokens=64))
        assert not tier.flush(5) and tier.stats()["lost"] == 1 and tier.indexed_keys() == []


def test_a_damaged_record_put_again_is_replaced(tmp_path: Path):
    """A read finds a record damaged (a miss; its delete is queued) and the chunk, recomputed, is put again before
    the delete ran: the put replaces the damaged record (it was skipped as stored, and every later read missed)."""
    with contextlib.closing(DiskTier(tmp_path, max_bytes=1 << 22)) as tier:
        tier.put(key(1), make_entry(seed=1))
        assert tier.flush(5)
    record = bytes(codec.encode(key(1), make_entry(seed=1)))
    data = bytearray((tmp_path / "data.mdb").read_bytes())
    at = data.find(record[200:264])
    data[at + 10] ^= 0xFF
    (tmp_path / "data.mdb").write_bytes(data)
    with contextlib.closing(DiskTier(tmp_path, max_bytes=1 << 22)) as tier:
        for i in range(100, 300):  # a busy writer: the delete still waits in the queue
            tier.put(key(i), make_entry(seed=i))
        assert tier.get(key(1)) is None and tier.corrupt == 1
        tier.put(key(1), make_entry(seed=1))
        assert tier.flush(30)
    with contextlib.closing(DiskTier(tmp_path, max_bytes=1 << 22)) as tier:
        got = tier.get(key(1))
        assert got is not None and tier.corrupt == 0
        assert_same(got, make_entry(seed=1))
