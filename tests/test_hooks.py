"""The generate() adapter is optional: the library drives the cache explicitly, the hooks come and go."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import greedy, make_tiny_model
from helpers import word_tokenizer, words

from kvboost_hf import ChunkReuseCache, ChunkStore, KVBoost
from kvboost_hf.core.errors import InputError
from kvboost_hf.hf.hooks import hooks_installed, install_hooks, uninstall_hooks, without_hooks


def test_the_engine_reuses_chunks_without_installing_hooks():
    """The engine's loop drives every forward explicitly: the user's model gets no hooks and no generate wrapper,
    and the second call still loads the prompt's chunks with the same output as transformers' generate()."""
    model = make_tiny_model("llama", seed=4)
    engine = KVBoost(model, word_tokenizer(), chunking=8)
    prompt = words(70, 30)
    first = engine.generate(prompt, max_new_tokens=6)
    second = engine.generate(prompt, max_new_tokens=6)
    engine.warm(words(71, 20))
    assert not hooks_installed(model) and "generate" not in vars(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    ids = torch.tensor([engine.encode(prompt)])
    expected, _ = greedy(model, ids, new=6, attention_mask=torch.ones_like(ids))
    assert first.output_ids == second.output_ids == expected[0, ids.shape[1] :].tolist()
    assert (first.cached_tokens, second.cached_tokens) == (0, 24)


def test_hooks_are_installed_once_and_removable():
    model = make_tiny_model("llama", seed=5)
    store = ChunkStore()
    ids = torch.randint(1, 120, (1, 21), generator=torch.Generator().manual_seed(1))
    plain, _ = greedy(model, ids)
    ChunkReuseCache(store, model, 8)
    ChunkReuseCache(store, model, 8)
    install_hooks(model)
    assert hooks_installed(model) and len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    cold, _ = greedy(model, ids, ChunkReuseCache(store, model, 8))
    warm_cache = ChunkReuseCache(store, model, 8)
    warm, _ = greedy(model, ids, warm_cache)
    assert torch.equal(cold, plain) and torch.equal(warm, plain) and warm_cache.last_reuse[0].cached_tokens == 16
    with without_hooks(model):
        assert not hooks_installed(model) and not model._forward_pre_hooks and "generate" not in vars(model)
        unhooked = ChunkReuseCache(store, model, 8, adapter=False)
        out, _ = greedy(model, ids, unhooked)  # an ordinary cache then: nothing loaded, output unchanged
        assert torch.equal(out, plain) and unhooked.last_reuse == []
    assert hooks_installed(model)
    assert uninstall_hooks(model) and not uninstall_hooks(model)
    assert not model._forward_pre_hooks and not model._forward_hooks and "generate" not in vars(model)


def test_the_first_generate_of_a_model_given_its_cache_inline_writes_back():
    """``model.generate(ids, cache=ChunkReuseCache(store, model))`` looks ``model.generate`` up before the cache
    installs the adapter: the call is still written back, its unfinished last chunk included (it was lost)."""
    model = make_tiny_model("llama", seed=6)
    store = ChunkStore()
    ids = torch.randint(1, 120, (1, 21), generator=torch.Generator().manual_seed(2))
    first = model.generate(ids, cache=ChunkReuseCache(store, model, 8), max_new_tokens=4, do_sample=False)
    assert store.stats()["puts"] == 3  # chunks [0, 8) and [8, 16), and the tail [16, 24) of the 25 tokens
    again = ChunkReuseCache(store, model, 8)
    out = model.generate(first, cache=again, max_new_tokens=2, do_sample=False)
    assert again.last_reuse[0].cached_tokens == 24
    assert torch.equal(out, model.generate(first, max_new_tokens=2, do_sample=False))


def test_a_cache_built_for_another_model_is_refused_before_it_serves_or_stores_anything():
    """Model B given model A's cache would load A's K/V (B hooked) or store B's K/V under A's namespace (B not
    hooked): both are refused with the reason; a copy with the same weights is the same model."""
    a, b = make_tiny_model("llama", seed=1), make_tiny_model("llama", seed=2)
    store = ChunkStore()
    ids = torch.randint(1, 120, (1, 30), generator=torch.Generator().manual_seed(3))
    a.generate(ids, cache=ChunkReuseCache(store, a, 8), max_new_tokens=3, do_sample=False)
    puts = store.stats()["puts"]
    for hooked in (False, True):
        if hooked:
            install_hooks(b)
        with pytest.raises(InputError, match="built for another model"):
            b.generate(ids, cache=ChunkReuseCache(store, a, 8), max_new_tokens=3, do_sample=False)
        assert store.stats()["puts"] == puts
    twin = copy.deepcopy(a)
    cache = ChunkReuseCache(store, a, 8)
    out = twin.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert cache.last_reuse[0].cached_tokens == 24 and torch.equal(
        out, a.generate(ids, max_new_tokens=3, do_sample=False)
    )
    cache = ChunkReuseCache(store, twin, 8)
    twin.to(torch.float64)
    with pytest.raises(
        InputError, match=r"built for K/V in torch\.float32, and the model running it computes torch\.float64"
    ):
        twin.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert store.stats()["puts"] == puts
