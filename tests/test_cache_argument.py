"""The cache argument's two names: transformers 5.24 calls it ``cache=`` and deprecates ``past_key_values=``.

The package's own calls use the current name (no ``FutureWarning`` from them); a user's ``past_key_values=`` still
drives the same cache through both entry points, ``generate()`` and ``forward()``. The rest of the suite spells
``cache=``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import make_tiny_model
from helpers import word_tokenizer, words

from kvboost_hf import ChunkReuseCache, ChunkStore, DraftConfig, KVBoost, Speculation

CHUNK = 16
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def prompt(seed: int, length: int = 40) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def test_the_package_calls_emit_no_future_warning(model):
    """The drop-in path (generate and forward, with and without a draft) and the engine under
    ``simplefilter("error", FutureWarning)``: a deprecated call anywhere in them raises."""
    ids = prompt(0)
    expected = model.generate(ids, **GREEDY)
    store = ChunkStore()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for state in ("cold", "warm"):
            cache = ChunkReuseCache(store, model, CHUNK)
            assert torch.equal(model.generate(ids, cache=cache, **GREEDY), expected), state
        assert cache.last_reuse[0].cached_tokens == 32
        cache = ChunkReuseCache(ChunkStore(), model, CHUNK)
        model(ids, cache=cache, use_cache=True)
        cache.save()
        with Speculation(model, copy.deepcopy(model), DraftConfig(num_draft_tokens=3)) as speculation:
            cache = ChunkReuseCache(store, model, CHUNK)
            drafted = model.generate(ids, cache=cache, attention_mask=torch.ones_like(ids), **{
                **GREEDY, **speculation.generate_kwargs()
            })  # fmt: skip
        assert torch.equal(drafted, expected) and speculation.stats.draft_tokens_proposed > 0
        engine = KVBoost(model, word_tokenizer(), chunking=8)
        text = words(1, 30)
        assert engine.generate(text, max_new_tokens=3).generated_tokens == 3
        assert engine.generate(text, max_new_tokens=3).cached_tokens > 0


def test_generate_still_takes_past_key_values(model):
    """``generate(past_key_values=cache)``: transformers' deprecated name loads and stores as ``cache=`` does."""
    ids = prompt(1)
    expected = model.generate(ids, **GREEDY)
    store = ChunkStore()
    for state in ("cold", "warm"):
        cache = ChunkReuseCache(store, model, CHUNK)
        with pytest.warns(FutureWarning, match="past_key_values"):  # transformers' deprecation, not ours
            assert torch.equal(model.generate(ids, past_key_values=cache, **GREEDY), expected), state
    assert cache.last_reuse[0].cached_tokens == 32


def test_forward_still_takes_past_key_values(model):
    """``model(ids, past_key_values=cache)`` fills the cache as ``cache=`` does: the same logits, the same chunks
    stored by ``save()``."""
    ids = prompt(2)
    outputs, stores = [], []
    for name in ("cache", "past_key_values"):
        store = ChunkStore()
        cache = ChunkReuseCache(store, model, CHUNK)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation of the old name
            outputs.append(model(ids, **{name: cache}, use_cache=True).logits)
        cache.save()
        assert cache.get_seq_length() == ids.shape[1]
        stores.append(store.stats()["chunks"])
    assert torch.equal(outputs[0], outputs[1])
    assert stores == [3, 3]  # two full chunks and the unfinished last one
