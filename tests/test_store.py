"""RAM tier: byte budget, frequency-then-recency eviction, pinning, thread safety, stats."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers import key as chunk_key
from helpers import raw_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig


def entry(tokens: int, fill: float = 0.0) -> ChunkKV:
    return ChunkKV(torch.full((2, 1, tokens, 4), fill), torch.full((2, 1, tokens, 4), fill))


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pin", "unpin"]), st.integers(0, 15), st.integers(1, 12)),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(0, 2000))
def test_budget_is_never_exceeded(operations, budget):
    store = ChunkStore(StoreConfig(budget))
    for op, key, tokens in operations:
        name = f"k{key}"
        if op == "put":
            store.put(name, entry(tokens))
        elif op == "get":
            store.get(name)
        elif op == "pin":
            store.pin(name)
        else:
            store.unpin(name)
        assert store.ram.nbytes <= budget
        assert store.stats()["ram_bytes"] == sum(stored.nbytes for _, stored in store.ram.items())


def test_eviction_prefers_rarely_used_then_least_recent():
    one = entry(4).nbytes
    store = ChunkStore(StoreConfig(3 * one))
    for key in ("system", "a", "b"):
        store.put(key, entry(4))
    for _ in range(3):
        store.get("system")  # the shared system prompt: read by every request
    store.get("a")
    store.put("c", entry(4))  # must evict "b": fewest hits
    assert not store.contains("b") and store.contains("system") and store.contains("a")
    store.put("d", entry(4))  # "a" (1 hit) stays over "c" (0 hits)
    assert not store.contains("c") and store.contains("a")
    assert store.ram.eviction_order()[-1] == "system"
    assert store.stats()["evictions"] == 2


def test_pinned_entries_are_never_evicted_and_full_pinned_store_refuses():
    one = entry(4).nbytes
    store = ChunkStore(StoreConfig(2 * one))
    store.put("a", entry(4))
    store.put("b", entry(4))
    assert store.pin("a") and store.pin("b")
    store.put("c", entry(4))
    assert store.contains("a") and store.contains("b") and not store.contains("c")
    assert store.stats()["rejected"] == 1
    store.unpin("a")
    store.put("c", entry(4))
    assert store.contains("c") and not store.contains("a")
    assert not store.pin("missing")


def test_oversized_entry_is_refused_without_evicting_others():
    store = ChunkStore(StoreConfig(entry(4).nbytes))
    store.put("small", entry(4))
    store.put("huge", entry(40))
    assert store.contains("small") and not store.contains("huge")


def test_hits_and_misses_are_counted():
    store = ChunkStore()
    store.put("a", entry(2, 1.0))
    assert torch.equal(store.get("a").keys, entry(2, 1.0).keys)
    assert store.get("nope") is None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["chunks"]) == (1, 1, 1)


def test_concurrent_use_keeps_accounting_exact():
    one = entry(3).nbytes
    store = ChunkStore(StoreConfig(10 * one))

    def worker(offset: int) -> None:
        for i in range(200):
            store.put(f"{offset}-{i % 25}", entry(3))
            store.get(f"{(offset + 1) % 4}-{i % 25}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.ram.nbytes == len(store.ram) * one <= 10 * one


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_bytes": "1GB"}, "max_bytes must be an integer >= 0"),
        ({"max_bytes": 1.5e9}, "max_bytes must be an integer >= 0"),
        ({"disk_max_bytes": 0}, "disk_max_bytes must be an integer >= 1"),
        ({"kv_group_size": 0}, "kv_group_size must be an integer >= 1"),
        ({"gpu_max_bytes": -1}, "gpu_max_bytes must be an integer >= 0"),
        ({"kv_cache_bits": "8"}, "kv_cache_bits must be 16, 8 or 4, got '8'"),
        ({"kv_cache_bits": 8.0}, "kv_cache_bits must be 16, 8 or 4, got 8.0"),  # accepted, then every put failed
        ({"kv_cache_bits": 4.0}, "kv_cache_bits must be 16, 8 or 4, got 4.0"),
        ({"kv_cache_bits": True}, "kv_cache_bits must be 16, 8 or 4, got True"),
        ({"remote_url": "localhost:6379"}, "a Redis URL must start with one of redis://"),
        ({"remote_ttl_s": -1}, "remote_ttl_s must be a number of seconds > 0"),
        ({"remote_read_timeout_s": float("nan")}, "remote_read_timeout_s must be a number of seconds > 0"),
    ],
)
def test_settings_of_the_wrong_type_or_range_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        StoreConfig(**settings)


def test_numpy_integers_are_byte_counts():
    assert StoreConfig(max_bytes=np.int64(1 << 20)).max_bytes == 1 << 20


def test_an_entry_the_unpinned_entries_cannot_make_room_for_evicts_nothing():
    """Two of three slots pinned, an entry of two slots: refused at once (an unpinned entry was evicted first)."""
    size = raw_entry().nbytes
    store = ChunkStore(StoreConfig(3 * size))
    for i in range(3):
        store.put(chunk_key(i), raw_entry(seed=i))
    store.pin(chunk_key(0))
    store.pin(chunk_key(1))
    store.put(chunk_key(9), raw_entry(tokens=32, seed=9))
    assert not store.ram.contains(chunk_key(9)) and store.ram.contains(chunk_key(2))
    assert store.stats()["rejected"] == 1 and store.stats()["evictions"] == 0


def test_an_entry_no_tier_can_encode_is_skipped_before_any_tier():
    """int32 K/V: skipped (counted), so it never joins, and fails, a disk or Redis batch."""
    store = ChunkStore(StoreConfig(1 << 20))
    integers = torch.zeros(1, 2, 4, 8, dtype=torch.int32)
    store.put(chunk_key(1), ChunkKV(integers, integers))
    assert store.stats()["skipped"] == 1 and not store.ram.contains(chunk_key(1))
