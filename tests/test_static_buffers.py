"""Static K/V buffers kept across requests (:class:`~kvboost_hf.hf.static_buffers.StaticBufferPool`): a graphed
forward's cache gets the buffers the previous request's cache had (the CUDA graph replays at its recorded
addresses instead of re-recording each request, which torch stops doing after 128 re-records), never a buffer
something still uses, and a warm prompt's stored chunks are copied once, straight into them."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer

from kvboost_hf import ChunkStore, InferenceEngine
from kvboost_hf.bench.shapes import tokenizer_dir
from kvboost_hf.core.errors import InputError
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.graphs import GraphConfig
from kvboost_hf.hf.layers import ChunkReuseLayer
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.hf.static_buffers import StaticBufferPool
from kvboost_hf.store.config import StoreConfig

SHAPE = (2, 1, 2, 64, 8)
DOCUMENT = " ".join(f"line {index}: the reference text goes on." for index in range(25))


def test_a_buffer_comes_back_only_once_nothing_uses_it():
    pool = StaticBufferPool()
    first = pool.take(SHAPE, torch.float32, torch.device("cpu"))
    assert torch.count_nonzero(first) == 0  # fresh: zero-filled
    view = first[1, :, :, :5]
    ident = first.data_ptr()
    del first
    second = pool.take(SHAPE, torch.float32, torch.device("cpu"))
    assert second.data_ptr() != ident  # a view of the first is alive: never handed out twice
    del view
    third = pool.take(SHAPE, torch.float32, torch.device("cpu"))
    assert third.data_ptr() == ident and pool.reused == 1  # every user gone: the same buffer
    other_slot = pool.take(SHAPE, torch.float32, torch.device("cpu"), slot=1)
    assert other_slot.data_ptr() not in {ident, second.data_ptr()}
    assert pool.allocated == 3 and pool.kept_bytes == 3 * first_bytes()


def first_bytes() -> int:
    return torch.empty(SHAPE).nbytes


def test_a_buffer_held_in_a_reference_cycle_comes_back_after_a_collection():
    pool = StaticBufferPool()

    class Holder:
        pass

    holder = Holder()
    holder.me, holder.buffer = holder, pool.take(SHAPE, torch.float32, torch.device("cpu"))
    ident = holder.buffer.data_ptr()
    gc.disable()
    try:
        del holder  # garbage, but only the cycle collector frees it
        assert pool.take(SHAPE, torch.float32, torch.device("cpu")).data_ptr() == ident
    finally:
        gc.enable()


def test_a_full_shape_allocates_buffers_it_does_not_keep():
    pool = StaticBufferPool(max_per_shape=1)
    held = [pool.take(SHAPE, torch.float32, torch.device("cpu")) for _ in range(3)]
    assert pool.allocated == 3 and pool.kept_bytes == held[0].nbytes
    with pytest.raises(InputError, match="max_per_shape"):
        StaticBufferPool(max_per_shape=0)


def test_a_static_layer_in_a_reused_buffer_zeroes_the_columns_past_its_own():
    layer = ChunkReuseLayer()
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    layer.update(keys, values)
    stale = torch.randn(2, 1, 2, 16, 8), torch.randn(2, 1, 2, 16, 8)  # an earlier owner's K/V
    layer.set_max_cache_len(16, (stale[0][0], stale[1][0]))
    assert layer._key_buffer.data_ptr() == stale[0].data_ptr()  # the given buffer, not a fresh one
    assert torch.equal(stale[0][0, :, :, :5], keys) and torch.equal(stale[1][0, :, :, :5], values)
    assert torch.count_nonzero(stale[0][0, :, :, 5:]) == 0 and torch.count_nonzero(stale[1][0, :, :, 5:]) == 0
    assert torch.equal(layer.keys, keys)


def test_a_cache_turning_static_in_reused_stacks_zeroes_every_layers_columns_past_its_own():
    """The cache zeroes a reused stack's earlier contents past the held columns in one op for all layers (not two
    per layer: 56 launches on a 28-layer model), and fills every layer's device length, a view of the stack's."""
    model = make_tiny_model("llama")
    cache = ChunkReuseCache(ChunkStore(StoreConfig(1 << 24)), model, chunking=8)
    cache.static_buffers = StaticBufferPool()
    ids = torch.randint(1, 100, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, **{CACHE_ARGUMENT: cache}, use_cache=True)
    held = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    stacks = cache.static_stacks(1, 32)
    for stack in (stacks.keys, stacks.values, stacks.lengths):
        stack.fill_(7)  # an earlier owner's contents
    with ZeroingCounter() as zeroed:
        cache.set_max_cache_len(32, stacks)
    assert zeroed.calls == 2  # keys and values, whatever the layer count
    assert torch.count_nonzero(stacks.keys[..., 11:, :]) == torch.count_nonzero(stacks.values[..., 11:, :]) == 0
    for index, (layer, (keys, values)) in enumerate(zip(cache.layers, held, strict=True)):
        assert torch.equal(stacks.keys[index, ..., :11, :], keys) and torch.equal(layer.values, values)
    assert stacks.lengths.tolist() == [11] * len(cache.layers)


class ZeroingCounter(TorchDispatchMode):
    """Counts the ``zero_`` operations run while active."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.zero_.default
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engines():
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    model = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    options = {"chunking": 16, "store": ChunkStore(StoreConfig(1 << 26))}
    graphed = InferenceEngine(model, tokenizer, graphs=GraphConfig(enabled=True, backend="eager"), **options)
    options["store"] = ChunkStore(StoreConfig(1 << 26))
    eager = InferenceEngine(model, tokenizer, graphs=GraphConfig(enabled=False), **options)
    return graphed, eager


def test_warm_requests_reuse_the_static_buffers_with_the_eager_engines_tokens(engines, monkeypatch):
    """Each warm request's graphed prompt forward and decode steps run on the buffers the request before it used
    (the same addresses), its stored chunks copied into them once (no second copy when the cache turns static),
    with the tokens of an engine without graphs."""
    graphed, eager = engines
    copies: list[int] = []
    static_copy = ChunkReuseLayer._static_copy

    def counting(self, buffer, tensor):
        if buffer is None or tensor.data_ptr() != buffer.data_ptr():
            copies.append(tensor.shape[-2])
        return static_copy(self, buffer, tensor)

    monkeypatch.setattr(ChunkReuseLayer, "_static_copy", counting)
    lengths: list[list[int]] = []  # per request, the storage of every layer's device length once static
    set_max_cache_len = ChunkReuseCache.set_max_cache_len

    def recording(self, max_cache_len, stacks=None):
        set_max_cache_len(self, max_cache_len, stacks)
        if max_cache_len is not None:
            lengths.append([layer._device_length.untyped_storage().data_ptr() for layer in self.layers])

    monkeypatch.setattr(ChunkReuseCache, "set_max_cache_len", recording)
    addresses = []
    for index in range(4):
        prompt = f"{DOCUMENT}\nQuestion {index}: what does line {index} say?"
        copies.clear()
        result = graphed.generate(prompt, max_new_tokens=5)
        assert result.output_ids == eager.generate(prompt, max_new_tokens=5).output_ids
        if index:  # warm: the document's chunks loaded, the tail prefilled graphed
            assert result.cached_tokens > 0 and copies == []
        addresses.append(sorted(buffer.data_ptr() for kept in graphed.graphs.buffers._buffers.values()
                                for buffer in kept))  # fmt: skip
    stats = graphed.graphs.stats()
    assert stats["graphed_prefills"] == 3 and stats["eager_steps"] == 0
    assert stats["static_buffers_allocated"] == 3 and stats["static_buffers_reused"] == 9  # keys, values, lengths
    # each compile was followed by a collection, so no request collected for a buffer (~0.3 s each in a big process)
    assert graphed.graphs.buffers.collections == 0
    assert all(kept == addresses[0] for kept in addresses)
    # the device lengths a graph reads in place are views of one kept buffer too: a fresh scalar per request (as
    # before) moved whenever the allocator placed it elsewhere, and the graph re-recorded (an H200 run saw one)
    assert len(lengths) >= 4 and all(ptrs == [ptrs[0]] * len(ptrs) == lengths[0] for ptrs in lengths)
    assert lengths[0][0] in addresses[0]


def test_a_shape_whose_buffers_are_all_in_use_collects_once_until_one_comes_back():
    pool = StaticBufferPool(max_per_shape=1)
    held = pool.take(SHAPE, torch.float32, torch.device("cpu"))
    for _ in range(3):
        pool.take(SHAPE, torch.float32, torch.device("cpu"))
    assert pool.collections == 1 and pool.allocated == 4  # one futile collection, not one per take
    ident = held.data_ptr()
    del held
    again = pool.take(SHAPE, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == ident  # back by itself
    pool.take(SHAPE, torch.float32, torch.device("cpu"))
    assert pool.collections == 2  # a shape that got one back may collect again


def test_idle_buffers_past_the_cap_go_least_recently_taken_first():
    """The cap is applied at each take: idle buffers (no cache uses them) beyond it are dropped, those of the least
    recently taken shapes first; buffers in use never count."""
    tiny, small, large = ((1, 1, 2, columns, 8) for columns in (8, 16, 64))
    nbytes = {shape: torch.empty(shape).nbytes for shape in (tiny, small, large)}
    pool = StaticBufferPool(max_free_bytes=nbytes[large])
    pool.take(small, torch.float32, torch.device("cpu"))
    pool.take(large, torch.float32, torch.device("cpu"))  # both idle now, small the older
    in_use = pool.take(tiny, torch.float32, torch.device("cpu"))
    assert pool.dropped == 1 and pool.kept_bytes == nbytes[large] + nbytes[tiny]  # small went, large stayed
    assert pool.take(large, torch.float32, torch.device("cpu")).data_ptr() != in_use.data_ptr()
    assert pool.reused == 1


def test_an_allocation_out_of_memory_drops_the_idle_buffers_and_tries_again(monkeypatch):
    pool = StaticBufferPool()
    pool.take(SHAPE, torch.float32, torch.device("cpu"), slot=3)  # idle from here on
    zeros, failures = torch.zeros, []

    def out_of_memory_once(*args, **kwargs):
        if not failures:
            failures.append(pool.kept_bytes)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", out_of_memory_once)
    buffer = pool.take((4, 4), torch.float32, torch.device("cpu"))
    assert failures == [first_bytes()] and buffer.shape == (4, 4)
    assert pool.dropped == 1 and pool.kept_bytes == buffer.nbytes
