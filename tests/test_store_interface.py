"""The tier interface (issue #18): a tier defined outside the package plugs into ChunkStore unchanged; the
store's settings are one frozen StoreConfig; stats() never raises on a damaged tier (issue #22)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lmdb
import pytest
from chunks import DictTier
from helpers import assert_same, key, raw_entry

from kvboost_hf.store import ChunkStore, StoreConfig


def test_a_new_tier_plugs_in_without_changing_the_store():
    one = raw_entry().nbytes
    extra = DictTier()
    store = ChunkStore(StoreConfig(2 * one), tiers=[extra])
    for i in range(5):
        store.put(key(i), raw_entry(seed=i))
    assert len(store.ram) == 2 and len(extra) == 5  # written through; RAM keeps two
    assert store.contains_many([key(0), key(9)]) == [True, False]
    got = store.get(key(0))  # a hit below RAM, promoted
    assert got is not None and store.ram.contains(key(0))
    assert_same(got, raw_entry(seed=0))
    stats = store.stats()
    assert stats["dict_hits"] == 1 and stats["dict_chunks"] == 5 and stats["dict_bytes"] == 5 * one
    store.clear()
    assert len(extra) == 0 and store.get(key(1)) is None


def test_a_tier_that_lost_its_entries_gets_them_again():
    extra = DictTier()
    store = ChunkStore(StoreConfig(1 << 24), tiers=[extra])
    store.put(key(1), raw_entry())
    store.note_tail(key(1), 7)
    extra.clear()  # as a restarted server would
    assert extra.on_reconnect is not None
    extra.on_reconnect()
    assert extra.contains(key(1))


def test_store_config_is_one_frozen_set_of_defaults():
    config = StoreConfig(max_bytes=1 << 20, kv_cache_bits=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_bytes = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="kv_cache_bits"):
        StoreConfig(kv_cache_bits=3)
    store = ChunkStore(config)
    assert store.config == config and store.kv_cache_bits == 8 and store.ram.max_bytes == 1 << 20
    assert ChunkStore.from_config(config).config == config  # the spelling of earlier versions builds the same
    assert ChunkStore().config == StoreConfig()  # no settings: StoreConfig's defaults, written there only


def test_store_refuses_settings_that_are_not_a_store_config():
    """The fields of StoreConfig are not ChunkStore arguments (they were): a byte budget given in their place is
    refused with the spelling to use, not taken for a config."""
    with pytest.raises(TypeError, match=r"ChunkStore\(StoreConfig\(1048576\)\)"):
        ChunkStore(1 << 20)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ChunkStore(max_bytes=1 << 20)  # type: ignore[call-arg]


def test_stats_never_raise_on_a_damaged_tier(tmp_path: Path, monkeypatch, caplog):
    """A tier whose counters fail (LMDB pages damaged: lmdb raises reading them) is reported degraded and
    counted. Before: stats() raised, and /v1/warm and /metrics answered 500."""
    store = ChunkStore(StoreConfig(1 << 24, disk_cache_dir=tmp_path), tiers=[DictTier()])
    store.put(key(1), raw_entry())
    store.flush()
    disk = store.disk
    assert disk is not None

    def damaged(self: object) -> int:
        raise lmdb.CorruptedError("mdb_stat: MDB_CORRUPTED: Located page was wrong type")

    monkeypatch.setattr(type(disk), "__len__", damaged)
    with caplog.at_level("WARNING", logger="kvboost_hf.store.chunk_store"):
        first, second = store.stats(), store.stats()
    assert first["disk_degraded"] == 1 and first["stats_errors"] == 1 and second["stats_errors"] == 2
    assert first["dict_chunks"] == 1 and first["chunks"] == 1  # the other tiers still report
    assert caplog.text.count("reported degraded") == 1  # one warning, then debug lines
    store.close()
