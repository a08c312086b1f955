"""ChunkStore over its tiers: quantized RAM, demotion to disk and promotion back, restart, Redis write-through,
budgets, and namespace isolation in every tier."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from helpers import RedisServer, key, raw_entry
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvboost_hf import ChunkReuseCache
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.chunking import ChunkingConfig, chunk_spans
from kvboost_hf.core.keys import chain_prefix_keys, make_namespace
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig

DISK_BYTES = 1 << 20


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_bit_width_round_trips_in_the_put_dtype(bits: int, dtype: torch.dtype):
    store = ChunkStore(StoreConfig(1 << 20, kv_cache_bits=bits, kv_group_size=4))
    entry = raw_entry(dtype=dtype)
    store.put(key(1), entry)
    got = store.get(key(1))
    assert got is not None and got.keys.dtype == dtype and got.keys.shape == entry.keys.shape
    error = max(float((got.keys - entry.keys).abs().max()), float((got.values - entry.values).abs().max()))
    assert error == 0 if bits == 16 else 0 < error < (0.1 if bits == 8 else 1.0)


@pytest.mark.parametrize(("bits", "ratio"), [(8, 0.55), (4, 0.30)])
def test_ram_holds_the_quantized_form(bits: int, ratio: float):
    entry = ChunkKV(torch.randn(4, 3, 128, 64, dtype=torch.float16), torch.randn(4, 3, 128, 64, dtype=torch.float16))
    store = ChunkStore(StoreConfig(1 << 24, kv_cache_bits=bits))
    store.put(key(1), entry)
    assert store.stats()["ram_bytes"] <= ratio * entry.nbytes


@pytest.mark.parametrize("bits", [16, 4])
def test_every_put_reaches_disk_and_disk_hits_come_back(tmp_path: Path, bits: int):
    probe = ChunkStore(StoreConfig(1 << 20, kv_cache_bits=bits))
    probe.put(key(0), raw_entry())
    stored_size = probe.stats()["ram_bytes"]  # all entries have this size
    store = ChunkStore(
        StoreConfig(2 * stored_size, kv_cache_bits=bits, disk_cache_dir=tmp_path, disk_max_bytes=DISK_BYTES)
    )
    try:
        for i in range(6):
            store.put(key(i), raw_entry(seed=i))
        store.flush()
        stats = store.stats()
        assert stats["evictions"] == 4 and stats["disk_chunks"] == 6 and stats["disk_queued"] == 0
        for i in range(6):
            assert store.get(key(i)) is not None
        stats = store.stats()
        assert stats["disk_hits"] > 0 and stats["ram_hits"] + stats["disk_hits"] == 6 and stats["misses"] == 0
        assert store.get(key(0)) is not None and store.ram.contains(key(0))  # a disk hit is promoted
    finally:
        store.close()


def test_restart_keeps_entries(tmp_path: Path):
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path)) as store:
        for i in range(3):
            store.put(key(i), raw_entry(seed=i))  # all fit in RAM, and are written through to disk
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path)) as reopened:
        for i in range(3):
            got = reopened.get(key(i))
            assert got is not None and torch.equal(got.keys, raw_entry(seed=i).keys)
        assert reopened.stats()["disk_hits"] == 3


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 64)), min_size=1, max_size=40),
    ram_entries=st.integers(0, 4),
    bits=st.sampled_from([16, 8, 4]),
)
def test_budgets_hold(tmp_path_factory, ops, ram_entries: int, bits: int):
    ram_budget = ram_entries * raw_entry(tokens=32).nbytes
    store = ChunkStore(
        StoreConfig(
            ram_budget, kv_cache_bits=bits, disk_cache_dir=tmp_path_factory.mktemp("b"), disk_max_bytes=16 << 12
        )
    )
    try:
        for is_put, i, tokens in ops:
            if is_put:
                store.put(key(i), raw_entry(tokens=tokens, seed=i))
            else:
                store.get(key(i))
            stats = store.stats()
            assert stats["ram_bytes"] <= ram_budget and stats["disk_bytes"] <= 16 << 12
        store.flush()
        assert store.stats()["disk_bytes"] <= 16 << 12
    finally:
        store.close()


def test_pinned_entries_stay_in_ram():
    size = raw_entry().nbytes
    store = ChunkStore(StoreConfig(2 * size))
    store.put(key(0), raw_entry())
    assert store.pin(key(0)) and not store.pin(key(99))
    for i in range(1, 5):
        store.put(key(i), raw_entry(seed=i))
    assert store.ram.contains(key(0))
    store.unpin(key(0))


def test_invalid_settings():
    with pytest.raises(ValueError):
        ChunkStore(StoreConfig(kv_cache_bits=6))
    with pytest.raises(ValueError):
        ChunkStore(StoreConfig(kv_group_size=0))


def test_redis_write_through_promotion_and_outage(redis_server: RedisServer):
    writer = ChunkStore(StoreConfig(1 << 20, kv_cache_bits=8, remote_url=redis_server.url))
    writer.put(key(1), raw_entry())
    writer.close()
    reader = ChunkStore(StoreConfig(1 << 20, kv_cache_bits=8, remote_url=redis_server.url))
    try:
        first = reader.get(key(1))
        second = reader.get(key(1))
        assert first is not None and second is not None and torch.equal(first.keys, second.keys)
        stats = reader.stats()
        assert (stats["remote_hits"], stats["ram_hits"]) == (1, 1)
        redis_server.stop()
        assert reader.get(key(2)) is None  # a miss, not an exception
        reader.put(key(3), raw_entry(seed=3))
        assert reader.get(key(3)) is not None  # RAM still serves
        assert reader.stats()["remote_errors"] >= 1
    finally:
        reader.close(timeout_s=1)


def test_namespace_isolation_in_every_tier(tmp_path: Path, redis_server: RedisServer):
    """Chunks stored for one model are never found under another model's keys, in RAM, on disk or in Redis."""
    chunking = ChunkingConfig(chunk_size=16)
    tokens = list(range(1, 49))
    spans = chunk_spans(tokens, chunking)
    models = [make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)]
    keys_a, keys_b = (chain_prefix_keys(make_namespace(m, torch.float32, chunking), tokens, spans) for m in models)
    assert not set(keys_a) & set(keys_b)
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path, remote_url=redis_server.url)) as store:
        for i, k in enumerate(keys_a):
            store.put(k, raw_entry(seed=i))
        assert all(store.get(k) is None for k in keys_b)
    with ChunkStore(StoreConfig(0, disk_cache_dir=tmp_path, remote_url=redis_server.url)) as reopened:
        assert all(reopened.disk is not None and reopened.disk.get(k) is None for k in keys_b)
        assert all(reopened.remote is not None and reopened.remote.get(k) is None for k in keys_b)
        assert all(reopened.get(k) is not None for k in keys_a)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_store_serves_the_cache(bits: int):
    """End to end on a tiny Llama: the second call hits quantized chunks; int8 keeps greedy output."""
    model = make_tiny_model("llama")
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **options)
    store = ChunkStore(StoreConfig(1 << 24, kv_cache_bits=bits))
    for _ in range(2):
        cache = ChunkReuseCache(store, model, chunking=16)
        out = model.generate(ids, cache=cache, **options)
    assert cache.last_reuse[0].cached_tokens == 48
    assert out.shape == expected.shape
    if bits == 8:
        assert torch.equal(out, expected)


def _holding_five(redis_server: RedisServer) -> ChunkStore:
    """A store on ``redis_server`` holding 5 entries in RAM and Redis (outages retried after 0.2 s)."""
    holder = ChunkStore(StoreConfig(1 << 24, remote_url=redis_server.url))
    assert holder.remote is not None
    holder.remote.retry_after_s = 0.2
    for i in range(5):
        holder.put(key(i), raw_entry(seed=i))
    holder.flush()
    return holder


def test_redis_restarted_empty_is_repopulated_from_ram(redis_server: RedisServer):
    holder = _holding_five(redis_server)
    assert holder.remote is not None
    try:
        redis_server.stop()
        redis_server.start()  # a fresh, empty Redis on the same port
        assert holder.remote.check_restart()  # what the watcher thread does every few seconds
        deadline = time.monotonic() + 10
        newcomer = ChunkStore(StoreConfig(1 << 24, remote_url=redis_server.url))
        while newcomer.remote is not None and newcomer.remote.get_many([key(i) for i in range(5)]).count(None):
            assert time.monotonic() < deadline, "RAM entries were not published again"
            time.sleep(0.05)
        assert holder.stats()["remote_republished"] >= 5
        newcomer.close(timeout_s=1)
    finally:
        holder.close(timeout_s=1)


def test_clear_is_local_unless_remote_is_asked(tmp_path: Path, redis_server: RedisServer):
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path, remote_url=redis_server.url)) as store:
        store.put(key(1), raw_entry())
        store.flush()
        store.clear()
        assert not store.ram.contains(key(1)) and store.disk is not None and not store.disk.contains(key(1))
        assert redis_server.client().exists("kvboost:" + key(1))
        assert store.get(key(1)) is not None  # from Redis
        store.clear(remote=True)
        assert not redis_server.client().exists("kvboost:" + key(1)) and store.get(key(1)) is None


def test_two_replicas_share_tail_notes_through_redis(redis_server: RedisServer):
    first = ChunkStore(StoreConfig(1 << 20, remote_url=redis_server.url))
    second = ChunkStore(StoreConfig(1 << 20, remote_url=redis_server.url))
    try:
        first.note_tail("ab" * 32, 9)
        first.note_tail(None, 4)
        first.flush()
        second.note_tail("ab" * 32, 3)
        second.flush()
        assert second.tail_lengths("ab" * 32) == [9, 3] and second.tail_lengths(None) == [4]
        assert first.tail_lengths("ab" * 32) == [9, 3]
    finally:
        first.close(timeout_s=1)
        second.close(timeout_s=1)


def test_get_many_reads_every_tier_once(tmp_path: Path, redis_server: RedisServer):
    with ChunkStore(StoreConfig(1 << 20, remote_url=redis_server.url)) as writer:
        for i in range(4):
            writer.put(key(i), raw_entry(seed=i))
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path, remote_url=redis_server.url)) as store:
        store.put(key(0), raw_entry(seed=0))
        got = store.get_many([key(i) for i in range(6)])
        assert [g is not None for g in got] == [True] * 4 + [False] * 2
        for i in range(4):
            assert torch.equal(got[i].keys, raw_entry(seed=i).keys)
        stats = store.stats()
        assert (stats["ram_hits"], stats["remote_hits"], stats["misses"]) == (1, 3, 2)
        store.flush()
        assert store.stats()["disk_chunks"] == 4  # Redis hits are kept on disk too


def test_a_restart_seen_as_an_outage_is_published_again_once(redis_server: RedisServer):
    """A call fails while Redis restarts (an outage), the next succeeds (reconnected: RAM entries published),
    then the watcher sees the new run_id: it publishes nothing more (every entry was published twice)."""
    holder = _holding_five(redis_server)
    assert holder.remote is not None
    try:
        redis_server.stop()
        assert holder.remote.get(key(9)) is None  # a miss: the outage starts
        redis_server.start()
        deadline = time.monotonic() + 10
        while holder.remote.get(key(9)) is None and holder.stats()["remote_republished"] < 5:
            assert time.monotonic() < deadline, "RAM entries were not published again"
            time.sleep(0.25)
        assert holder.remote.check_restart()
        holder.flush()
        time.sleep(0.3)
        assert holder.stats()["remote_republished"] == 5
    finally:
        holder.close(timeout_s=1)
