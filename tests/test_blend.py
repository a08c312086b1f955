"""CacheBlend's repair forward: every layer computes its own shrinking set of loaded tokens (gradual filtering)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import make_tiny_model
from helpers import documents, full_prefill, run, shuffled_prompt, warm_alone
from hypothesis import given
from hypothesis import strategies as st

from kvboost_hf import ChunkStore, RepairConfig
from kvboost_hf.hf.blend import LayerFilter, install_layer_narrowing
from kvboost_hf.offload.streamer import decoder_layers
from kvboost_hf.reuse.repair import candidates_per_layer
from kvboost_hf.store.config import StoreConfig

LAYERS = 5


@given(
    check_layer=st.integers(0, 6),
    filter_layers=st.integers(0, 6),
    candidates=st.integers(0, 300),
    budget=st.integers(0, 400),
    num_layers=st.integers(1, 8),
)
def test_candidates_shrink_after_the_check_layer_to_the_budget(
    check_layer, filter_layers, candidates, budget, num_layers
):
    config = RepairConfig("cacheblend", check_layer=check_layer, filter_layers=filter_layers)
    kept = candidates_per_layer(config, candidates, budget, num_layers)
    assert len(kept) == num_layers
    assert all(a >= b for a, b in itertools.pairwise(kept))  # non-increasing
    assert all(k == candidates for k in kept[: check_layer + 1])  # every layer through the check layer: all
    last = check_layer + max(filter_layers, 1)
    if last < num_layers:
        assert kept[last:] == [min(budget, candidates)] * (num_layers - last)
    if filter_layers > 1 and check_layer + 1 < num_layers and candidates > budget + filter_layers:
        assert min(budget, candidates) < kept[check_layer + 1] < candidates  # gradual: an intermediate step


def filtered_run(compare: str, filter_layers: int):
    """A 3-document prompt in a new order on a 5-layer model, CacheBlend at 30% from layer 1: returns the per-layer
    positions each layer computed, the fresh K/V it got, the stored K/V it replaced, the cache and the layer inputs'
    lengths."""
    model = make_tiny_model("llama", num_hidden_layers=LAYERS)
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents(3)
    for doc in docs:
        warm_alone(model, store, doc)
    ids, starts = shuffled_prompt(docs, [2, 0, 1], torch.tensor([5, 6, 7]))
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    observe = LayerFilter.observe

    def spy(self, layer_idx, layer, keys, values):
        fresh, stored = (keys, layer.keys) if self.compare == "key" else (values, layer.values)
        seen.append((self.positions.clone(), fresh.clone(), stored.index_select(2, self.positions).clone()))
        observe(self, layer_idx, layer, keys, values)

    inputs: list[int] = []
    install_layer_narrowing(model)  # first, so the spy below sees the narrowed inputs
    handles = [
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].shape[1]))
        for layer in decoder_layers(model)
    ]
    LayerFilter.observe = spy
    try:
        _, cache = run(
            model, store, ids, starts, new=1, strategy="cacheblend", ratio=0.3, check_layer=1,
            filter_layers=filter_layers, deviation=compare, write_back=False,
        )  # fmt: skip
    finally:
        LayerFilter.observe = observe
        for handle in handles:
            handle.remove()
    return model, ids, seen, cache, inputs[: len(seen)]


APPROX = range(40, 120)  # docs 0 and 1 after doc 2 (an exact prefix hit); the 3 question tokens are computed


@pytest.mark.parametrize("compare", ["key", "value"])
@pytest.mark.parametrize("filter_layers", [0, 2])
def test_each_layer_computes_the_previous_layers_most_deviating_candidates(compare, filter_layers):
    _, _, seen, cache, inputs = filtered_run(compare, filter_layers)
    counts = [len(positions) for positions, _, _ in seen]
    assert inputs == counts  # the layers' hidden states were narrowed, not only their writes
    budget = math.ceil(0.3 * len(APPROX))
    assert counts == ([83, 83, 3 + budget + 28, 27, 27] if filter_layers else [83, 83, 27, 27, 27])
    for (positions, fresh, stored), (following, _, _) in itertools.pairwise(seen):
        assert set(following.tolist()) <= set(positions.tolist())  # nested
        deviation = (fresh - stored).pow(2).sum(dim=(0, 1, 3))
        candidate = [i for i, p in enumerate(positions.tolist()) if p in APPROX]
        kept = [i for i in candidate if positions[i] in following]
        dropped = [i for i in candidate if positions[i] not in following]
        if dropped:  # each layer keeps the candidates its own K (or V) deviation ranks highest
            assert deviation[dropped].max() <= deviation[kept].min()
    reuse = cache.last_reuse[0]
    assert reuse.recomputed_tokens == budget and reuse.approx_tokens == len(APPROX) - budget
    assert set(seen[-1][0].tolist()) == set(APPROX) - set(cache.ledgers[0].stale) | {120, 121, 122}


def test_layers_through_the_check_layer_are_exact_and_later_layers_keep_stored_kv_of_dropped_tokens():
    model, ids, seen, cache, _ = filtered_run("key", 2)
    reference = full_prefill(model, ids)
    for layer in (0, 1):
        assert (cache.layers[layer].keys[:, :, : ids.shape[1]] - reference.layers[layer].keys).abs().max() < 1e-4
    positions, fresh, _stored = seen[LAYERS - 1]
    assert torch.allclose(cache.layers[LAYERS - 1].keys.index_select(2, positions), fresh, atol=1e-6)
    dropped = sorted(set(APPROX) - set(positions.tolist()))
    stale = cache.layers[LAYERS - 1].keys[:, :, dropped] - reference.layers[LAYERS - 1].keys[:, :, dropped]
    assert stale.abs().max() > 1e-3  # the stored K/V, computed without the preceding documents


def test_layer_filter_refuses_an_unknown_comparison():
    with pytest.raises(ValueError, match="'key' or 'value'"):
        RepairConfig("cacheblend", deviation="query")
    with pytest.raises(ValueError, match="'key' or 'value'"):
        LayerFilter(torch.arange(3), torch.ones(3, dtype=torch.bool), [3], "query", lambda _: None)
