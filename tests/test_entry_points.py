"""ChunkReuseCache's explicit entry points (prefill, record, save) without the hooks, the write-back logits
processor, and the two wrong-output defects found with transformers' generation paths."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import make_tiny_model
from helpers import word_tokenizer, words
from transformers import LogitsProcessor

from kvboost_hf import ChunkingConfig, ChunkReuseCache, ChunkStore, ChunkWriteBack, RepairConfig
from kvboost_hf.store.config import StoreConfig

CHUNK = 16
NEW = 8


def plain(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)


def manual_greedy(model, cache, ids, defer=False):
    """Greedy decoding with forward() only (hooks never run), driving the cache by hand."""
    pending = cache.prefill(ids, defer=defer)
    tokens = ids
    with torch.no_grad():
        inputs = pending.model_inputs()
        for _ in range(NEW):
            out = model.forward(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
            cache.record(inputs["input_ids"])
            step = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, step], dim=1)
            inputs = {"input_ids": step}
    cache.save(tail=True)
    return tokens


def test_prefill_and_save_without_hooks_equal_plain_generate_and_hit_next_time():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    ids = torch.randint(1, 128, (1, 45), generator=torch.Generator().manual_seed(0))
    expected = plain(model, ids)
    first = ChunkReuseCache(store, model, CHUNK)
    assert torch.equal(manual_greedy(model, first, ids), expected)
    second = ChunkReuseCache(store, model, CHUNK)
    assert torch.equal(manual_greedy(model, second, ids), expected)
    assert second.last_reuse[0].cached_tokens == 32  # two full chunks; the last prompt token is computed


def test_sparse_prefill_runs_its_repair_forward_or_defers_it():
    model = make_tiny_model("qwen2")
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 128, (40,), generator=gen) for _ in range(2)]
    for doc in docs:
        warm = ChunkReuseCache(store, model, CHUNK, segment_starts=[0, 40])
        warm.prefill(doc[None], keep=0)
        model.forward(input_ids=doc[None], cache=warm, use_cache=True)
        warm.record(doc[None])
        warm.save()
    ids = torch.cat([docs[1], docs[0], torch.tensor([3, 4, 5])])[None]
    expected = plain(model, ids)
    for defer in (False, True):  # ratio 1: every reused token recomputed, so the output equals plain generate
        cache = ChunkReuseCache(
            store, model, CHUNK, RepairConfig("cacheblend", 1.0), segment_starts=[0, 40, 80], write_back=False
        )
        assert torch.equal(manual_greedy(model, cache, ids, defer=defer), expected)
        assert cache.last_reuse[0].hit_chunks == 6 and cache.last_reuse[0].recomputed_tokens > 0


class StoreWatch(LogitsProcessor):
    """Records how many chunks the store holds at each step, after the write-back processor ran."""

    def __init__(self, store):
        self.store, self.counts = store, []

    def __call__(self, input_ids, scores):
        self.counts.append(self.store.stats()["chunks"])
        return scores


def test_write_back_processor_writes_during_generation_and_the_next_turn_hits_the_tail():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(2)
    history = torch.randint(1, 128, (1, 40), generator=gen)
    cache = ChunkReuseCache(store, model, CHUNK)
    watch = StoreWatch(store)
    turn1 = model.generate(
        history,
        cache=cache,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        logits_processor=[ChunkWriteBack(cache), watch],
    )
    assert watch.counts[0] == 0  # nothing written before the first token
    assert watch.counts[1] == 2  # the prompt's two full chunks, written at the next step
    assert store.stats()["chunks"] == 4  # 51 tokens with K/V: three full chunks and the unfinished one (3 tokens)
    history = torch.cat([turn1, torch.randint(1, 128, (1, 9), generator=gen)], dim=1)
    cache = ChunkReuseCache(store, model, CHUNK)
    got = model.generate(
        history,
        cache=cache,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        logits_processor=[ChunkWriteBack(cache)],
    )
    assert cache.last_reuse[0].cached_tokens == 51  # 48 in chunks + the previous turn's 3-token tail
    assert torch.equal(got, plain(model, history))


def test_crop_works_when_reuse_is_off_for_a_call():
    """Defect: a mask that is not left padding turned reuse off, crop() then did nothing and prompt-lookup
    decoding returned different tokens from plain generate()."""
    model = make_tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    mask[0, 1] = 0
    options = dict(attention_mask=mask, prompt_lookup_num_tokens=4, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **options)
    cache = ChunkReuseCache(ChunkStore(StoreConfig(1 << 26)), model, 4)
    assert torch.equal(model.generate(ids, cache=cache, **options), expected)
    assert not cache.reuse_enabled


def test_left_padded_rows_are_written_back_and_reused():
    """Defect: padded rows' exactness compared 0 with -pad, so they were never stored."""
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 128, (n,), generator=gen) for n in (40, 36)]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 40 - len(row) :], mask[i, 40 - len(row) :] = row, 1
    expected = plain(model, ids, attention_mask=mask)
    for _ in range(2):  # cold, then warm
        cache = ChunkReuseCache(store, model, CHUNK)
        assert torch.equal(plain(model, ids, attention_mask=mask, cache=cache), expected)
    # both rows hit two chunks; the batch skips the 32 columns every row covers, 4 of them padding in row 1
    assert [r.cached_tokens for r in cache.last_reuse] == [32, 28]


def test_namespace_follows_the_store_precision():
    model = make_tiny_model("llama")
    namespaces = {
        ChunkReuseCache(ChunkStore(), model).namespace,
        ChunkReuseCache(ChunkStore(StoreConfig(kv_cache_bits=4)), model).namespace,
        ChunkReuseCache(ChunkStore(StoreConfig(kv_cache_bits=4, kv_group_size=16)), model).namespace,
        ChunkReuseCache(ChunkStore(StoreConfig(kv_cache_bits=8)), model).namespace,
        ChunkReuseCache(ChunkStore(), model, ChunkingConfig(64)).namespace,
    }
    assert len(namespaces) == 5


def usage_snippet(heading: str) -> str:
    """The first python block of docs/usage.md after the paragraph starting with ``heading``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    after = text[text.index(heading) :]
    return after[after.index("```python\n") + len("```python\n") : after.index("\n```", after.index("```python"))]


def test_the_usage_docs_write_back_snippet_runs_and_its_next_turn_hits(capsys):
    """docs/usage.md's write-back example, run as written with the installed transformers (5.x returns a
    BatchEncoding from ``apply_chat_template(..., return_tensors="pt")`` unless ``return_dict=False``: the snippet
    raised AttributeError in ``generate``)."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + ' w2 ' }}{% endfor %}"
    messages = [{"role": "system", "content": words(3, 90)}, {"role": "user", "content": "w5 w6"}]
    namespace = {"model": make_tiny_model("llama"), "tokenizer": tokenizer, "messages": messages}
    exec(usage_snippet("**Write-back as generation proceeds.**"), namespace)
    prompt_tokens = namespace["history"].shape[1]
    assert namespace["cache"].last_reuse[0].cached_tokens >= 64  # the earlier turn's chunks at least
    assert capsys.readouterr().out.endswith(f"of {prompt_tokens} prompt tokens loaded\n")
