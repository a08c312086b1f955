"""Stored chunks and keys for the store tests, and a tier defined outside the package (:class:`DictTier`). Light to
import (torch and the store, not transformers' model code: about 3 s of CPU less for each child process of the disk,
fault and hardening tests). :mod:`helpers` re-exports the chunks and keys."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.base import StorageTier, StoredChunk
from kvboost_hf.store.quantization import QuantizedChunk, quantize_chunk


def key(i: int) -> str:
    """A valid 64-hex-digit store key numbered ``i``."""
    return f"{i:064x}"


def make_entry(tokens: int = 9, bits: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0) -> StoredChunk:
    """A random chunk (keys and values ``[2, 3, tokens, 8]``): raw at 16 bits, else quantized in groups of 4."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, tokens, 8, generator=gen).to(dtype)
    values = torch.randn(2, 3, tokens, 8, generator=gen).to(dtype)
    return ChunkKV(keys, values) if bits == 16 else quantize_chunk(keys, values, bits, 4)


def raw_entry(tokens: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32) -> ChunkKV:
    """:func:`make_entry` unquantized."""
    entry = make_entry(tokens=tokens, seed=seed, dtype=dtype)
    assert isinstance(entry, ChunkKV)
    return entry


def assert_same(a: StoredChunk, b: StoredChunk) -> None:
    """``a`` and ``b`` are the same chunk bit for bit (type, dtype, quantization layout and every tensor)."""
    assert type(a) is type(b)
    if isinstance(a, QuantizedChunk):
        assert isinstance(b, QuantizedChunk)
        for qa, qb in ((a.keys, b.keys), (a.values, b.values)):
            layout_a = (qa.shape, qa.dtype, qa.bits, qa.group_size, qa.per_channel)
            assert layout_a == (qb.shape, qb.dtype, qb.bits, qb.group_size, qb.per_channel)
            for ta, tb in ((qa.data, qb.data), (qa.scale, qb.scale), (qa.zero, qb.zero)):
                assert torch.equal(ta, tb)
    else:
        assert isinstance(b, ChunkKV)
        assert a.keys.dtype == b.keys.dtype and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def flip_inside_record(directory: Path, record: bytes | bytearray, offset: int) -> None:
    """Flip one bit of the byte ``offset`` bytes into ``record`` where it lies in the disk tier's ``data.mdb`` under
    ``directory`` (found by its first 256 bytes)."""
    data = (directory / "data.mdb").read_bytes()
    start = data.find(bytes(record[:256]))
    assert start >= 0, "record not found in data.mdb"
    with open(directory / "data.mdb", "r+b") as f:
        f.seek(start + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


class DictTier(StorageTier):
    """A whole tier in a few lines: only the abstract members; batching, tails, flush and stats are defaults."""

    name = "dict"

    def __init__(self) -> None:
        self.entries: dict[str, StoredChunk] = {}
        self.lock = threading.Lock()

    def get(self, key: str) -> StoredChunk | None:
        with self.lock:
            return self.entries.get(key)

    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        with self.lock:
            self.entries[key] = entry
        return []

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self.entries

    def delete(self, key: str) -> None:
        with self.lock:
            self.entries.pop(key, None)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(entry.nbytes for entry in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)
