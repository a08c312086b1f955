"""The generate() adapter is optional: the library drives the cache explicitly, the hooks come and go."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import greedy, make_tiny_model
from helpers import word_tokenizer, words
from transformers import DynamicCache, LogitsProcessorList, MinLengthLogitsProcessor

from kvboost_hf import ChunkReuseCache, ChunkStore, KVBoost
from kvboost_hf.core.errors import InputError, StateError
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


def _packed_mask(length: int, split: int) -> torch.Tensor:
    """An additive ``[1, 1, length, length]`` mask of two packed sequences: tokens from ``split`` on do not see the
    ones before."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[split:, :split] = False
    return torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["packed_mask", "shifted_positions", "autocast"])
def test_a_forward_unlike_a_plain_prefill_neither_loads_nor_stores(kind):
    """A direct ``model(...)`` through the cache whose K/V a plain prefill would not compute (a 4D mask hiding
    tokens inside the row: only its diagonal was read; position_ids other than the next positions; autocast to
    bf16 of an fp32 model) loaded stored causal K/V into it and stored its own K/V under the prefix keys, where a
    later plain request was served them. Now it equals a DynamicCache under the same inputs and stores nothing."""
    model = make_tiny_model("llama", seed=11)
    ids = torch.randint(1, 120, (1, 24), generator=torch.Generator().manual_seed(4))
    inputs = {
        "packed_mask": {"attention_mask": _packed_mask(24, 8)},
        "shifted_positions": {"position_ids": torch.arange(24)[None] + 300},
        "autocast": {},
    }[kind]
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if kind == "autocast" else contextlib.nullcontext()
    store = ChunkStore()
    model.generate(ids, cache=ChunkReuseCache(store, model, 4), max_new_tokens=1, do_sample=False)
    puts = store.stats()["puts"]
    logits = []
    for cache in (DynamicCache(config=model.config), ChunkReuseCache(store, model, 4)):
        with torch.no_grad(), precision:
            logits.append(model(ids, cache=cache, logits_to_keep=1, **inputs).logits)
    assert torch.equal(logits[0], logits[1]) and not cache.reuse_enabled
    cold = ChunkStore()
    with torch.no_grad(), precision:
        model(ids, cache=(spent := ChunkReuseCache(cold, model, 4)), **inputs)
    spent.save()
    assert store.stats()["puts"] == puts and cold.stats()["puts"] == 0


def test_a_copy_of_the_model_runs_through_the_hooks():
    """A copy with the cache's model's digest is accepted; a copy made before the adapter was installed had no
    hooks, so its generate() neither stored nor refused a prompt that does not extend the cache (it attended to
    the other prompt's K/V). A deep copy of a hooked model carries the hooks once, not twice."""
    model = make_tiny_model("llama", seed=12)
    unhooked_twin = copy.deepcopy(model)
    store = ChunkStore()
    cache = ChunkReuseCache(store, model, 8)
    hooked_twin = copy.deepcopy(model)
    ids, other = (torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    unhooked_twin.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert cache.num_columns == 22 and store.stats()["puts"] == 3
    with pytest.raises(InputError, match="does not extend"):
        unhooked_twin.generate(other, cache=cache, max_new_tokens=3, do_sample=False)
    again = ChunkReuseCache(store, model, 8)
    out = hooked_twin.generate(ids, cache=again, max_new_tokens=3, do_sample=False)
    assert again.last_reuse[0].cached_tokens == 16 and len(hooked_twin._forward_pre_hooks) == 1
    assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))


def test_positional_arguments_bind_by_name():
    """``model(ids, mask, cache=...)`` and ``generate(ids, None, processors, cache=...)`` raised "got multiple
    values": the hook moved only the first positional argument. They now behave as with a DynamicCache."""
    model = make_tiny_model("llama", seed=13)
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(ids, mask, cache=DynamicCache(config=model.config)).logits
        assert torch.equal(model(ids, mask, cache=ChunkReuseCache(ChunkStore(), model, 8)).logits, expected)
    processors = LogitsProcessorList([MinLengthLogitsProcessor(25, eos_token_id=0)])
    plain = model.generate(ids, None, processors, max_new_tokens=4, do_sample=False)
    store = ChunkStore()
    cached = model.generate(ids, None, processors, cache=ChunkReuseCache(store, model, 8), max_new_tokens=4)
    assert torch.equal(plain, cached) and store.stats()["puts"] == 3


def test_a_cache_left_part_way_through_a_forward_is_refused():
    """An exception inside a forward (out of memory, an interrupt) leaves the layers that ran one forward ahead of
    the recorded tokens: the next use raised a size mismatch from inside attention, or "does not extend". It is a
    StateError that says so, and the store holds nothing of the failed call."""
    model = make_tiny_model("llama", seed=14)
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(8))
    store = ChunkStore()
    cache = ChunkReuseCache(store, model, 8)

    def fail(module, args):
        raise RuntimeError("simulated out of memory")

    handle = model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="simulated"):
        model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    handle.remove()
    with pytest.raises(StateError, match="failed part-way"):
        model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert store.stats()["puts"] == 0
