"""Layer streaming on CPU (synchronous copies, same code as on CUDA): streamed output equals resident output."""

from __future__ import annotations

import pytest
import torch
from conftest import explode_once, greedy, make_tiny_model
from oracle import engine_reference

from kvboost_hf import ChunkReuseCache, ChunkStore, RepairConfig
from kvboost_hf.core.errors import ArgumentTypeError
from kvboost_hf.core.keys import model_digest
from kvboost_hf.offload import (
    LayerStreamingConfig,
    decoder_layers,
    disable_layer_streaming,
    enable_layer_streaming,
    layer_streamer,
)
from kvboost_hf.store.config import StoreConfig

LAYERS = 6
CHUNK = 16


def model_pair(arch: str = "llama", **settings):
    """A resident tiny model and a streamed copy of the same weights."""
    resident = make_tiny_model(arch, num_hidden_layers=LAYERS)
    streamed = make_tiny_model(arch, num_hidden_layers=LAYERS)
    return resident, streamed, enable_layer_streaming(streamed, LayerStreamingConfig(**settings))


def reuse_cache(store, model, starts=(), strategy=None, write_back=True):
    """A ChunkReuseCache with chunks of CHUNK tokens (``strategy``: repair 30% of the reused tokens that way)."""
    repair = RepairConfig(strategy, 0.3) if strategy else None
    return ChunkReuseCache(store, model, CHUNK, repair, segment_starts=starts, write_back=write_back)


def prompt(length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def tensor_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


# streamed counts 6, 5 (odd), 5 (odd, 3 slots), 4 (single slot: no prefetch), 2 (fewer than 3 slots), 0
CASES = [(0, 0, 2), (0, 1, 2), (1, 0, 3), (1, 1, 1), (2, 2, 3), (3, 3, 2)]


@pytest.mark.parametrize(
    ("arch", "first", "last", "slots"), [("llama", *case) for case in CASES] + [("gemma2", 0, 1, 2)]
)
def test_streamed_equals_resident(arch, first, last, slots):
    resident, streamed, handle = model_pair(arch, keep_first_k=first, keep_last_k=last, num_slots=slots)
    assert handle.streamed_indices == list(range(first, LAYERS - last))
    ids = prompt()
    expected, expected_logits = greedy(resident, ids)
    got, logits = greedy(streamed, ids)
    assert torch.equal(got, expected)
    assert torch.equal(logits, expected_logits)


def test_each_use_reads_a_fresh_copy_nan_filled_slots_change_nothing():
    """Fill a layer's slot with NaN bytes right after the layer ran: nothing may read it before it is recopied."""
    resident, streamed, handle = model_pair(keep_first_k=1, keep_last_k=0, num_slots=2)  # 5 streamed: odd
    used_pointer: dict[int, int] = {}
    fills = []

    def record(index: int):
        def hook(module, args):
            used_pointer[index] = next(module.parameters()).data_ptr()  # inside the layer: bound to its slot

        return hook

    def poison(index: int):
        def hook(module, args, output):
            pointer = used_pointer.pop(index)
            slot = next(s for s in handle.slots if s.data_ptr() <= pointer < s.data_ptr() + s.numel())
            slot.fill_(255)  # 0xFF bytes: NaN in every float format
            fills.append(index)

        return hook

    for index in handle.streamed_indices:
        layer = decoder_layers(streamed)[index]
        layer.self_attn.register_forward_pre_hook(record(index))
        layer.register_forward_hook(poison(index))
    ids = prompt()
    expected, expected_logits = greedy(resident, ids, new=10)
    got, logits = greedy(streamed, ids, new=10)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    assert len(fills) == 10 * len(handle.streamed_indices)  # every use of every streamed layer was poisoned after


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_bytes_per_forward_are_the_streamed_layers_and_resident_parts_never_stream(slots):
    _, streamed, handle = model_pair(keep_first_k=2, keep_last_k=1, num_slots=slots)
    layers = decoder_layers(streamed)
    per_forward = sum(tensor_bytes(layers[i]) for i in handle.streamed_indices)
    stats = handle.stats()
    assert stats.bytes_per_forward == per_forward
    assert stats.streamed_layers == 3 and stats.resident_layers == 3
    assert stats.resident_bytes == tensor_bytes(streamed) - per_forward  # embeddings, norm, lm_head, 3 layers
    assert stats.slot_bytes >= slots * max(tensor_bytes(layers[i]) for i in handle.streamed_indices)
    new = 6
    greedy(streamed, prompt(), new=new)
    stats = handle.stats()
    assert stats.forwards == new and stats.last_forward_bytes == per_forward
    # every forward copies each streamed layer once; with prefetch, the last forward also prefetched the first
    # streamed layer for a next forward that did not come
    first_layer = tensor_bytes(layers[handle.streamed_indices[0]]) if slots > 1 else 0
    assert stats.bytes_streamed == new * per_forward + first_layer
    assert stats.reloads == (1 if slots > 1 else new * 3)  # only the first forward's first layer was not prefetched
    slot_ranges = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in handle.slots]
    for index in range(LAYERS):
        for tensor in [*layers[index].parameters(), *layers[index].buffers()]:
            inside = any(lo <= tensor.data_ptr() < hi for lo, hi in slot_ranges)
            assert not inside  # between forwards every tensor holds its own (host or resident) copy


def test_exception_inside_a_layer_then_identical_generation_with_a_reload():
    resident, streamed, handle = model_pair(keep_first_k=0, keep_last_k=1, num_slots=2)
    explode_once(decoder_layers(streamed)[3].self_attn, "stop inside layer 3")
    ids = prompt()
    with pytest.raises(RuntimeError, match="stop inside layer 3"):
        streamed(ids)
    assert handle.stats().reloads == 1
    expected, expected_logits = greedy(resident, ids)
    got, logits = greedy(streamed, ids)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    assert handle.stats().reloads == 2  # the first streamed layer was not prefetched after the interrupted forward


def test_exact_prefix_hits_with_chunk_reuse_cache():
    resident, streamed, handle = model_pair(keep_first_k=1, keep_last_k=1)
    ids = prompt(3 * CHUNK + 5)
    expected, expected_logits = greedy(resident, ids)
    store = ChunkStore(StoreConfig(1 << 26))
    for attempt in range(2):  # the first call stores, the second reuses
        cache = reuse_cache(store, streamed)
        got, logits = greedy(streamed, ids, cache)
        assert torch.equal(got, expected), f"attempt {attempt}"
        assert (logits - expected_logits).abs().max() < 1e-4
    assert cache.last_reuse[0].cached_tokens == 3 * CHUNK
    assert handle.stats().forwards > 0


def warm_and_reuse(model, store, docs, question, strategy):
    for doc in docs:
        cache = reuse_cache(store, model, starts=[0, len(doc)])
        model(doc[None], cache=cache, use_cache=True, logits_to_keep=1)
        cache.save()
    parts = [docs[1], docs[0], question]
    starts = [0, len(parts[0]), len(parts[0]) + len(parts[1])]
    cache = reuse_cache(store, model, starts, strategy, write_back=False)
    return (*greedy(model, torch.cat(parts)[None], cache), cache.last_reuse[0])


@pytest.mark.parametrize("strategy", ["selective", "cacheblend"])  # cacheblend narrows each layer's inputs
def test_non_prefix_segment_reuse_with_repair_equals_resident(strategy):
    resident, streamed, handle = model_pair(keep_first_k=0, keep_last_k=0)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 128, (40,), generator=gen) for _ in range(2)]
    question = torch.tensor([5, 6, 7])
    expected = warm_and_reuse(resident, ChunkStore(StoreConfig(1 << 26)), docs, question, strategy)
    got = warm_and_reuse(streamed, ChunkStore(StoreConfig(1 << 26)), docs, question, strategy)
    assert got[2].approx_tokens > 0 and got[2].recomputed_tokens > 0  # reused off-prefix and repaired
    assert got[2] == expected[2]
    assert torch.equal(got[0], expected[0])
    assert (got[1] - expected[1]).abs().max() < 1e-5
    assert handle.stats().reloads == 1  # the repair is one whole forward: no stopped forward wasted a prefetch


def test_close_restores_a_normal_model():
    resident, streamed, handle = model_pair(keep_first_k=1, keep_last_k=1)
    digest = model_digest(resident)
    ids = prompt()
    greedy(streamed, ids)
    disable_layer_streaming(streamed)
    assert layer_streamer(streamed) is None and handle.closed
    assert not any(hasattr(m, "_hf_hook") for m in streamed.modules())
    assert streamed.state_dict().keys() == resident.state_dict().keys()
    for (name, a), b in zip(streamed.state_dict().items(), resident.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    from kvboost_hf.core.keys import forget_model_digest

    forget_model_digest(streamed)
    assert model_digest(streamed) == digest
    assert torch.equal(greedy(streamed, ids)[0], greedy(resident, ids)[0])
    handle.close()  # idempotent
    enable_layer_streaming(streamed, LayerStreamingConfig()).close()  # can be enabled again


def test_digest_of_a_streamed_model_is_that_of_its_weights():
    resident, streamed, _ = model_pair(keep_first_k=1)
    assert model_digest(streamed) == model_digest(resident)


def test_device_memory_budget_chooses_the_resident_layers():
    model = make_tiny_model("llama", num_hidden_layers=LAYERS)
    layer = tensor_bytes(decoder_layers(model)[0])
    other = tensor_bytes(model) - LAYERS * layer
    budget = other + 2 * layer + 2 * layer + layer // 2  # room for 2 resident layers and 2 slots, not a 3rd
    handle = enable_layer_streaming(model, LayerStreamingConfig(keep_last_k=1, device_memory_budget_bytes=budget))
    assert handle.streamed_indices == [1, 2, 3, 4]  # the last layer by keep_last_k, the first by the budget
    assert handle.stats().resident_bytes + handle.stats().slot_bytes <= budget + 8 * 256  # alignment padding
    handle.close()
    with pytest.raises(ValueError, match="below the"):
        enable_layer_streaming(model, LayerStreamingConfig(device_memory_budget_bytes=other))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_slots": 0}, "num_slots"),
        ({"keep_first_k": -1}, "keep_first_k"),
        ({"keep_last_k": 1.5}, "keep_last_k"),
        ({"device_memory_budget_bytes": 0}, "device_memory_budget_bytes"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"device": "gpu"}, "device is not a torch device: 'gpu'"),  # accepted, then a torch error when enabled
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        LayerStreamingConfig(**settings)


def test_bad_models_are_refused():
    model = make_tiny_model("llama", num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="exceeds the model's 6 decoder layers"):
        enable_layer_streaming(model, LayerStreamingConfig(keep_first_k=4, keep_last_k=3))
    with pytest.raises(ArgumentTypeError, match="takes a LayerStreamingConfig, got dict"):  # was AttributeError
        enable_layer_streaming(model, {"keep_first_k": 1})
    enable_layer_streaming(model)
    with pytest.raises(ValueError, match="already enabled"):
        enable_layer_streaming(model)


@pytest.mark.slow
def test_embedded_engine_streamed_equals_resident(embedded_engine):
    from kvboost_hf import KVBoost

    engine = KVBoost.from_pretrained(chunking=64, streaming=LayerStreamingConfig(keep_first_k=2, keep_last_k=3))
    handle = layer_streamer(engine.model)
    assert handle.streamed_indices == list(range(2, 27))
    layers = decoder_layers(engine.model)
    document = "The Eiffel Tower is in Paris. " * 12
    question = "Where is the Eiffel Tower? Answer in one word."
    reference = engine_reference(embedded_engine, [document, question], 12).tokens  # transformers, resident
    for mode in ("baseline", "chunk_kv_reuse", "chunk_kv_reuse"):  # the second reuse call hits the stored chunks
        expected = embedded_engine.generate([document, question], 12, mode=mode)
        got = engine.generate([document, question], 12, mode=mode)
        assert got.output_ids == expected.output_ids == reference, mode
        assert got.cached_tokens == expected.cached_tokens
        per_forward = sum(tensor_bytes(layers[i]) for i in handle.streamed_indices)
        assert got.streamed_bytes >= got.generated_tokens * per_forward
        assert got.streamed_bytes_per_token == got.streamed_bytes / got.generated_tokens
        assert expected.streamed_bytes is None
    assert got.cached_tokens > 0
    stats = engine.cache_stats()
    assert stats["streaming_streamed_layers"] == 25 and stats["streaming_bytes_per_forward"] == per_forward
    assert stats["streaming_bytes_streamed"] > 0 and "streaming_bytes_streamed" not in embedded_engine.cache_stats()


class LazyRepackLinear(torch.nn.Linear):
    """Like quantized linear layers that repack on their first forward: the weight buffer is replaced by another
    dtype and a plain tensor attribute appears."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "packed" not in vars(self):
            self.packed = torch.cat([self.weight.detach().t(), self.weight.detach().t()], dim=1).double()
            self.register_buffer("half_bias", self.weight.detach().sum(dim=1).half())
        weight = self.packed[:, : self.out_features].t().to(x.dtype)
        return x @ weight.t() + self.half_bias.to(x.dtype) * 0.0


def with_lazy_layers(model):
    for layer in decoder_layers(model):
        lazy = LazyRepackLinear(layer.mlp.down_proj.in_features, layer.mlp.down_proj.out_features, bias=False)
        lazy.load_state_dict(layer.mlp.down_proj.state_dict())
        layer.mlp.down_proj = lazy
    return model


def test_tensors_created_in_a_first_forward_are_streamed_too():
    resident = with_lazy_layers(make_tiny_model("llama", num_hidden_layers=LAYERS))
    streamed = with_lazy_layers(make_tiny_model("llama", num_hidden_layers=LAYERS))
    handle = enable_layer_streaming(streamed, LayerStreamingConfig(keep_first_k=1, num_slots=2))
    before = handle.stats()
    ids = prompt()
    expected, expected_logits = greedy(resident, ids)
    got, logits = greedy(streamed, ids)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    after = handle.stats()
    down = decoder_layers(streamed)[3].mlp.down_proj
    grown = down.packed.numel() * 8 + down.half_bias.numel() * 2
    assert after.bytes_per_forward == before.bytes_per_forward + 5 * grown
    assert after.last_forward_bytes == after.bytes_per_forward and after.slot_bytes > before.slot_bytes
    slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in handle.slots]
    assert not any(lo <= down.packed.data_ptr() < hi for lo, hi in slots)  # bound to its host copy again
    assert torch.equal(greedy(streamed, ids)[0], expected)


def test_server_metrics_expose_the_streaming_counters():
    from types import SimpleNamespace

    from kvboost_hf.server.app import _register_scraped
    from kvboost_hf.server.metrics import Metrics

    _, streamed, handle = model_pair(keep_first_k=1)
    greedy(streamed, prompt(), new=2)
    metrics = Metrics()
    worker = SimpleNamespace(queue_depth=0, running_rows=0)

    def cache_stats(settle: bool = True) -> dict[str, float]:  # the streaming part of engine.cache_stats
        return {f"streaming_{k}": v for k, v in handle.stats(settle=settle).as_dict().items()}

    _register_scraped(metrics, worker, SimpleNamespace(model=streamed, cache_stats=cache_stats))
    samples = dict(line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if not line.startswith("#"))
    assert float(samples["kvboost_streamed_bytes_total"]) == handle.stats().bytes_streamed
    assert float(samples["kvboost_streamed_layer_reloads_total"]) == 1
    assert "kvboost_streamed_wait_seconds_total" in samples


def test_other_accelerate_hooks_survive_and_device_map_offload_is_refused():
    from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    resident, streamed, _ = model_pair()
    add_hook_to_module(decoder_layers(streamed)[2], Counting(), append=True)  # after the streamer's
    ids = prompt()
    disable_layer_streaming(streamed)
    handle = enable_layer_streaming(streamed, LayerStreamingConfig())  # now before the streamer's
    assert torch.equal(greedy(streamed, ids)[0], greedy(resident, ids)[0])
    handle.close()
    greedy(streamed, ids, new=1)
    assert Counting.calls == 8 + 1  # kept through both closes
    add_hook_to_module(decoder_layers(resident)[0], AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(ValueError, match="device_map offload"):
        enable_layer_streaming(resident)
