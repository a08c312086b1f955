"""Issue #22, store items: in-place weight changes, damaged or swapped LMDB files, stats on damaged tiers,
Redis connect hangs, restarts, foreign HMAC secrets and wrong-type keys. No case may kill the process or serve
K/V computed from other weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import greedy, make_tiny_model

from kvboost_hf import ChunkReuseCache
from kvboost_hf.core.keys import model_digest
from kvboost_hf.store.chunk_store import ChunkStore

# ---------------------------------------------------------------------------------------------- model digest

_EDITS: dict[str, Callable[[torch.nn.Module], None]] = {
    "optimizer_step": lambda m: _optimizer_step(m),
    "load_state_dict": lambda m: m.load_state_dict({k: v + 0.01 for k, v in m.state_dict().items()}),
    "merged_adapter": lambda m: _merge_low_rank(m.model.layers[0].self_attn.q_proj),
    "data_replaced": lambda m: setattr(m.model.norm.weight, "data", m.model.norm.weight.detach() * 1.5),
}


def _optimizer_step(model: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()


def _merge_low_rank(linear: torch.nn.Linear) -> None:
    """What PEFT's ``merge_and_unload`` does to a base weight: W += B @ A, in place."""
    out_features, in_features = linear.weight.shape
    a = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0))
    b = torch.randn(out_features, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        linear.weight += 0.05 * (b @ a)


@pytest.mark.parametrize("edit", list(_EDITS))
def test_in_place_weight_change_changes_the_digest(edit: str):
    model = make_tiny_model("llama")
    before = model_digest(model)
    _EDITS[edit](model)
    assert model_digest(model) != before


def test_writes_through_param_data_are_not_seen_until_forgotten():
    """The documented limit: ``param.data`` is an alias with its own version counter."""
    from kvboost_hf.core.keys import forget_model_digest

    model = make_tiny_model("llama")
    before = model_digest(model)
    model.model.norm.weight.data.mul_(2)
    assert model_digest(model) == before
    forget_model_digest(model)
    assert model_digest(model) != before


@pytest.mark.parametrize("edit", ["optimizer_step", "load_state_dict", "merged_adapter"])
def test_generation_after_an_in_place_change_reuses_nothing_stale(edit: str):
    """Generate, change the weights in place, generate with a new cache on the same store: the output is the
    new weights' plain output (before the fix, 12 tokens were reused from the old weights)."""
    model = make_tiny_model("llama")
    ids = torch.randint(1, 128, (1, 28), generator=torch.Generator().manual_seed(3))
    store = ChunkStore(1 << 24)
    greedy(model, ids, ChunkReuseCache(store, model, chunking=4), new=2)
    _EDITS[edit](model)
    model.zero_grad(set_to_none=True)
    _, plain = greedy(model, ids, new=2)
    hits_before = store.stats()["hits"]
    _, reused = greedy(model, ids, ChunkReuseCache(store, model, chunking=4), new=2)
    assert store.stats()["hits"] == hits_before
    torch.testing.assert_close(reused, plain, rtol=0, atol=1e-5)
