"""ChunkReuseCache as a drop-in ``cache`` (``past_key_values`` before transformers 5.24): exact reuse on every tiny
architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, make_tiny_model
from transformers import DynamicCache

from kvboost_hf import ChunkReuseCache, ChunkStore, GenerationMode
from kvboost_hf.store.config import StoreConfig

CHUNK = 16


@pytest.mark.parametrize("length", [5, CHUNK, 3 * CHUNK, 3 * CHUNK + 1, 60])
def test_reuse_equals_plain_generate(tiny_model, length):
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(length))
    expected, expected_logits = greedy(tiny_model, ids)
    for attempt in range(2):  # first call stores, second reuses
        cache = ChunkReuseCache(store, tiny_model, chunking=CHUNK)
        got, logits = greedy(tiny_model, ids, cache)
        assert torch.equal(got, expected), f"attempt {attempt}"
        assert (logits - expected_logits).abs().max() < 1e-4
    computed = length + 7  # the K/V of prompt + generated tokens except the last one
    assert cache.last_reuse[0].cached_tokens == min(length - 1, (length // CHUNK) * CHUNK)
    assert store.stats()["chunks"] == computed // CHUNK + (computed % CHUNK > 0)  # full chunks + the unfinished one


def test_a_chunked_prefill_reports_what_each_of_its_chunks_loaded(tiny_model):
    """``generate(prefill_chunk_size=...)`` runs the prompt as several forwards: each loads what the store holds for
    its tokens, and ``last_reuse`` sums them over the whole prompt (it reported the first chunk's alone), while the
    decode steps after the first token add nothing; tokens equal plain ``generate()``."""
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    expected, _ = greedy(tiny_model, ids)
    for attempt in range(2):  # the first call stores the prompt's chunks, the second loads them chunk by chunk
        cache = ChunkReuseCache(store, tiny_model, chunking=CHUNK)
        got, _ = greedy(tiny_model, ids, cache, prefill_chunk_size=2 * CHUNK)
        assert torch.equal(got, expected), f"attempt {attempt}"
    (reuse,) = cache.last_reuse
    # prefill chunks [0, 32), [32, 64), [64, 96), [96, 100): each computes its last token (its logits) at least
    assert reuse.prompt_tokens == 100 and reuse.cached_tokens == 3 * (2 * CHUNK - 1) and reuse.hit_chunks == 6
    assert not cache.prompt_in_progress


def test_multi_turn_hits_previous_answer(tiny_model):
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(1)
    history = torch.randint(1, 128, (1, 40), generator=gen)
    previous_len = 0
    for turn in range(3):
        expected, _ = greedy(tiny_model, history, new=12)
        cache = ChunkReuseCache(store, tiny_model, chunking=CHUNK)
        got, _ = greedy(tiny_model, history, cache, new=12)
        assert torch.equal(got, expected)
        if turn:  # everything before this turn's new message was stored by the previous turn
            assert cache.last_reuse[0].cached_tokens >= (previous_len // CHUNK) * CHUNK
        previous_len = got.shape[1] - 1
        history = torch.cat([got, torch.randint(1, 128, (1, 9), generator=gen)], dim=1)


def test_continuing_with_the_same_cache(tiny_model):
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 37), generator=torch.Generator().manual_seed(2))
    cache = ChunkReuseCache(store, tiny_model, chunking=CHUNK)
    first, _ = greedy(tiny_model, ids, cache)
    follow = torch.cat([first, torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(3))], 1)
    got, _ = greedy(tiny_model, follow, cache)
    expected, _ = greedy(tiny_model, follow)
    assert torch.equal(got, expected)


def test_prompt_that_does_not_extend_the_cache_raises():
    model = make_tiny_model("llama")
    cache = ChunkReuseCache(ChunkStore(StoreConfig(1 << 26)), model, chunking=CHUNK)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    greedy(model, ids, cache)
    other = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="does not extend"):
        greedy(model, other, cache)


def test_left_padded_batch_matches_rows_alone():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(6)
    shared = torch.randint(1, 128, (40,), generator=gen)
    rows = [torch.cat([shared, torch.randint(1, 128, (n,), generator=gen)]) for n in (3, 11)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    alone = [greedy(model, r[None])[0][0, len(r) :] for r in rows]
    for _ in range(2):
        cache = ChunkReuseCache(store, model, chunking=CHUNK)
        got, _ = greedy(model, ids, cache, attention_mask=mask)
        for i in range(2):
            assert torch.equal(got[i, width:], alone[i])
    assert all(r.cached_tokens >= 2 * CHUNK for r in cache.last_reuse)


def test_assisted_decoding_crops_the_cache():
    model = make_tiny_model("llama")
    assistant = make_tiny_model("llama", seed=1)
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    expected, _ = greedy(model, ids, new=12)
    for _ in range(2):
        cache = ChunkReuseCache(store, model, chunking=CHUNK)
        out = model.generate(
            ids,
            cache=cache,
            assistant_model=assistant,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )
        assert torch.equal(out, expected)
        assert cache.num_columns == out.shape[1] - 1


def test_beam_search_reorders_rows():
    model = make_tiny_model("qwen2")
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 35), generator=torch.Generator().manual_seed(8))
    expected = model.generate(ids, num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for _ in range(2):
        cache = ChunkReuseCache(store, model, chunking=CHUNK)
        out = model.generate(ids, cache=cache, num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out, expected)


def test_batch_select_and_repeat_keep_tokens_aligned():
    model = make_tiny_model("llama")
    cache = ChunkReuseCache(ChunkStore(StoreConfig(1 << 26)), model, chunking=CHUNK)
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(9))
    model(ids, cache=cache, use_cache=True)
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.tokens, ids.repeat_interleave(2, 0))
    assert cache.layers[0].keys.shape[0] == 4
    cache.batch_select_indices(torch.tensor([3]))
    assert torch.equal(cache.tokens, ids[1:2])
    cache.crop(-5)
    assert cache.num_columns == 15 and cache.get_seq_length() == 15


def test_models_do_not_share_entries():
    first, second = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(10))
    greedy(first, ids, ChunkReuseCache(store, first, chunking=CHUNK))
    cache = ChunkReuseCache(store, second, chunking=CHUNK)
    got, _ = greedy(second, ids, cache)
    assert cache.last_reuse[0].cached_tokens == 0
    assert torch.equal(got, greedy(second, ids)[0])


def test_salted_caches_do_not_share_entries():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(11))
    greedy(model, ids, ChunkReuseCache(store, model, chunking=CHUNK, cache_salt="tenant-a"))
    other = ChunkReuseCache(store, model, chunking=CHUNK, cache_salt="tenant-b")
    greedy(model, ids, other)
    assert other.last_reuse[0].cached_tokens == 0
    same = ChunkReuseCache(store, model, chunking=CHUNK, cache_salt="tenant-a")
    greedy(model, ids, same)
    assert same.last_reuse[0].cached_tokens == 32


def test_baseline_mode_neither_reads_nor_writes():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(12))
    cache = ChunkReuseCache(store, model, chunking=CHUNK, mode=GenerationMode.BASELINE)
    got, _ = greedy(model, ids, cache)
    assert torch.equal(got, greedy(model, ids)[0])
    assert store.stats()["chunks"] == 0 and store.stats()["misses"] == 0


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkReuseCache(ChunkStore(), make_tiny_model("llama"), chunking=0)


def test_batch_reads_a_shared_prefix_from_the_store_once():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    shared = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(13))
    greedy(model, shared, ChunkReuseCache(store, model, chunking=CHUNK))
    hits_before = store.stats()["hits"]
    batch = torch.cat([shared.repeat(3, 1), torch.randint(1, 128, (3, 5))], dim=1)
    cache = ChunkReuseCache(store, model, chunking=CHUNK)
    greedy(model, batch, cache)
    assert store.stats()["hits"] - hits_before == 3  # three shared chunks, read once for three rows
    assert [r.cached_tokens for r in cache.last_reuse] == [48, 48, 48]


@pytest.mark.parametrize("new_message", [5, 40])  # the next turn ends inside, or beyond, the unfinished chunk
def test_stored_tail_lets_the_next_turn_recompute_only_new_tokens(new_message):
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(14)
    first = torch.randint(1, 128, (1, 37), generator=gen)
    cache = ChunkReuseCache(store, model, chunking=CHUNK)
    turn_one, _ = greedy(model, first, cache, new=6)
    cache.save(tail=True)
    known = turn_one.shape[1] - 1  # K/V exist for every token but the last generated one
    follow = torch.cat([turn_one, torch.randint(1, 128, (1, new_message), generator=gen)], dim=1)
    cache = ChunkReuseCache(store, model, chunking=CHUNK)
    got, _ = greedy(model, follow, cache, new=6)
    assert torch.equal(got, greedy(model, follow, new=6)[0])
    assert cache.last_reuse[0].cached_tokens == known
    # a different continuation of the same first chunks does not use the tail
    other = torch.cat([turn_one[:, :34], torch.randint(1, 128, (1, 20), generator=gen)], dim=1)
    cache = ChunkReuseCache(store, model, chunking=CHUNK)
    got, _ = greedy(model, other, cache, new=6)
    assert torch.equal(got, greedy(model, other, new=6)[0])
    assert cache.last_reuse[0].cached_tokens == 2 * CHUNK


def test_a_used_cache_is_freed_without_the_cycle_collector(tiny_model):
    """The cache owns its prefiller and the prefiller holds no cache: no reference cycle keeps a cache's K/V alive
    until the garbage collector runs."""
    import gc
    import weakref

    store = ChunkStore()
    prompt = torch.randint(0, 100, (1, 40))
    cache = ChunkReuseCache(store, tiny_model, chunking=16)
    greedy(tiny_model, prompt, cache, 2)
    freed = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert freed() is None
    finally:
        gc.enable()


def test_a_decode_steps_save_reads_a_rows_tokens_only_when_a_chunk_can_have_completed(monkeypatch):
    """The per-step write-back skips a row in O(1) until enough tokens for a chunk arrived past its last one
    (host work per token that does not grow with the row); it stores exactly the chunks that saving every row at
    every step stores (the behaviour before the skip: the oracle)."""
    from helpers import DECODE_CHUNKING, run_loop

    from kvboost_hf.hf.decode import DecodeRequest
    from kvboost_hf.hf.sampling import SamplingConfig

    model = make_tiny_model("llama")
    prompts = [list(range(3, 23)), list(range(40, 49))]
    requests = [DecodeRequest(prompt_ids=p, max_new_tokens=30, sampling=SamplingConfig(temperature=0)) for p in prompts]
    reads = []
    row_tokens = ChunkReuseCache.row_tokens
    monkeypatch.setattr(ChunkReuseCache, "row_tokens", lambda self, row: reads.append(row) or row_tokens(self, row))

    def stored_after(skip: bool) -> tuple[dict[str, int], list, int]:
        reads.clear()
        if not skip:
            monkeypatch.setattr(ChunkReuseCache, "_no_chunk_completed", lambda self, row, ledger: False)
        store = ChunkStore(StoreConfig(1 << 24))
        loop = run_loop(model, requests, store)
        return store.stats(), [row.tokens for row in loop.rows], len(reads)

    skipping, tokens, skipping_reads = stored_after(skip=True)
    every_step, expected_tokens, every_step_reads = stored_after(skip=False)
    assert tokens == expected_tokens and skipping["chunks"] == every_step["chunks"] > 0
    assert skipping["ram_bytes"] == every_step["ram_bytes"] and skipping["puts"] == every_step["puts"]
    steps = max(len(t) for t in tokens)
    chunks_per_row = [(len(p) + len(t)) // DECODE_CHUNKING.chunk_size for p, t in zip(prompts, tokens, strict=True)]
    assert every_step_reads >= 2 * steps  # every row, every step
    assert skipping_reads <= sum(chunks_per_row) + 2 * len(prompts)  # at chunk completions and the ends


def _generate(model, ids, cache=None, **kwargs):
    extra = {"cache": cache} if cache is not None else {}
    return model.generate(ids, do_sample=False, pad_token_id=0, max_new_tokens=6, **extra, **kwargs)


def _tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def test_a_continuation_that_masks_tokens_inside_the_row_neither_loads_nor_stores():
    """Turn 2 on the same cache with a gap in its mask (e.g. padding kept after an early end) computes K/V that a
    full prefill does not: they are not stored (a later unmasked request was served them), and stored chunks
    computed unmasked are not loaded into it; both turns equal plain generate() with the same masks."""
    model = make_tiny_model("llama", seed=7)
    model.generation_config.eos_token_id = None
    store = ChunkStore(StoreConfig(1 << 26))
    cache = ChunkReuseCache(store, model, 8)
    first = _generate(model, _tokens(16, 0), cache)
    follow = torch.cat([first, _tokens(20, 1)], 1)
    _generate(model, follow, ChunkReuseCache(store, model, 8))  # the store now holds follow's chunks, unmasked
    puts = store.stats()["puts"]
    mask = torch.ones_like(follow)
    mask[0, 4:30] = 0
    out = _generate(model, follow, cache, attention_mask=mask)
    assert torch.equal(out, _generate(model, follow, attention_mask=mask))
    assert not cache.reuse_enabled and store.stats()["puts"] == puts
    fresh = ChunkReuseCache(store, model, 8)
    assert torch.equal(_generate(model, follow, fresh), _generate(model, follow))
    assert fresh.last_reuse[0].cached_tokens == 40


def test_a_continuation_from_inputs_embeds_acts_as_a_dynamic_cache():
    """Token ids unknown from then on: reuse and write-back stop, and the output equals a DynamicCache's (it
    raised "the cache is inconsistent")."""
    model = make_tiny_model("llama", seed=8)
    model.generation_config.eos_token_id = None
    outputs = []
    for cache in (DynamicCache(config=model.config), ChunkReuseCache(ChunkStore(), model, 8)):
        follow = torch.cat([_generate(model, _tokens(20, 1), cache), _tokens(5, 9)], 1)
        embeds = model.get_input_embeddings()(follow).detach()
        outputs.append(
            model.generate(inputs_embeds=embeds, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        )
    assert torch.equal(outputs[0], outputs[1])


def test_use_cache_false_records_and_stores_nothing():
    """transformers then feeds whole sequences again, positions restarting at 0: those K/V are not chunks."""
    model = make_tiny_model("llama", seed=9)
    store = ChunkStore()
    cache = ChunkReuseCache(store, model, 8)
    _generate(model, _tokens(20, 1), cache, use_cache=False)
    assert cache.num_columns == 0 and store.stats()["puts"] == 0


def test_a_drop_in_cache_is_exact_unless_asked_for_approximate_hits():
    """By default a drop-in cache takes exact prefix hits only, even where the store holds the same document by
    content key (stored by a request with segments): it found them at a new position and gave other tokens than
    plain generate(). ``mode="chunk_kv_reuse"`` takes them."""
    model = make_tiny_model("llama", seed=10)
    model.generation_config.eos_token_id = None
    store = ChunkStore(StoreConfig(1 << 26))
    document, question = _tokens(24, 16), _tokens(8, 17)
    first = torch.cat([_tokens(8, 14), document, question], 1)
    _generate(model, first, ChunkReuseCache(store, model, 8, mode="chunk_kv_reuse", segment_starts=[0, 8, 32]))
    prompt = torch.cat([_tokens(8, 15), document, question], 1)
    exact = ChunkReuseCache(store, model, 8, write_back=False)
    assert torch.equal(_generate(model, prompt, exact), _generate(model, prompt))
    assert exact.last_reuse[0].approx_tokens == 0
    approximate = ChunkReuseCache(store, model, 8, mode="chunk_kv_reuse")
    _generate(model, prompt, approximate)
    assert approximate.last_reuse[0].approx_tokens > 0


@pytest.mark.parametrize("driven", ["hooks", "explicit"])
def test_a_forward_outside_no_grad_over_loaded_chunks_runs(driven):
    """The prefill stitches loaded K/V as views made under ``no_grad``; the next forward in grad mode (the
    docs' loop without hooks, or ``model(ids, cache=...)``, neither wrapped in ``no_grad``) wrote into them and
    autograd raised "a view was created in no_grad mode". The cache's K/V carry no gradient: it runs, and its
    logits equal a DynamicCache's."""
    model = make_tiny_model("llama", seed=15)
    ids = _tokens(40, 3)
    store = ChunkStore()
    with torch.no_grad():
        model(ids, cache=(first := ChunkReuseCache(store, model, 8)), use_cache=True, logits_to_keep=1)
    first.save()
    expected = model(ids, cache=DynamicCache(config=model.config), logits_to_keep=1).logits
    cache = ChunkReuseCache(store, model, 8, adapter=driven == "hooks")
    if driven == "hooks":
        logits = model(ids, cache=cache, logits_to_keep=1).logits
    else:
        inputs = cache.prefill(ids).model_inputs()
        logits = model.forward(**inputs, cache=cache, use_cache=True, logits_to_keep=1).logits
        cache.record(inputs["input_ids"])
    assert cache.last_reuse[0].cached_tokens == 39
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
