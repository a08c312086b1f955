"""The engine passes the store's tier options through, and a disk tier shares entries across engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from oracle import oracle_text

from kvboost_hf import KVBoost, StoreConfig


@pytest.mark.slow
def test_store_options_reach_the_tiers_and_a_second_engine_reuses_the_disk(embedded_engine, tmp_path: Path):
    model, tokenizer = embedded_engine.model, embedded_engine.tokenizer
    prompt = "The disk tier keeps what it promises. " * 20
    tiers = StoreConfig(max_bytes=1 << 26, disk_cache_dir=tmp_path, disk_max_bytes=64 << 20)
    first = KVBoost(model, tokenizer, chunking=64, store=tiers)
    assert first.store.disk is not None and first.store.disk.max_bytes == 64 << 20
    expected = oracle_text(first, prompt, 4)  # transformers' greedy text
    assert first.generate(prompt, max_new_tokens=4).output_text == expected  # computed, then written to disk
    first.store.flush()  # the engine is dropped without close(): write-through already put everything on disk
    second = KVBoost(model, tokenizer, chunking=64, store=StoreConfig(disk_cache_dir=tmp_path / "other"))
    assert second.store.stats()["disk_chunks"] == 0
    third = KVBoost(model, tokenizer, chunking=64, store=StoreConfig(disk_cache_dir=tmp_path, max_bytes=0))
    result = third.generate(prompt, max_new_tokens=4)
    assert result.output_text == expected and result.cached_tokens > 0
    assert third.store.stats()["disk_hits"] > 0
    for engine in (first, second, third):
        engine.store.close()
