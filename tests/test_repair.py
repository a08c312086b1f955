"""Non-prefix reuse: documents reused at any offset and order, re-rotated and repaired."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import LENGTH_DEPENDENT, greedy, make_tiny_model
from helpers import REPAIR_CHUNK, documents, full_prefill, run, shuffled_prompt, warm_alone
from transformers import DynamicCache

from kvboost_hf import ChunkingConfig, ChunkReuseCache, ChunkStore, GenerationMode, RepairConfig
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.reuse.rope import KeyRotator, UnsupportedRopeError
from kvboost_hf.store.config import StoreConfig

CONTENT = ChunkingConfig(REPAIR_CHUNK, method="content")
ROTATING = ["llama", "qwen2", "phi3"]  # full-attention tiny models; the sliding-window ones fall back to exact


@pytest.mark.parametrize("arch", ROTATING)
def test_rerotation_equals_keys_computed_at_the_new_position(arch):
    model = make_tiny_model(arch)
    rotator = KeyRotator(model)
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    at_zero = full_prefill(model, ids).layers[0].keys  # layer-0 keys depend on token and position only
    moved = DynamicCache()
    model(ids, cache=moved, position_ids=torch.arange(24)[None] + 37)
    assert torch.allclose(rotator.rotate(at_zero, 37), moved.layers[0].keys, atol=1e-5)
    assert torch.allclose(rotator.rotate(moved.layers[0].keys, -37), at_zero, atol=1e-5)


def test_rerotation_follows_cohere_interleaved_pairs():
    """Cohere pairs neighbouring channels (cos and sin repeat each frequency twice), not channel i with i + D/2."""
    config = transformers.CohereConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(config).eval()
    _assert_rerotation_is_exact(model, length=12, offset=37)


def _assert_rerotation_is_exact(model, length: int, offset: int) -> None:
    """Layer 0's keys of ``length`` tokens prefilled at 0 and rotated by ``offset`` equal those prefilled there."""
    ids = torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(1))
    moved = DynamicCache()
    model(ids, cache=moved, position_ids=torch.arange(length)[None] + offset)
    rotated = KeyRotator(model).rotate(full_prefill(model, ids).layers[0].keys, offset)
    assert torch.allclose(rotated, moved.layers[0].keys, atol=1e-5)


def test_a_rotary_layout_the_rotator_does_not_reproduce_is_refused(monkeypatch):
    """The rotator checks itself against the model's own apply_rotary_pos_emb when built: a layout it does not
    know (here channel i paired with i + 1 modulo D) disables non-prefix reuse instead of serving wrong keys."""
    from transformers.models.llama import modeling_llama

    def shifted_pairs(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + q.roll(1, -1) * sin, k * cos + k.roll(1, -1) * sin

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", shifted_pairs)
    with pytest.raises(UnsupportedRopeError, match="does not reproduce the model's own rotary embedding"):
        KeyRotator(make_tiny_model("llama"))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rerotation_is_exact_for_scaled_rope_variants(rope):
    _assert_rerotation_is_exact(make_tiny_model("llama", rope_parameters=rope), length=24, offset=200)


def test_length_dependent_rope_disables_only_non_prefix_reuse(caplog):
    model = make_tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents(2)
    for doc in docs:
        warm_alone(model, store, doc)
    assert "cannot be moved to another position exactly" in caplog.text
    ids, starts = shuffled_prompt(docs, [1, 0], torch.tensor([5, 6, 7]))
    out, cache = run(model, store, ids, starts, write_back=False)
    assert cache.last_reuse[0].approx_tokens == 0 and cache.last_reuse[0].cached_tokens == 40
    assert torch.equal(out[0], greedy(model, ids)[0])


@pytest.mark.parametrize("rope", sorted(LENGTH_DEPENDENT))
def test_length_dependent_rope_reuses_only_below_its_original_length(rope, caplog):
    """K/V computed past the original length use other frequencies: a long prompt neither stores nor loads chunks,
    so a short prompt sharing its start computes its own (as plain generate does); short prompts still reuse."""
    arch, overrides = LENGTH_DEPENDENT[rope]
    model = make_tiny_model(arch, **overrides)
    store = ChunkStore(StoreConfig(1 << 26))
    generator = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(1, 128, (1, 90), generator=generator)
    short_prompt = torch.cat([long_prompt[:, :40], torch.randint(1, 128, (1, 8), generator=generator)], 1)
    long_cache = ChunkReuseCache(store, model, 8)
    model(long_prompt, cache=long_cache, use_cache=True, logits_to_keep=1)
    long_cache.save()
    assert "depend on the sequence length" in caplog.text and store.stats()["chunks"] == 0
    model(long_prompt)  # the rotary module left in its long state, as after a long request
    for turn in range(2):  # the first short prompt stores its chunks, the second loads them
        cache = ChunkReuseCache(store, model, 8)
        tokens, logits = greedy(model, short_prompt, cache)
        assert (cache.last_reuse[0].cached_tokens >= 40) == (turn == 1)
        plain_tokens, plain_logits = greedy(model, short_prompt)
        assert torch.equal(tokens, plain_tokens) and torch.allclose(logits, plain_logits, atol=1e-5)


@pytest.mark.parametrize("arch", ROTATING)
@pytest.mark.parametrize("strategy", ["selective", "cacheblend"])
def test_ratio_one_reproduces_the_full_prefill_in_any_order(arch, strategy):
    model = make_tiny_model(arch)
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents()
    for doc in docs:
        warm_alone(model, store, doc)
    question = torch.randint(1, 128, (7,), generator=torch.Generator().manual_seed(2))
    for order in ([2, 0, 1], [1, 2]):
        ids, starts = shuffled_prompt(docs, order, question)
        expected = greedy(model, ids)
        out, cache = run(model, store, ids, starts, strategy=strategy, ratio=1.0, write_back=False)
        reuse = cache.last_reuse[0]
        assert reuse.hit_chunks >= 3 * len(order) - 1 and reuse.approx_tokens == 0 and reuse.recomputed_tokens > 0
        assert torch.equal(out[0], expected[0])
        assert (out[1][:, 0] - expected[1][:, 0]).abs().max() < 1e-4
        reference = full_prefill(model, ids)
        for layer, ref_layer in zip(cache.layers, reference.layers, strict=True):
            assert (layer.keys[:, :, : ids.shape[1]] - ref_layer.keys).abs().max() < 1e-4
            assert (layer.values[:, :, : ids.shape[1]] - ref_layer.values).abs().max() < 1e-4


@pytest.mark.parametrize("arch", sorted([*ROTATING, "mistral", "gemma2"]))
@pytest.mark.parametrize("strategy", ["none", "selective", "cacheblend"])
def test_every_strategy_runs_on_every_architecture(arch, strategy):
    model = make_tiny_model(arch)
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents(2)
    for doc in docs:
        warm_alone(model, store, doc)
    ids, starts = shuffled_prompt(docs, [1, 0], torch.tensor([5, 6, 7]))
    # 2 layers: CacheBlend filters after the check layer, so it checks layer 0 here
    out, cache = run(model, store, ids, starts, strategy=strategy, ratio=0.3, check_layer=0, write_back=False)
    assert out[0].shape == (1, ids.shape[1] + 8)
    reuse = cache.last_reuse[0]
    if arch in ROTATING:
        assert reuse.hit_chunks == 6
        if strategy == "none":
            assert reuse.recomputed_tokens == 0 and reuse.approx_tokens == 40
        else:  # forced into repair: some reused tokens recomputed, the rest kept
            assert 0 < reuse.recomputed_tokens < 40 and reuse.approx_tokens > 0
    else:  # sliding windows: only exact prefix reuse, output identical to plain generate
        assert reuse.approx_tokens == 0
        assert torch.equal(out[0], greedy(model, ids)[0])


def test_gap_in_the_middle_is_computed_in_place():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    a, b, c = documents(3, seed=3)
    warm_alone(model, store, a)
    warm_alone(model, store, c)
    ids, starts = shuffled_prompt([a, b, c], [0, 1, 2], torch.tensor([9, 9, 9]))
    out, cache = run(model, store, ids, starts, ratio=1.0, write_back=False)
    reuse = cache.last_reuse[0]
    assert reuse.cached_tokens == 40  # document a, exact at the start; b is a gap; c reused and recomputed
    assert reuse.recomputed_tokens == 40
    assert torch.equal(out[0], greedy(model, ids)[0])


def test_exact_prefix_hits_are_not_repaired_and_stale_chunks_never_written_by_prefix():
    model = make_tiny_model("qwen2")
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents(2, seed=4)
    for doc in docs:
        warm_alone(model, store, doc)
    ids, starts = shuffled_prompt(docs, [0, 1], torch.tensor([3, 4, 5, 6]))
    _out, cache = run(model, store, ids, starts, strategy="none")
    reuse = cache.last_reuse[0]
    assert reuse.cached_tokens == 80 and reuse.approx_tokens == 40  # doc 0 exact (untouched), doc 1 as stored
    stored_first = store.get(cache.ledgers[0].keys[0])
    assert torch.equal(cache.layers[0].keys[0, :, :REPAIR_CHUNK], stored_first.keys[0])
    # the stale continuation was not written under prefix keys: an exact-only lookup stops after document 0
    exact_out, exact_only = run(model, store, ids, starts, mode=GenerationMode.PREFIX_CACHE)
    assert exact_only.last_reuse[0].cached_tokens == 40
    assert torch.equal(exact_out[0], greedy(model, ids)[0])


def test_content_defined_chunks_hit_a_document_inside_a_plain_prompt():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    doc = torch.randint(1, 128, (120,), generator=torch.Generator().manual_seed(5))
    warm = ChunkReuseCache(store, model, CONTENT)
    model(doc[None], cache=warm, use_cache=True, logits_to_keep=1)
    warm.save()
    prefix = torch.randint(1, 128, (13,), generator=torch.Generator().manual_seed(6))
    ids = torch.cat([prefix, doc, torch.tensor([1, 2, 3])])[None]
    out, cache = run(model, store, ids, chunking=CONTENT, ratio=1.0, write_back=False)
    assert cache.last_reuse[0].hit_chunks >= 3
    assert torch.equal(out[0], greedy(model, ids)[0])
    fixed = ChunkReuseCache(store, model, chunking=REPAIR_CHUNK)  # fixed cuts at a shifted offset find nothing
    model.generate(ids, cache=fixed, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert fixed.last_reuse[0].hit_chunks == 0


def test_selective_with_head_tokens_recomputes_that_many_tokens_of_every_reused_chunk():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents(2)
    for doc in docs:
        warm_alone(model, store, doc)
    ids, starts = shuffled_prompt(docs, [1, 0], torch.tensor([5, 6, 7]))
    _, cache = run(model, store, ids, starts, strategy="selective", ratio=0.0, overlap_k=0, head_tokens=5)
    # doc 1 is an exact prefix hit; doc 0's three content chunks (16, 16, 8 tokens) each get 5 head tokens
    assert cache.last_reuse[0].recomputed_tokens == 15 and cache.last_reuse[0].approx_tokens == 25
    assert sorted(cache.ledgers[0].stale)[:6] == [45, 46, 47, 48, 49, 50]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("strategy", "blend", "RecomputeStrategy must be one of 'none', 'selective', 'cacheblend', got 'blend'"),
        ("ratio", None, "recompute_ratio"),
        ("ratio", "0.5", "recompute_ratio"),
        ("ratio", float("nan"), "recompute_ratio"),
        ("check_layer", None, "check_layer"),
        ("check_layer", 1.5, "check_layer"),
        ("overlap_k", True, "overlap_k"),
        ("context_scale", "2", "context_scale"),
    ],
)
def test_bad_repair_settings_are_config_errors_naming_them(field, value, named):
    with pytest.raises(ConfigError, match=named):
        RepairConfig(**{field: value})


def test_an_unknown_mode_is_a_config_error_naming_the_modes():
    with pytest.raises(ConfigError, match="'baseline', 'prefix_cache', 'chunk_kv_reuse', got 'fast'"):
        GenerationMode("fast")
    with pytest.raises(ConfigError, match="got \\['prefix'\\]"):
        GenerationMode(["prefix"])
    assert GenerationMode("prefix") is GenerationMode.PREFIX_CACHE  # a former spelling still names its mode
