"""Disk tier: round trips, restart, budgets, and damage of every kind (flipped bytes, truncation, stale index,
a writer killed mid-write) never yields wrong K/V."""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import assert_same, make_entry

from kvboost_hf.store import codec
from kvboost_hf.store.disk import DiskTier

SLOT = mmap.PAGESIZE


def key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture
def tier(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    yield disk
    disk.close()


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(tier: DiskTier, bits: int, dtype: torch.dtype):
    entries = {key(i): make_entry(tokens=20 + i, bits=bits, dtype=dtype, seed=i) for i in range(5)}
    for k, entry in entries.items():
        assert tier.put(k, entry) == []
    for k, entry in entries.items():
        got = tier.get(k)
        assert got is not None
        assert_same(got, entry)
    assert tier.get(key(99)) is None and not tier.contains(key(99))


def test_restart_keeps_entries_hits_and_recency(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    for i in range(4):
        disk.put(key(i), make_entry(seed=i))
    for _ in range(3):
        disk.get(key(0))
    disk.get(key(2))
    order = disk.eviction_order()
    disk.close()
    reopened = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    try:
        assert reopened.eviction_order() == order == [key(1), key(3), key(2), key(0)]
        assert reopened.hits_of(key(0)) == 3
        for i in range(4):
            got = reopened.get(key(i))
            assert got is not None
            assert_same(got, make_entry(seed=i))
    finally:
        reopened.close()


def test_second_process_is_locked_out(tier: DiskTier, tmp_path: Path):
    with pytest.raises(RuntimeError, match="in use"):
        DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)


def test_other_geometry_starts_empty(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    disk.put(key(1), make_entry())
    disk.close()
    resized = DiskTier(tmp_path, max_bytes=32 * SLOT, slot_bytes=SLOT)
    try:
        assert len(resized) == 0 and resized.get(key(1)) is None
        assert os.path.getsize(tmp_path / "slots.bin") == 32 * SLOT
    finally:
        resized.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 160), min_size=1, max_size=30),
    reads=st.lists(st.integers(0, 29), max_size=20),
)
def test_budget_holds_and_frequent_entries_survive(tmp_path_factory, sizes: list[int], reads: list[int]):
    directory = tmp_path_factory.mktemp("budget")
    disk = DiskTier(directory, max_bytes=24 * SLOT, slot_bytes=SLOT)
    try:
        for i, tokens in enumerate(sizes):
            entry = make_entry(tokens=tokens, seed=i)
            refused = disk.put(key(i), entry)
            too_big = len(codec.encode(key(i), entry)) > disk.max_bytes
            assert (refused == [(key(i), entry)]) == too_big
            assert disk.nbytes <= disk.max_bytes
            for r in reads:
                if r < i:
                    disk.get(key(r))
        assert os.path.getsize(directory / "slots.bin") == disk.max_bytes
        for k in disk.indexed_keys():
            assert disk.get(k) is not None
    finally:
        disk.close()


def test_flipped_byte_is_dropped_and_logged(tmp_path: Path, caplog):
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    disk.put(key(1), make_entry(tokens=60))
    disk.put(key(2), make_entry(tokens=60, seed=2))
    slots = json.loads((tmp_path / "index.json").read_text())["entries"][key(1)]["slots"]
    disk.close()
    with open(tmp_path / "slots.bin", "r+b") as f:
        f.seek(slots[-1] * SLOT + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    reopened = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    try:
        with caplog.at_level(logging.WARNING, logger="kvboost_hf.store.disk"):
            assert reopened.get(key(1)) is None
        assert "corrupt" in caplog.text and reopened.corrupt == 1
        assert not reopened.contains(key(1))
        got = reopened.get(key(2))
        assert got is not None
        assert_same(got, make_entry(tokens=60, seed=2))
    finally:
        reopened.close()


def test_truncated_slot_file_never_serves_cut_entries(tmp_path: Path):
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    for i in range(6):
        disk.put(key(i), make_entry(tokens=40, seed=i))
    disk.close()
    with open(tmp_path / "slots.bin", "r+b") as f:
        f.truncate(7 * SLOT + 123)
    reopened = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    try:
        served = 0
        for i in range(6):
            got = reopened.get(key(i))
            if got is not None:
                assert_same(got, make_entry(tokens=40, seed=i))
                served += 1
        assert 0 < served < 6
        assert os.path.getsize(tmp_path / "slots.bin") == 64 * SLOT
    finally:
        reopened.close()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_damaged_index_opens_empty(tmp_path: Path, damage: str):
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    disk.put(key(1), make_entry())
    disk.close()
    index = tmp_path / "index.json"
    if damage == "truncate":
        index.write_bytes(index.read_bytes()[:40])
    elif damage == "garbage":
        index.write_text('{"format": 1, "entries": [1, 2]}')
    else:
        index.unlink()
    reopened = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    try:
        assert len(reopened) == 0 and reopened.get(key(1)) is None
        reopened.put(key(2), make_entry(seed=2))
        assert reopened.get(key(2)) is not None
    finally:
        reopened.close()


def test_stale_index_pointing_at_reused_slots(tmp_path: Path):
    """The index of an earlier moment names an entry whose slots now hold another: refused."""
    disk = DiskTier(tmp_path, max_bytes=8 * SLOT, slot_bytes=SLOT)
    disk.put(key(1), make_entry(tokens=60, seed=1))
    old_index = (tmp_path / "index.json").read_bytes()
    disk.delete(key(1))
    disk.put(key(2), make_entry(tokens=60, seed=2))  # reuses key 1's slots
    disk.close()
    (tmp_path / "index.json").write_bytes(old_index)
    reopened = DiskTier(tmp_path, max_bytes=8 * SLOT, slot_bytes=SLOT)
    try:
        assert reopened.get(key(1)) is None and reopened.get(key(2)) is None
    finally:
        reopened.close()


def test_record_copied_under_another_key_is_refused(tmp_path: Path):
    """Namespace isolation on disk: slots holding key A's record are never served as key B."""
    disk = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    disk.put(key(1), make_entry(seed=1))
    disk.put(key(2), make_entry(seed=2))
    index = json.loads((tmp_path / "index.json").read_text())
    disk.close()
    index["entries"][key(2)]["slots"] = index["entries"][key(1)]["slots"]
    index["entries"][key(2)]["length"] = index["entries"][key(1)]["length"]
    del index["entries"][key(1)]
    (tmp_path / "index.json").write_text(json.dumps(index))
    reopened = DiskTier(tmp_path, max_bytes=64 * SLOT, slot_bytes=SLOT)
    try:
        assert reopened.get(key(2)) is None
    finally:
        reopened.close()


_WRITER = textwrap.dedent(
    """
    import sys
    from test_codec import make_entry
    from kvboost_hf.store.disk import DiskTier

    disk = DiskTier(sys.argv[1], max_bytes=48 * 4096 * 4, slot_bytes=4096 * 4)
    print("ready", flush=True)
    i = 0
    while True:
        disk.put(f"{i:064x}", make_entry(tokens=200 + i % 50, seed=i))
        i += 1
    """
)


@pytest.mark.parametrize("delay_s", [0.3, 0.8])
def test_writer_killed_mid_write_leaves_a_consistent_store(tmp_path: Path, delay_s: float):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    disk = DiskTier(tmp_path, max_bytes=48 * 4096 * 4, slot_bytes=4096 * 4)
    try:
        keys = disk.indexed_keys()
        assert keys, "the writer should have completed some entries"
        for k in keys:
            got = disk.get(k)
            if got is not None:
                i = int(k, 16)
                assert_same(got, make_entry(tokens=200 + i % 50, seed=i))
        disk.put(key(10**6), make_entry(seed=5))
        assert disk.get(key(10**6)) is not None
    finally:
        disk.close()
