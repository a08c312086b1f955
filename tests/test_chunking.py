"""Chunk cut points: full chunks only, contiguous, deterministic, stable under extension."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvboost_hf.core.chunking import ChunkingConfig, check_segment_starts, chunk_spans
from kvboost_hf.core.errors import ConfigError, InputError

token_lists = st.lists(st.integers(0, 20), max_size=300)
configs = st.builds(
    lambda size, window: ChunkingConfig(size, min(window, size - 1), frozenset({0, 1})),
    st.integers(1, 40),
    st.integers(0, 10),
)


@given(token_lists, configs)
def test_spans_are_full_contiguous_and_bounded(tokens, config):
    spans = chunk_spans(tokens, config)
    assert all(a == b for (_, a), (b, _) in itertools.pairwise(spans))
    assert not spans or spans[0][0] == 0
    for start, end in spans:
        assert config.chunk_size - config.boundary_window <= end - start <= config.chunk_size
    tail = len(tokens) - (spans[-1][1] if spans else 0)
    assert 0 <= tail < config.chunk_size  # what is left is the live tail, shorter than a chunk
    if not config.boundary_window:
        assert len(spans) == len(tokens) // config.chunk_size


@given(token_lists, token_lists, configs)
def test_chunks_of_a_prefix_are_a_prefix_of_the_chunks(tokens, extension, config):
    assert chunk_spans(tokens + extension, config)[: len(chunk_spans(tokens, config))] == chunk_spans(tokens, config)


any_method_configs = st.one_of(
    configs, st.builds(lambda size: ChunkingConfig(size, method="content"), st.integers(4, 40))
)


@given(
    st.lists(st.integers(0, 30000), min_size=1, max_size=40),
    st.lists(st.integers(0, 30000), min_size=1, max_size=200),
    st.integers(4, 24),
)
def test_a_segments_content_cuts_do_not_depend_on_what_precedes_it(header, document, size):
    """A document placed as a segment is cut as when it stands alone (its rolling hash starts at the segment
    start), so the chunks a document warmed alone stored hit wherever it is placed."""
    config = ChunkingConfig(size, method="content")
    alone = chunk_spans(document, config, 0, [0, len(document)])
    tokens = header + document
    placed = chunk_spans(tokens, config, 0, [0, len(header), len(tokens)])
    assert [(s - len(header), e - len(header)) for s, e in placed if s >= len(header)] == alone
    resumed = chunk_spans(tokens, config, placed[-2][1], [0, len(header), len(tokens)]) if len(placed) > 1 else []
    assert resumed == placed[len(placed) - len(resumed) :]  # restarting mid-segment cuts the same


@given(token_lists, st.data(), any_method_configs)
def test_fewer_new_tokens_than_the_shortest_chunk_complete_no_chunk(tokens, data, config):
    """What lets a decode step's save skip a row: past a row's last chunk, fewer than ``shortest_chunk`` new
    tokens never complete one (fixed chunks with a boundary window, content-defined chunks)."""
    spans = chunk_spans(tokens, config)
    end = spans[-1][1] if spans else 0
    room = max(0, config.shortest_chunk - 1 - (len(tokens) - end))
    extension = data.draw(st.lists(st.integers(0, 20), max_size=room))
    assert chunk_spans(tokens + extension, config, end) == []


@given(token_lists, configs)
def test_cuts_take_the_latest_boundary_inside_the_window(tokens, config):
    for start, end in chunk_spans(tokens, config):
        nominal = start + config.chunk_size
        window = range(nominal - config.boundary_window, nominal + 1)
        ends_at_boundary = [cut for cut in window if tokens[cut - 1] in config.boundary_token_ids]
        assert end == (max(ends_at_boundary) if ends_at_boundary and config.boundary_window else nominal)


def test_cut_slides_back_to_a_sentence_end():
    config = ChunkingConfig(8, 3, frozenset({99}))
    tokens = [1, 2, 3, 4, 99, 5, 6, 7, 8, 9, 10]
    assert chunk_spans(tokens, config) == [(0, 5)]


@pytest.mark.parametrize("size", [0, -3, 1.5])
def test_bad_chunk_size_is_refused(size):
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkingConfig(size)


def test_window_needs_boundary_tokens():
    with pytest.raises(ValueError, match="boundary_token_ids"):
        ChunkingConfig(16, 4)


def test_chunking_default_is_written_once():
    """Every place that takes ``chunking`` defaults to ChunkingConfig's own default (no second 128)."""
    import inspect

    from kvboost_hf.engine import InferenceEngine
    from kvboost_hf.hf.cache import ChunkReuseCache

    assert ChunkingConfig.of(None) == ChunkingConfig()
    assert ChunkingConfig.of(64) == ChunkingConfig(64)
    config = ChunkingConfig(32, method="content")
    assert ChunkingConfig.of(config) is config
    assert ChunkingConfig.from_tokenizer(object()).chunk_size == ChunkingConfig().chunk_size
    for taker in (InferenceEngine.__init__, ChunkReuseCache.__init__):
        assert inspect.signature(taker).parameters["chunking"].default is None


@pytest.mark.parametrize("value", ["128", True, 1.5])
def test_chunking_of_refuses_what_is_not_a_config_or_a_size(value):
    with pytest.raises(TypeError, match="chunking must be"):
        ChunkingConfig.of(value)


def test_boundary_settings_are_checked_and_token_ids_kept_as_a_set():
    assert ChunkingConfig(8, 2, [3, 1, 3]).boundary_token_ids == frozenset({1, 3})  # hashable whatever was given
    hash(ChunkingConfig(8, 2, [3, 1]))
    with pytest.raises(ConfigError, match="chunk_boundary_window"):
        ChunkingConfig(8, True, frozenset({1}))
    for ids in (["."], 5, "12"):
        with pytest.raises(ConfigError, match="boundary_token_ids"):
            ChunkingConfig(8, 2, ids)


@given(st.lists(st.integers(0, 10_000), max_size=8))
def test_segment_starts_become_sorted_distinct_offsets(offsets):
    assert check_segment_starts(offsets) == tuple(sorted(set(offsets)))
    assert check_segment_starts(np.array(offsets, dtype=np.int64)) == tuple(sorted(set(offsets)))


@pytest.mark.parametrize("value", [["a", 3], [2.5], [-4, 16], 5, "0 16", [[0, 16]], [True], None])
def test_bad_segment_starts_are_input_errors_naming_them(value):
    with pytest.raises(InputError, match="segment_starts"):
        check_segment_starts(value)
