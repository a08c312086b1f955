"""Pickle-free records: exact round trips, and every kind of damage is refused."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import assert_same, make_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.codec import MAGIC, CorruptEntryError, decode, encode

KEY = "ab" * 32


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    bits=st.sampled_from([16, 8, 4]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_round_trip_is_exact(tokens, bits, dtype, seed):
    entry = make_entry(tokens, bits, dtype, seed)
    record = encode(KEY, entry)
    assert record[:4] == MAGIC and len(record) % 64 == 0
    assert_same(decode(KEY, record), entry)
    assert_same(decode(KEY, bytes(record)), entry)  # read-only buffers (Redis replies) are accepted


def test_record_overhead_is_small():
    entry = make_entry(128)
    assert len(encode(KEY, entry)) - entry.nbytes < 512


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), position=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_any_flipped_byte_is_refused(bits, position, flip):
    record = encode(KEY, make_entry(bits=bits))
    record[int(position * len(record))] ^= flip
    with pytest.raises(CorruptEntryError):
        decode(KEY, record)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), position=st.floats(0, 1, exclude_max=True))
def test_truncated_or_extended_records_are_refused(bits, position):
    record = encode(KEY, make_entry(bits=bits))
    with pytest.raises(CorruptEntryError):
        decode(KEY, record[: int(position * len(record))])
    with pytest.raises(CorruptEntryError):
        decode(KEY, record + b"\0")


def test_record_under_another_key_is_refused():
    record = encode(KEY, make_entry())
    with pytest.raises(CorruptEntryError, match="stored under key"):
        decode("cd" * 32, record)


def test_foreign_bytes_are_refused():
    with pytest.raises(CorruptEntryError):
        decode(KEY, pickle.dumps(make_entry()))
    with pytest.raises(CorruptEntryError):
        decode(KEY, b"not a record at all, not a record at all, not a record")


def test_decoded_tensors_do_not_alias_the_encoder_input():
    entry = make_entry()
    assert isinstance(entry, ChunkKV)
    decoded = decode(KEY, encode(KEY, entry))
    assert isinstance(decoded, ChunkKV)
    entry.keys.zero_()
    assert decoded.keys.abs().sum() > 0
