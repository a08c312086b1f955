"""APE-style attention over parallel contexts: the math, and the cache passing it to every later forward."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvboost_hf import ChunkReuseCache, ChunkStore, RepairConfig
from kvboost_hf.hf import context_attention
from kvboost_hf.hf.attention import ATTN_IMPLEMENTATION
from kvboost_hf.hf.context_attention import ADJUSTMENT_KWARG, ContextAdjustment, adjusted_attention
from kvboost_hf.hf.prefill import forward
from kvboost_hf.store.config import StoreConfig


def _qkv(batch=2, heads=4, kv_heads=2, num_q=3, num_k=7, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, heads, num_q, dim, generator=gen),
        torch.randn(batch, kv_heads, num_k, dim, generator=gen),
        torch.randn(batch, kv_heads, num_k, dim, generator=gen),
    )


def _adjustment(columns: list[list[int]], num_k: int, start: int, temperature: float, scale: float):
    marked = torch.zeros(len(columns), num_k, dtype=torch.bool)
    for row, cols in enumerate(columns):
        marked[row, cols] = True
    return ContextAdjustment(marked, torch.full((len(columns),), start), temperature, scale)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_temperature_and_scale_one_is_plain_attention(mask_kind):
    query, key, value = _qkv()
    num_q, num_k = query.shape[2], key.shape[2]
    allowed = torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q)[None, None].repeat(2, 1, 1, 1)
    allowed[1, :, :, :2] = False  # row 1 is left-padded by two columns
    mask = {
        "none": None,
        "bool": allowed,
        "additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min),
    }[mask_kind]
    if mask is None:
        allowed[1] = allowed[0]
    positions = torch.arange(num_k - num_q, num_k)[None]
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    plain, _ = sdpa_attention_forward(module, query, key, value, allowed, scaling=0.3, is_causal=False)
    identity = _adjustment([[1, 2, 3], [2, 3]], num_k, 0, 1.0, 1.0)
    out = adjusted_attention(query, key, value, mask, 0.3, identity, positions)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


def test_context_columns_get_the_tempered_and_scaled_mass():
    """Per query: the context group's softmax mass is exp(S*T*logsumexp(l/T)) beside the others' exp(logsumexp(l)),
    and inside each group the weights are softmax(l/T) and softmax(l); queries before ``query_start`` and rows
    without context columns attend plainly."""
    query, key, value = _qkv(batch=2, heads=2, kv_heads=2, num_q=2, num_k=6)
    temperature, scale, scaling = 0.7, 1.2, 0.5
    context = [1, 2, 3]
    adjustment = _adjustment([context, []], 6, 5, temperature, scale)
    positions = torch.tensor([[4, 5]])  # query 0 is before query_start (5), query 1 is adjusted
    out = adjusted_attention(query, key, value, None, scaling, adjustment, positions)
    logits = (query @ key.transpose(-1, -2)) * scaling
    plain = logits + torch.zeros(2, 6).masked_fill(~torch.ones(2, 6, dtype=torch.bool).tril(4), -math.inf)
    expected = (plain.softmax(-1) @ value).transpose(1, 2)
    others = [0, 4, 5]
    l_ctx, l_other = logits[0, :, 1, context], logits[0, :, 1, others]
    mass_ctx = torch.exp(scale * temperature * (l_ctx / temperature).logsumexp(-1))
    mass_other = torch.exp(l_other.logsumexp(-1))
    out_ctx = ((l_ctx / temperature).softmax(-1)[:, None] @ value[0, :, context]).squeeze(1)  # [H, D]
    out_other = (l_other.softmax(-1)[:, None] @ value[0, :, others]).squeeze(1)
    mixed = (mass_ctx[:, None] * out_ctx + mass_other[:, None] * out_other) / (mass_ctx + mass_other)[:, None]
    expected[0, 1] = mixed
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[0, 1], (plain.softmax(-1) @ value).transpose(1, 2)[0, 1], atol=1e-3)


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_queries_in_blocks_give_the_same_attention(monkeypatch, mask_kind):
    query, key, value = _qkv(num_q=7, num_k=11)
    mask = None if mask_kind == "none" else torch.rand(2, 1, 7, 11, generator=torch.Generator().manual_seed(3)) > 0.3
    adjustment = _adjustment([[1, 2, 3], [4, 5]], 11, 6, 0.6, 1.3)
    positions = torch.arange(4, 11)[None]
    whole = adjusted_attention(query, key, value, mask, 0.3, adjustment, positions)
    monkeypatch.setattr(context_attention, "QUERY_BLOCK", 3)
    torch.testing.assert_close(adjusted_attention(query, key, value, mask, 0.3, adjustment, positions), whole)


def test_a_fully_masked_query_row_gets_zeros_not_nan():
    query, key, value = _qkv(batch=1)
    hidden = torch.zeros(1, 1, 3, 7, dtype=torch.bool)
    hidden[..., 1:, :] = True  # query 0 is a padding row that sees nothing
    adjustment = _adjustment([[2, 3]], 7, 0, 0.5, 1.5)
    out = adjusted_attention(query, key, value, hidden, 0.3, adjustment, torch.arange(3)[None])
    assert torch.isfinite(out).all() and bool((out[:, 0] == 0).all())


def _stored_documents(model, store, docs):
    for doc in docs:
        cache = ChunkReuseCache(store, model, 16, segment_starts=[0, len(doc)])
        forward(model, cache, input_ids=doc[None], logits_to_keep=1)
        cache.save()


def test_the_cache_refuses_the_adjustment_without_the_kvboost_attention():
    model = make_tiny_model("llama")
    with pytest.raises(ValueError, match="attn_implementation='kvboost'"):
        ChunkReuseCache(ChunkStore(StoreConfig(1 << 20)), model, 16, RepairConfig("none", 0.0, context_temperature=0.8))
    with pytest.raises(ValueError, match="finite and > 0"):
        RepairConfig(context_scale=0.0)
    assert not RepairConfig().adjusts_attention and RepairConfig(context_scale=1.1).adjusts_attention


def test_every_forward_after_reordered_documents_passes_the_adjustment(monkeypatch):
    """Two documents stored alone, loaded in the other order: with T = S = 1 the reuse equals plain reuse; with
    T = 0.5 every layer of the prompt forward and of each decode step runs the adjusted attention, the
    documents' own columns (their loaded K/V) are untouched, and the question's logits move."""
    model = make_tiny_model("llama")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 128, (32,), generator=gen) for _ in range(2)]
    _stored_documents(model, store, docs)
    ids = torch.cat([docs[1], docs[0], torch.tensor([5, 6, 7, 8])])[None]
    calls = []
    original = context_attention.adjusted_attention

    def spy(*args, **kwargs):
        calls.append(args[5])
        return original(*args, **kwargs)

    monkeypatch.setattr("kvboost_hf.hf.attention.adjusted_attention", spy)

    def run(repair):
        cache = ChunkReuseCache(store, model, 16, repair, segment_starts=[0, 32, 64], write_back=False)
        first = forward(model, cache, input_ids=ids, logits_to_keep=1).logits[0, -1]
        step = forward(model, cache, input_ids=first.argmax()[None, None], logits_to_keep=1).logits[0, -1]
        return cache, first, step

    plain_cache, plain_first, plain_step = run(RepairConfig("none", 0.0))
    assert calls == [] and plain_cache.attention_kwargs() == {}
    cache, first, step = run(RepairConfig("none", 0.0, context_temperature=0.5))
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers  # the prompt forward's layers, then the decode step's
    adjustment = calls[0]
    assert calls[layers] is adjustment  # built once for the layout, not again for the decode step
    assert sorted(cache.ledgers[0].approximate) == list(range(32, 64))  # doc 0 moved; doc 1 is a prefix hit
    assert adjustment.columns[0].nonzero().squeeze(1).tolist() == list(range(32, 64))
    assert int(adjustment.query_start[0]) == 64
    assert ADJUSTMENT_KWARG in cache.attention_kwargs()
    for ours, theirs in zip(cache.layers, plain_cache.layers, strict=True):
        torch.testing.assert_close(ours.keys[:, :, :64], theirs.keys[:, :, :64])
    # the question's keys come from its embeddings in layer 0 and from the adjusted attention after it
    torch.testing.assert_close(cache.layers[0].keys[:, :, 64:], plain_cache.layers[0].keys[:, :, 64:])
    assert not torch.allclose(cache.layers[-1].keys[:, :, 64:68], plain_cache.layers[-1].keys[:, :, 64:68])
    assert not torch.allclose(first, plain_first, atol=1e-4) and not torch.allclose(step, plain_step, atol=1e-4)


def test_tokens_computed_under_the_adjustment_are_never_stored_as_exact():
    """With every approximate token repaired (ratio 1) no position is stale, so the row counted the whole prompt
    and answer as exact and stored them under prefix keys; but the question and the answer ran under the adjusted
    attention. A later plain (exact) request loaded them and gave other tokens. Now the row is exact up to its last
    approximate column only: that request loads just the leading document and equals plain generate()."""
    model = make_tiny_model("llama")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 128, (32,), generator=gen) for _ in range(2)]
    for doc in docs:
        cache = ChunkReuseCache(store, model, 16, segment_starts=[0, 32], adapter=False)
        forward(model, cache, input_ids=doc[None], logits_to_keep=1)
        cache.save()
    ids = torch.cat([docs[1], docs[0], torch.randint(1, 128, (20,), generator=gen)])[None]
    adjusted = ChunkReuseCache(
        store, model, 16, RepairConfig("selective", 1.0, context_temperature=0.5), segment_starts=[0, 32, 64]
    )
    answer = model.generate(ids, cache=adjusted, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert adjusted.last_reuse[0].approx_tokens == 0 and adjusted.ledgers[0].exact_tokens == 64
    follow = torch.cat([answer, torch.randint(1, 128, (6,), generator=gen)[None]], 1)
    exact = ChunkReuseCache(store, model, 16)
    out = model.generate(follow, cache=exact, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert exact.last_reuse[0].cached_tokens == 64
    assert torch.equal(out, model.generate(follow, max_new_tokens=10, do_sample=False, pad_token_id=0))
