"""No request fails or serves wrong K/V because of a tier: write-through survives SIGKILL, a full, unopenable or
deleted disk directory degrades to RAM, use after close is a miss, unquantizable chunks are skipped."""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from helpers import key, python_child, raw_entry, run_python

from kvboost_hf import ChunkReuseCache
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.chunk_store import ChunkStore, _close_at_exit
from kvboost_hf.store.config import StoreConfig

_PROMPTS = 12
_GENERATE = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)


def prompt(i: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, 40 + i), generator=torch.Generator().manual_seed(100 + i))


_SERVING_PROCESS = textwrap.dedent(
    """
    import sys
    from conftest import make_tiny_model
    from test_store_faults import prompt, _GENERATE, _PROMPTS
    from kvboost_hf import ChunkReuseCache, ChunkStore, StoreConfig

    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26, disk_cache_dir=sys.argv[1]))  # never closed: killed with SIGKILL
    for i in range(_PROMPTS):
        model.generate(prompt(i), cache=ChunkReuseCache(store, model, chunking=16), **_GENERATE)
        if i == 2:
            store.flush()
            print("ready", flush=True)
    store.flush()
    print("done", flush=True)
    import time
    time.sleep(600)
    """
)


def test_sigkill_during_write_through_loses_only_queued_writes(tmp_path: Path):
    """A serving process killed at a random moment: a new one on the directory reuses what reached the disk,
    and every reuse gives the full-prefill output."""
    proc = python_child(_SERVING_PROCESS, tmp_path, stderr=None)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(random.uniform(0.0, 1.5))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    model = make_tiny_model("llama")
    with ChunkStore(StoreConfig(1 << 26, disk_cache_dir=tmp_path)) as store:
        survivors = store.stats()["disk_chunks"]
        assert survivors >= 9  # the first three prompts' chunks were flushed before "ready"
        reused = []
        for i in range(_PROMPTS):
            cache = ChunkReuseCache(store, model, chunking=16, write_back=False)
            out = model.generate(prompt(i), cache=cache, **_GENERATE)
            assert torch.equal(out, model.generate(prompt(i), **_GENERATE)), f"prompt {i} differs"
            reused.append(cache.last_reuse[0].cached_tokens)
        # the first three prompts (40-42 tokens, two chunks each) were flushed: the first one too, whose generate()
        # was looked up before its cache existed (its write-back was once lost)
        assert min(reused[:3]) >= 32, reused
        assert store.stats()["corrupt"] == 0


def test_store_dropped_without_close_keeps_its_entries(tmp_path: Path):
    code = textwrap.dedent(
        """
        import os, sys, time
        from chunks import key, raw_entry
        from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

        store = ChunkStore(StoreConfig(1 << 24, disk_cache_dir=sys.argv[1]))
        for i in range(20):
            store.put(key(i), raw_entry(tokens=64, seed=i))
        while store.stats()["disk_queued"]:
            time.sleep(0.01)
        os.kill(os.getpid(), 9)
        """
    )
    done = run_python(code, str(tmp_path))
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    with ChunkStore(StoreConfig(1 << 24, disk_cache_dir=tmp_path)) as store:
        for i in range(20):
            got = store.get(key(i))
            assert got is not None and torch.equal(got.keys, raw_entry(tokens=64, seed=i).keys)
        assert store.stats()["disk_hits"] == 20


_FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    import torch
    from chunks import key, raw_entry
    from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, like ENOSPC
    resource.setrlimit(resource.RLIMIT_FSIZE, (96 << 10, 96 << 10))
    store = ChunkStore(StoreConfig(1 << 26, disk_cache_dir=sys.argv[1]))
    served = 0
    for i in range(30):
        store.put(key(i), raw_entry(tokens=200, seed=i))
        got = store.get(key(i))
        served += got is not None and bool(torch.equal(got.keys, raw_entry(tokens=200, seed=i).keys))
    store.flush()
    stats = store.stats()
    store.close()
    print(json.dumps({"served": served, "disk_errors": stats["disk_errors"], "disk_chunks": stats["disk_chunks"]}))
    """
)


def test_full_disk_degrades_to_ram(tmp_path: Path):
    done = run_python(_FULL_DISK, str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["served"] == 30 and result["disk_errors"] > 0 and result["disk_chunks"] < 30


def test_unopenable_disk_directory_is_not_a_constructor_error(tmp_path: Path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING):
        store = ChunkStore(StoreConfig(1 << 20, disk_cache_dir=blocker / "cache"))
    with store:
        store.put(key(1), raw_entry())
        assert store.get(key(1)) is not None
        assert store.stats()["disk_disabled"] == 1
    assert "disk tier disabled" in caplog.text


def test_directory_deleted_while_serving(tmp_path: Path, caplog):
    model = make_tiny_model("llama")
    directory = tmp_path / "cache"
    with ChunkStore(StoreConfig(1 << 26, disk_cache_dir=directory)) as store:
        for i in range(6):
            if i == 2:
                store.flush()
                shutil.rmtree(directory)
            cache = ChunkReuseCache(store, model, chunking=16)
            for _ in range(2):  # the second call reuses from RAM
                out = model.generate(prompt(i), cache=cache, **_GENERATE)
                cache = ChunkReuseCache(store, model, chunking=16)
            assert torch.equal(out, model.generate(prompt(i), **_GENERATE))
        store.flush()
        assert store.stats()["disk_disabled"] == 1
    assert "deleted" in caplog.text


def test_use_after_close_is_a_miss(tmp_path: Path):
    store = ChunkStore(StoreConfig(0, disk_cache_dir=tmp_path))  # no RAM: entries live on disk only
    store.put(key(1), raw_entry())
    store.close()
    assert store.get(key(1)) is None and not store.contains(key(1))
    store.put(key(2), raw_entry())
    assert store.tail_lengths(None) == []
    store.close()
    other = ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path / "b"))
    _close_at_exit(lambda: other)  # what the interpreter runs at exit
    other.put(key(3), raw_entry())
    assert other.get(key(3)) is not None and other.get(key(4)) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 40000.0])
def test_unquantizable_chunks_are_skipped(bad: float, caplog):
    store = ChunkStore(StoreConfig(1 << 20, kv_cache_bits=4))
    entry = raw_entry()
    keys = entry.keys.clone()
    keys[0, 0, 0, 0] = bad
    with caplog.at_level(logging.WARNING):
        store.put(key(1), ChunkKV(keys, entry.values))
    store.put(key(2), entry)
    assert store.get(key(1)) is None and store.get(key(2)) is not None
    assert store.stats()["skipped"] == 1 and "not stored" in caplog.text


def test_unquantizable_chunk_does_not_fail_generation():
    """A model whose K/V exceed float16 statistics still generates with a 4-bit store (the chunks are skipped)."""
    model = make_tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1e6)
    store = ChunkStore(StoreConfig(1 << 24, kv_cache_bits=4))
    cache = ChunkReuseCache(store, model, chunking=16)
    out = model.generate(prompt(0), cache=cache, **_GENERATE)
    assert out.shape[1] > prompt(0).shape[1] and store.stats()["skipped"] > 0


def test_tail_index_survives_a_restart(tmp_path: Path):
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path)) as store:
        store.note_tail("ab" * 32, 7)
        store.note_tail(None, 3)
    with ChunkStore(StoreConfig(1 << 20, disk_cache_dir=tmp_path)) as reopened:
        assert reopened.tail_lengths("ab" * 32) == [7] and reopened.tail_lengths(None) == [3]


def test_restart_reuses_the_unfinished_chunk(tmp_path: Path):
    """A conversation's second turn after a restart reuses the first turn's unfinished last chunk."""
    model = make_tiny_model("llama")
    with ChunkStore(StoreConfig(1 << 26, disk_cache_dir=tmp_path)) as store:
        cache = ChunkReuseCache(store, model, chunking=16)
        first = model.generate(prompt(3), cache=cache, **_GENERATE)
    second_turn = torch.cat([first, prompt(4)[:, :5]], dim=1)
    with ChunkStore(StoreConfig(1 << 26, disk_cache_dir=tmp_path)) as store:
        cache = ChunkReuseCache(store, model, chunking=16)
        out = model.generate(second_turn, cache=cache, **_GENERATE)
        assert cache.last_reuse[0].cached_tokens > 32  # two full chunks and the tail
    assert torch.equal(out, model.generate(second_turn, **_GENERATE))
