"""Keys: namespaces separate models, settings and tenants; prefix keys chain, content keys do not."""

from __future__ import annotations

import torch
from conftest import make_tiny_model
from hypothesis import given
from hypothesis import strategies as st

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.keys import chain_prefix_keys, content_key, forget_model_digest, make_namespace, prefix_key


def test_namespace_changes_with_everything_that_changes_kv():
    model = make_tiny_model("llama")
    base = make_namespace(model, torch.float32, ChunkingConfig(16))
    assert base == make_namespace(model, torch.float32, ChunkingConfig(16))
    variants = [
        make_namespace(make_tiny_model("llama", seed=1), torch.float32, ChunkingConfig(16)),
        make_namespace(model, torch.bfloat16, ChunkingConfig(16)),
        make_namespace(model, torch.float32, ChunkingConfig(32)),
        make_namespace(model, torch.float32, ChunkingConfig(16, 4, frozenset({1}))),
        make_namespace(model, torch.float32, ChunkingConfig(16), kv_cache_bits=8),
        make_namespace(model, torch.float32, ChunkingConfig(16), cache_salt="tenant"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_weight_change_changes_the_digest_after_forgetting():
    model = make_tiny_model("llama")
    before = make_namespace(model, torch.float32, ChunkingConfig(16))
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.add_(0.5)
    forget_model_digest(model)
    assert make_namespace(model, torch.float32, ChunkingConfig(16)) != before


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=40), st.integers(1, 39))
def test_prefix_keys_depend_on_the_past_content_keys_do_not(tokens, cut):
    cut = min(cut, len(tokens) - 1)
    ns = "n" * 64
    head, tail = tokens[:cut], tokens[cut:]
    assert prefix_key(ns, None, tail) != prefix_key(ns, prefix_key(ns, None, head), tail)
    assert content_key(ns, tail) == content_key(ns, list(tail))
    assert content_key(ns, tail) != content_key("m" * 64, tail)
    keys = chain_prefix_keys(ns, tokens, [(0, cut), (cut, len(tokens))])
    assert keys[1] == prefix_key(ns, keys[0], tail)


def test_cache_scheduler_and_router_share_one_key_space():
    """The cache's namespace, the engine's key space (its batch policy's) and the router's keys come from one
    KeySpace: equal namespaces for every tenant, and a router-side KeySpace rebuilt from its fields agrees."""
    from kvboost_hf import ChunkReuseCache, ChunkStore, StoreConfig
    from kvboost_hf.core.keys import KeySpace

    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 20, kv_cache_bits=8))
    cache = ChunkReuseCache(store, model, chunking=16, cache_salt="tenant")
    space = KeySpace.of_model(model, torch.float32, ChunkingConfig(16), kv_cache_bits=8, kv_group_size=64)
    assert cache.key_space == space and cache.namespace == space.namespace("tenant")
    assert space.namespace("tenant") != space.namespace(None)
    rebuilt = KeySpace(space.digest, space.dtype, space.chunking, space.kv_cache_bits, space.kv_group_size)
    assert rebuilt.namespace("tenant") == cache.namespace
