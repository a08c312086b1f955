"""Landing chunks (``store/landing.py``): a put of CUDA K/V into page-locked RAM never waits on the device, and
no tier sees the host bytes before their copy completed. The CPU tests replace the copy by :class:`FakeCopy`,
whose host tensors hold zeros until it completes (so a tier that read them early would hold zeros)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
from chunks import DictTier
from helpers import assert_same, key, raw_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store import chunk_store, quantization
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig
from kvboost_hf.store.landing import BLOCK_ALIGN, Landing, start_landing

ENTRY_BYTES = raw_entry().nbytes


class FakeCopy:
    """A device-to-host copy in flight: ``host`` holds zeros until :meth:`finish` (or :meth:`synchronize`) copies
    ``source`` into it. Counts the waits; thread-safe."""

    def __init__(self, host: ChunkKV, source: ChunkKV) -> None:
        self.host, self.source = host, source
        self.complete = False
        self.waits = 0
        self._lock = threading.Lock()

    def finish(self) -> None:
        with self._lock:
            if not self.complete:
                self.host.keys.copy_(self.source.keys)
                self.host.values.copy_(self.source.values)
                self.complete = True

    def query(self) -> bool:
        with self._lock:
            return self.complete

    def synchronize(self) -> None:
        with self._lock:
            self.waits += 1
        self.finish()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeCopy]:
    """:func:`fake_landings` for one test."""
    return fake_landings(monkeypatch)


def fake_landings(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeCopy]:
    """Every store lands raw entries (as CUDA ones into pinned RAM): the copies started, by key (the last one)."""
    started: dict[str, FakeCopy] = {}

    def start(entry: ChunkKV, write_through: bool) -> Landing:
        host = ChunkKV(torch.zeros_like(entry.keys), torch.zeros_like(entry.values))
        copy = FakeCopy(host, entry)
        started[_key_of(entry)] = copy
        return Landing(host, copy, write_through)

    monkeypatch.setattr(chunk_store, "start_landing", start)
    return started


def _key_of(entry: ChunkKV) -> str:
    """The key the tests put ``raw_entry(seed=i)`` under: ``key(i)`` (seeds below 64)."""
    return next(key(i) for i in range(64) if torch.equal(raw_entry(seed=i).keys, entry.keys))


def landing_store(**options) -> ChunkStore:
    """A store whose RAM is page-locked (the landing path); 1 MiB of RAM unless told."""
    return ChunkStore(StoreConfig(**{"max_bytes": 1 << 20, "pin_memory": True, **options}))


def test_a_landing_chunk_is_contained_but_in_no_tier_until_its_copy_completes(copies, tmp_path: Path):
    store = landing_store(disk_cache_dir=tmp_path)
    try:
        store.put(key(0), raw_entry(seed=0))
        assert store.contains(key(0)) and store.contains_many([key(0), key(1)]) == [True, False]
        assert store.disk is not None and store.disk.flush()  # the disk tier's own queue: nothing was queued
        assert not store.ram.contains(key(0)) and not store.disk.contains(key(0))
        stats = store.stats()
        assert (stats["landing"], stats["landing_bytes"], stats["puts"], stats["ram_chunks"]) == (1, ENTRY_BYTES, 1, 0)
        copies[key(0)].finish()
        assert store.contains(key(0)) and store.ram.contains(key(0))  # the next operation landed it, no wait
        assert copies[key(0)].waits == 0 and store.stats()["landing"] == 0
        store.flush()
        on_disk = store.disk.get(key(0))
        assert on_disk is not None
        assert_same(on_disk, raw_entry(seed=0))  # written through from the landed bytes, not the zeros
    finally:
        store.close()


def test_a_get_of_a_landing_chunk_waits_for_its_copy_and_returns_the_exact_tensors(copies):
    store = landing_store()
    store.put(key(0), raw_entry(seed=0))
    store.put(key(1), raw_entry(seed=1))
    got = store.get(key(0))
    assert got is not None
    assert_same(got, raw_entry(seed=0))
    assert copies[key(0)].waits == 1 and copies[key(1)].waits == 0  # only the chunk read is waited for
    stats = store.stats()
    assert (stats["hits"], stats["ram_hits"], stats["misses"], stats["landing"]) == (1, 1, 0, 1)


def test_a_later_operation_lands_the_completed_copies_in_put_order_and_leaves_the_others(copies):
    store = landing_store()
    for i in range(3):
        store.put(key(i), raw_entry(seed=i))
    copies[key(2)].finish()
    copies[key(1)].finish()
    store.put(key(3), raw_entry(seed=3))
    assert [store.ram.contains(key(i)) for i in range(4)] == [False, True, True, False]
    assert store.ram.eviction_order() == [key(1), key(2)]  # put order, not completion order
    assert store.stats()["landing"] == 2 and all(copy.waits == 0 for copy in copies.values())


def test_flush_and_close_land_every_chunk_before_the_lower_tiers_write_it(copies, tmp_path: Path):
    with landing_store(disk_cache_dir=tmp_path) as store:
        for i in range(3):
            store.put(key(i), raw_entry(seed=i))
        store.flush()
        assert all(store.ram.contains(key(i)) for i in range(3)) and store.stats()["landing"] == 0
        assert [copies[key(i)].waits for i in range(3)] == [1, 1, 1]
        store.put(key(3), raw_entry(seed=3))  # landing when the store closes
    assert copies[key(3)].waits == 1
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path)) as reopened:
        for i in range(4):
            got = reopened.get(key(i))
            assert got is not None
            assert_same(got, raw_entry(seed=i))


def test_clear_drops_the_landing_chunks_once_their_copies_completed(copies):
    store = landing_store()
    store.put(key(0), raw_entry(seed=0))
    store.clear()
    assert copies[key(0)].waits == 1  # nothing is freed under a copy still writing it
    assert not store.contains(key(0)) and store.get(key(0)) is None and len(store.ram) == 0
    assert store.stats()["landing"] == 0


def test_a_landing_key_put_again_is_copied_once_and_counted_as_a_put(copies):
    store = landing_store()
    store.put(key(0), raw_entry(seed=0))
    store.put(key(0), raw_entry(seed=0))
    assert len(copies) == 1 and store.stats()["puts"] == 2 and store.stats()["landing"] == 1


def test_a_chunk_ram_refuses_counts_as_rejected_when_it_lands(copies):
    store = landing_store(max_bytes=ENTRY_BYTES - 1)
    store.put(key(0), raw_entry(seed=0))
    assert store.stats()["rejected"] == 0
    copies[key(0)].finish()
    stats = store.stats()
    assert (stats["rejected"], stats["puts"], stats["landing"], stats["ram_chunks"]) == (1, 1, 0, 0)


def test_a_gpu_tier_eviction_lands_in_ram_without_being_written_through_again(copies):
    remote = DictTier()
    remote.local = False  # as Redis: written once per put, never given RAM's evictions
    config = StoreConfig(ENTRY_BYTES, pin_memory=True, gpu_max_bytes=2 * ENTRY_BYTES, gpu_device="cpu")
    store = ChunkStore(config, tiers=[remote])
    store.put(key(0), raw_entry(seed=0))
    assert store.gpu is not None and store.gpu.contains(key(0)) and not store.ram.contains(key(0))  # GPU tier now
    store.put(key(1), raw_entry(seed=1))
    store.flush()  # both land in RAM, which keeps key 1 only
    assert store.ram.contains(key(1)) and not store.ram.contains(key(0)) and set(remote.entries) == {key(0), key(1)}
    remote.entries.clear()
    store.put(key(2), raw_entry(seed=2))  # the GPU tier evicts key 0, which RAM does not hold: it lands there
    assert store.stats()["landing"] == 2 and not store.gpu.contains(key(0))
    store.flush()
    assert store.ram.contains(key(0)) and list(remote.entries) == [key(2)]  # key 0 was not written through again
    held = store.ram.get(key(0))
    assert held is not None
    assert_same(held, raw_entry(seed=0))


def test_pinning_a_landing_chunk_the_gpu_tier_serves_lands_it_in_ram(copies):
    store = landing_store(gpu_max_bytes=ENTRY_BYTES, gpu_device="cpu")
    store.put(key(0), raw_entry(seed=0))
    got = store.get(key(0))  # served by the GPU tier: no wait for the copy into RAM
    assert got is not None and copies[key(0)].waits == 0 and store.stats()["landing"] == 1
    assert store.pin(key(0)) and store.ram.is_pinned(key(0)) and copies[key(0)].waits == 1


def test_quantized_puts_stay_synchronous(copies, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(quantization, "pinned_copy", torch.clone)  # no page-locked memory without CUDA
    store = landing_store(kv_cache_bits=8, kv_group_size=4)
    store.put(key(0), raw_entry(seed=0))
    assert copies == {} and store.ram.contains(key(0)) and store.stats()["landing"] == 0


def test_cpu_tensors_take_the_synchronous_path():
    assert start_landing(raw_entry(), write_through=True) is None
    store = ChunkStore(StoreConfig(1 << 20))  # no CUDA here: RAM is not page-locked
    store.put(key(0), raw_entry(seed=0))
    assert store.ram.contains(key(0)) and store.stats()["landing"] == 0


def test_concurrent_puts_gets_and_completions_keep_every_chunk_exact(copies):
    store = landing_store()
    threads_n, per_thread = 4, 12
    stop = threading.Event()
    errors: list[str] = []

    def complete_at_random() -> None:
        rng = random.Random(0)
        while not stop.wait(0.001):
            for copy in list(copies.values()):
                if rng.random() < 0.3:
                    copy.finish()

    def work(thread: int) -> None:
        for j in range(per_thread):
            i = thread * per_thread + j
            store.put(key(i), raw_entry(seed=i))
            if not store.contains(key(i)):
                errors.append(f"{i} not contained after its put")
            got = store.get(key(i)) if j % 3 == 0 else raw_entry(seed=i)
            if got is None or not torch.equal(got.values, raw_entry(seed=i).values):
                errors.append(f"{i} read back wrong")

    completer = threading.Thread(target=complete_at_random)
    completer.start()
    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop.set()
    completer.join()
    assert errors == []
    store.flush()
    total = threads_n * per_thread
    stats = store.stats()
    assert (stats["puts"], stats["landing"], stats["ram_chunks"], stats["misses"]) == (total, 0, total, 0)
    for i in range(total):
        got = store.get(key(i))
        assert got is not None
        assert_same(got, raw_entry(seed=i))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "finish", "get", "stats"]), st.integers(0, 5)), max_size=30))
def test_any_interleaving_serves_exact_chunks_and_holds_only_landed_bytes(operations):
    """Whatever the order of puts, completions and reads: every key put is contained, every read is its exact
    chunk, RAM never holds bytes whose copy did not complete, and ``landing`` counts the chunks not landed yet."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        copies = fake_landings(monkeypatch)
        store = landing_store()
        put: set[int] = set()
        for operation, i in operations:
            if operation == "put":
                store.put(key(i), raw_entry(seed=i))
                put.add(i)
            elif operation == "finish" and key(i) in copies:
                copies[key(i)].finish()
            elif operation == "get" and i in put:
                got = store.get(key(i))
                assert got is not None
                assert_same(got, raw_entry(seed=i))
            elif operation == "stats":
                assert store.stats()["landing"] == sum(not copies[key(j)].complete for j in put)
            assert all(store.contains(key(j)) for j in put)
            for held, entry in store.ram.items():
                assert_same(entry, raw_entry(seed=int(held, 16)))
        store.flush()
        assert store.stats()["landing"] == 0 and len(store.ram) == len(put)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_a_cuda_chunk_lands_through_one_pinned_block_bit_for_bit():
    """Keys and values of different dtypes and head dims share one page-locked block (values at an aligned offset);
    the copy is issued without a synchronisation and holds the device's bytes once its event completed."""
    import warnings

    keys = torch.randn(2, 3, 16, 8, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(2, 3, 16, 5, device="cuda", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            landing = start_landing(ChunkKV(keys, values), write_through=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert landing is not None
    host = landing.entry
    assert host.keys.is_pinned() and host.values.is_pinned()
    assert host.keys.untyped_storage().data_ptr() == host.values.untyped_storage().data_ptr()
    assert (host.values.data_ptr() - host.keys.data_ptr()) % BLOCK_ALIGN == 0
    landing.done.synchronize()
    assert landing.done.query()
    assert torch.equal(host.keys, keys.cpu()) and torch.equal(host.values, values.cpu())
