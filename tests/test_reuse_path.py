"""The warm path's data movement: cache layers with capacity, hits copied once into place, pinned RAM entries and
the GPU tier in front of RAM. CPU tests run the same code with the CUDA-only parts off (the GPU tier on the CPU
device); the ``gpu``-marked tests compare the CUDA paths with the CPU path on the same weights and stored K/V."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from kvboost_hf import ChunkReuseCache, ChunkStore, StoreConfig
from kvboost_hf.bench.profiling import CopyCounter
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.hf.layers import GROWTH_MIN_TOKENS, ChunkReuseLayer, grown_capacity
from kvboost_hf.hf.prefill import forward
from kvboost_hf.reuse.plan import Hit
from kvboost_hf.reuse.stitch import write_leading_runs

CHUNK = 128
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 2, length, 4, generator=generator) for _ in range(2))  # type: ignore[return-value]


operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 300)),
        st.tuples(st.just("crop"), st.integers(-40, 0)),
        st.tuples(st.just("select"), st.just(0)),
        st.tuples(st.just("repeat"), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_layer_with_capacity_behaves_like_dynamic_layer(steps):
    """Any sequence of appends, crops and batch operations leaves the same K/V as transformers' DynamicLayer."""
    ours, reference = ChunkReuseLayer(), DynamicLayer()
    batch = 2
    for index, (operation, amount) in enumerate(steps):
        if operation == "update":
            keys, values = _kv(batch, amount, index)
            got, expected = ours.update(keys, values), reference.update(keys, values)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        elif operation == "crop":
            ours.crop(amount)
            reference.crop(amount)
        elif not reference.get_seq_length():
            continue  # batch operations on an empty layer are no-ops for both
        elif operation == "select" and batch > 1:
            ours.batch_select_indices(torch.tensor([1]))
            reference.batch_select_indices(torch.tensor([1]))
            batch = 1
        elif operation == "repeat" and batch < 4:
            ours.batch_repeat_interleave(2)
            reference.batch_repeat_interleave(2)
            batch *= 2
        assert ours.get_seq_length() == reference.get_seq_length()
        if reference.get_seq_length():
            assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)


def test_handed_tensors_are_never_written():
    """The first forward's K/V are adopted without a copy; crop + append then moves them into an owned buffer."""
    layer = ChunkReuseLayer()
    keys, values = _kv(1, 10, 0)
    before = keys.clone(), values.clone()
    layer.update(keys, values)
    assert layer.keys.data_ptr() == keys.data_ptr() and not layer.owned
    layer.crop(-4)
    layer.update(*_kv(1, 3, 1))
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])
    assert layer.owned and layer.capacity == grown_capacity(9, 10) and layer.get_seq_length() == 9


def test_growth_is_geometric_and_bounded():
    assert grown_capacity(1) == GROWTH_MIN_TOKENS + 64
    assert grown_capacity(32_000) >= 36_000 and grown_capacity(32_000) <= 32_000 * 1.13
    layer = ChunkReuseLayer()
    layer.update(*_kv(1, 2000, 0))
    growths = 0
    for step in range(1500):
        capacity = layer.capacity
        layer.update(*_kv(1, 1, step))
        growths += layer.capacity != capacity
    assert 1 <= growths <= 6  # 2,000 -> 3,500 columns: a few geometric growths, not one per step


def _entry(layers: int, tokens: int, seed: int) -> ChunkKV:
    generator = torch.Generator().manual_seed(seed)
    return ChunkKV(*(torch.randn(layers, 2, tokens, 4, generator=generator) for _ in range(2)))


def test_leading_runs_write_each_hit_once_into_place():
    hits = [Hit((0, 4), _entry(3, 4, 0), True), Hit((4, 8), _entry(3, 4, 1), True)]
    keys, values = torch.full((3, 2, 2, 16, 4), float("nan")), torch.full((3, 2, 2, 16, 4), float("nan"))
    copied = write_leading_runs(keys, values, [hits, hits], pads=[0, 4], start=0, stop=8)
    assert copied == 2 * (8 + 4) * 3 * 2 * 4 * 4  # K and V, 8 + 4 tokens, fp32
    expected = torch.cat([hit.entry.keys for hit in hits], dim=2)
    assert torch.equal(keys[:, 0, :, :8], expected)
    assert torch.equal(keys[:, 1, :, :4], torch.zeros(3, 2, 4, 4))  # left padding is zeros, never garbage
    assert torch.equal(values[:, 1, :, 4:8], hits[0].entry.values)
    with pytest.raises(ValueError, match="cover"):
        write_leading_runs(keys, values, [[hits[1]]], pads=[0], start=0, stop=8)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", max_position_embeddings=4096)


def _greedy(model, cache, ids: torch.Tensor, steps: int) -> tuple[list[int], list[int]]:
    """Greedy tokens through ``cache`` and the bytes each decode step copied (CopyCounter)."""
    out = forward(model, cache, input_ids=ids, logits_to_keep=1)
    tokens, copied = [int(out.logits[0, -1].argmax())], []
    for _ in range(steps - 1):
        with CopyCounter() as counter:
            out = forward(model, cache, input_ids=torch.tensor([[tokens[-1]]], device=ids.device), logits_to_keep=1)
        tokens.append(int(out.logits[0, -1].argmax()))
        copied.append(counter.total)
    return tokens, copied


def test_warm_prompt_copies_reused_bytes_once_and_decode_steps_copy_their_own(tiny):
    """Issue targets on CPU: a warm 2k-token prompt copies <= 1.2x its reused K/V bytes, and a decode step copies
    <= 5% of the context's K/V bytes (amortized over steps that include a growth of the buffers)."""
    store = ChunkStore()
    document = torch.randint(1, 100, (1, 2048), generator=torch.Generator().manual_seed(0))
    cold = ChunkReuseCache(store, tiny, CHUNK, adapter=False)
    forward(tiny, cold, input_ids=document, logits_to_keep=1)
    cold.save()
    prompt = torch.cat([document, torch.randint(1, 100, (1, 16))], dim=1)
    warm = ChunkReuseCache(store, tiny, CHUNK, adapter=False)
    with CopyCounter() as counter:
        forward(tiny, warm, input_ids=prompt, logits_to_keep=1)
    assert warm.stitched_bytes == 2 * 2048 * 2 * 2 * 16 * 4  # K+V, tokens, layers, kv heads, head dim, fp32
    assert counter.total <= 1.2 * warm.stitched_bytes, dict(counter.bytes)
    copied = []
    token = torch.tensor([[5]])
    for _ in range(400):  # past the reserved room: at least one growth inside the window
        with CopyCounter() as counter:
            out = forward(tiny, warm, input_ids=token, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        copied.append(counter.total)
    context_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in warm.layers)
    assert max(copied) > 0.5 * context_bytes  # a growth happened inside the window (it copies the context once)
    assert sum(copied) / len(copied) <= 0.05 * context_bytes


def test_capacity_cache_generates_like_dynamic_cache(tiny):
    """Warm and cold greedy decoding through the capacity layers equal transformers' own generate()."""
    store = ChunkStore()
    prompt = torch.randint(1, 100, (1, 700), generator=torch.Generator().manual_seed(3))
    expected = tiny.generate(prompt, max_new_tokens=12, do_sample=False)[0, 700:].tolist()
    for _ in range(2):  # cold, then warm
        cache = ChunkReuseCache(store, tiny, CHUNK, adapter=False)
        tokens, _ = _greedy(tiny, cache, prompt, 12)
        cache.save()
        assert tokens == expected


def test_gpu_tier_policy_on_the_cpu_device():
    """The GPU tier in front of RAM (here on the CPU device): puts go to both, a RAM hit is promoted, the tier's
    evictions stay readable from RAM, and its counters are reported."""
    entry_bytes = _entry(2, 8, 0).nbytes
    store = ChunkStore(StoreConfig(gpu_max_bytes=2 * entry_bytes, gpu_device="cpu"))
    assert store.gpu is not None and [tier.name for tier in store.tiers] == ["gpu", "ram"]
    entries = {f"k{i}": _entry(2, 8, i) for i in range(3)}
    for key, entry in entries.items():
        store.put(key, entry)
    assert len(store.gpu) == 2 and len(store.ram) == 3  # k0 was evicted from the GPU tier, RAM keeps all
    assert not store.gpu.contains("k0")
    got = store.get("k0")
    assert got is not None and torch.equal(got.keys, entries["k0"].keys)
    assert store.gpu.contains("k0")  # promoted on hit
    stats = store.stats()
    assert stats["ram_hits"] == 1 and stats["gpu_bytes"] == 2 * entry_bytes
    assert store.get("k0") is not None and store.stats()["gpu_hits"] == 1


def test_quantized_store_dequantizes_where_asked():
    store = ChunkStore(StoreConfig(kv_cache_bits=8))
    entry = _entry(3, 64, 5)
    store.put("k", entry)
    here, asked = store.get("k"), store.get("k", torch.device("cpu"))
    assert here is not None and asked is not None and torch.equal(here.keys, asked.keys)
    torch.testing.assert_close(asked.keys, entry.keys, rtol=0, atol=0.05)


def test_gpu_tier_is_sized_only_for_a_cuda_model():
    config = StoreConfig()
    assert config.for_model_device(torch.device("cpu")) is config
    assert StoreConfig(gpu_max_bytes=0).for_model_device(torch.device("cuda")).gpu_max_bytes == 0
    sized = StoreConfig(gpu_max_bytes=1 << 20).for_model_device(torch.device("cuda", 0))
    assert sized.gpu_max_bytes == 1 << 20 and sized.gpu_device == torch.device("cuda", 0)  # placed on the model's
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="gpu_device"):
            ChunkStore(StoreConfig(gpu_max_bytes=1 << 20))
    with pytest.raises(ValueError, match="gpu_max_bytes"):
        StoreConfig(gpu_max_bytes=-1)
    assert not StoreConfig(pin_memory=None).pins_memory or torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- on a GPU
def _cuda_twin(model):
    """The same weights on CUDA (built once on the CPU, then copied: seeds draw differently per device)."""
    return copy.deepcopy(model).to("cuda")


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("tier", ["pinned_ram", "gpu_tier"])
def test_warm_from_each_cuda_tier_equals_a_full_prefill(tiny, tier):
    """Same weights on CUDA: the warm path (pinned RAM or GPU tier, asynchronous copies) gives the tokens of a full
    prefill through transformers' own cache, over back-to-back requests (no race between copies and forwards), and
    stores the K/V the CPU path stores (up to CUDA's rounding)."""
    prompt = torch.randint(1, 100, (1, 1500), generator=torch.Generator().manual_seed(4))
    model = _cuda_twin(tiny)
    with torch.no_grad():
        expected = model.generate(prompt.cuda(), max_new_tokens=10, do_sample=False)[0, 1500:].tolist()
    config = StoreConfig(gpu_max_bytes=0) if tier == "pinned_ram" else StoreConfig(gpu_max_bytes=1 << 30)
    store = ChunkStore(config.for_model_device(torch.device("cuda")))
    assert store.pin_memory and (store.gpu is None) == (tier == "pinned_ram")
    for request in range(6):
        cache = ChunkReuseCache(store, model, CHUNK, adapter=False)
        tokens, _ = _greedy(model, cache, prompt.cuda(), 10)
        cache.save()
        assert tokens == expected, f"request {request}"
        assert request == 0 or cache.last_reuse[0].cached_tokens >= 1408
    key, stored = next(iter(store.ram.items()))
    assert isinstance(stored, ChunkKV) and stored.keys.is_pinned()
    cpu_store = ChunkStore()
    cpu_cache = ChunkReuseCache(cpu_store, tiny, CHUNK, adapter=False)
    _greedy(tiny, cpu_cache, prompt, 1)
    cpu_cache.save()
    cpu_entry = cpu_store.get(key)
    assert cpu_entry is not None
    torch.testing.assert_close(stored.keys, cpu_entry.keys, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@CUDA_ONLY
def test_quantized_entries_are_dequantized_on_the_device_they_are_needed():
    """An int8 store keeps compressed bytes (pinned); a lookup for CUDA copies those and dequantizes there, equal
    to the CPU dequantization."""
    store = ChunkStore(StoreConfig(kv_cache_bits=8, gpu_max_bytes=0))
    entry = _entry(3, 64, 5)
    store.put("k", entry)
    assert store.pin_memory
    on_cpu, on_gpu = store.get("k"), store.get("k", torch.device("cuda"))
    assert on_cpu is not None and on_gpu is not None and on_gpu.keys.device.type == "cuda"
    torch.testing.assert_close(on_gpu.keys.cpu(), on_cpu.keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(on_gpu.values.cpu(), on_cpu.values, rtol=0, atol=1e-6)
