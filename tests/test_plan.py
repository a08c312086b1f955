"""The reuse planner on its own: fake token sequences, a dict-backed store, no model, no cache tensors.

Modelled on how vLLM tests its prefix cache: store what a sequence would write, then ask what another one hits.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.chunking import ChunkingConfig, chunk_spans
from kvboost_hf.core.keys import KeySpace, chain_prefix_keys, content_key, prefix_key
from kvboost_hf.reuse.plan import ChunkLedger, has_nonprefix_hits, plan_reuse
from kvboost_hf.scheduling import BatchPolicy

NS = "test-namespace"
CHUNK = 4


class DictStore:
    """The reads the planner makes, over a dict; counts reads per key and keys per batched read."""

    def __init__(self) -> None:
        self.entries: dict[str, ChunkKV] = {}
        self.tails: dict[str | None, list[int]] = {}
        self.reads: dict[str, int] = {}
        self.batches: list[int] = []  # keys per get_many call

    def get(self, key: str, device=None) -> ChunkKV | None:
        self.reads[key] = self.reads.get(key, 0) + 1
        return self.entries.get(key)

    def get_many(self, keys, device=None) -> list[ChunkKV | None]:
        self.batches.append(len(keys))
        return [self.get(key) for key in keys]

    def contains_many(self, keys) -> list[bool]:
        return [key in self.entries for key in keys]

    def tail_lengths(self, parent_key: str | None) -> list[int]:
        return sorted(self.tails.get(parent_key, []), reverse=True)

    def put(self, key: str, num_tokens: int) -> None:
        self.entries[key] = ChunkKV(torch.zeros(1, 1, num_tokens, 2), torch.zeros(1, 1, num_tokens, 2))

    def store_prefix(self, tokens: list[int], config: ChunkingConfig, starts=()) -> list[str]:
        """What a finished prompt writes: every full chunk under its prefix key."""
        spans = chunk_spans(tokens, config, segment_starts=starts)
        keys = chain_prefix_keys(NS, tokens, spans)
        for (start, end), key in zip(spans, keys, strict=True):
            self.put(key, end - start)
        return keys

    def store_tail(self, parent: str | None, tokens: list[int]) -> None:
        self.put(prefix_key(NS, parent, tokens), len(tokens))
        self.tails.setdefault(parent, []).append(len(tokens))

    def store_content(self, tokens: list[int]) -> None:
        self.put(content_key(NS, tokens), len(tokens))


def plan(store, rows, present=None, limits=None, config=None, approximate=False, starts=()):
    config = config or ChunkingConfig(CHUNK)
    ledgers = [ChunkLedger(segment_starts=tuple(starts)) for _ in rows]
    present = present or [0] * len(rows)
    limits = limits or [len(r) - 1 for r in rows]
    result = plan_reuse(
        store, ledgers, rows, present, limits, namespace=NS, chunking=config, approximate=approximate
    )  # fmt: skip
    return result, ledgers


def spans_of(row_plan):
    return [(hit.span, hit.exact) for hit in row_plan.hits]


def test_empty_store_hits_nothing_and_everything_is_a_gap():
    result, ledgers = plan(DictStore(), [list(range(10))])
    row = result.rows[0]
    assert row.hits == [] and row.covered == 0 and row.gaps == [(0, 10)] and not result.sparse
    assert ledgers[0].spans == [(0, 4), (4, 8)]  # the ledger learned the chunks


def test_prefix_hits_stop_at_the_first_miss():
    store = DictStore()
    tokens = list(range(20))
    keys = store.store_prefix(tokens, ChunkingConfig(CHUNK))
    del store.entries[keys[2]]  # chunk [8, 12) evicted: later chunks cannot be exact
    result, _ = plan(store, [tokens])
    assert spans_of(result.rows[0]) == [((0, 4), True), ((4, 8), True)]
    assert result.rows[0].covered == 8 and result.rows[0].is_leading_run
    assert store.batches == [2]  # the leading run is read in one call; chunks after the miss are never read
    assert store.reads == {keys[0]: 1, keys[1]: 1, keys[2]: 1}  # the miss itself is still one counted read


def test_hits_never_start_at_or_after_the_limit():
    store = DictStore()
    tokens = list(range(16))
    store.store_prefix(tokens, ChunkingConfig(CHUNK))
    result, _ = plan(store, [tokens], limits=[8])
    assert [hit.span for hit in result.rows[0].hits] == [(0, 4), (4, 8)]
    result, _ = plan(store, [tokens])  # limit 15: the last chunk starts before it and is loaded
    assert result.rows[0].covered == 16
    assert result.stitch_columns([0], 0, 15) == 15  # but stitching stops at the limit: that token gives logits


def test_present_tokens_are_not_looked_up_again():
    store = DictStore()
    tokens = list(range(16))
    store.store_prefix(tokens, ChunkingConfig(CHUNK))
    result, _ = plan(store, [tokens], present=[8])
    assert [hit.span for hit in result.rows[0].hits] == [(8, 12), (12, 16)]


def test_unfinished_chunk_of_a_previous_turn_hits_after_the_last_full_chunk():
    store = DictStore()
    turn = list(range(10))  # chunks [0,4) [4,8), unfinished [8,10)
    keys = store.store_prefix(turn, ChunkingConfig(CHUNK))
    store.store_tail(keys[-1], turn[8:])
    result, _ = plan(store, [[*turn, 50, 51, 52]])
    assert spans_of(result.rows[0]) == [((0, 4), True), ((4, 8), True), ((8, 10), True)]
    assert result.rows[0].covered == 10


def test_unfinished_chunk_stands_in_for_a_missed_full_chunk():
    store = DictStore()
    turn = list(range(10))
    keys = store.store_prefix(turn, ChunkingConfig(CHUNK))
    store.store_tail(keys[-1], turn[8:])
    result, _ = plan(store, [[*turn, 50, 51, 52, 53, 54]])  # [8, 12) is now a full chunk, not stored
    assert [hit.span for hit in result.rows[0].hits] == [(0, 4), (4, 8), (8, 10)]


def test_a_tail_of_another_text_does_not_hit():
    store = DictStore()
    keys = store.store_prefix(list(range(8)), ChunkingConfig(CHUNK))
    store.store_tail(keys[-1], [99, 98])
    result, _ = plan(store, [[*range(8), 97, 96, 95]])
    assert result.rows[0].covered == 8


def test_content_hits_after_a_miss_make_a_sparse_plan_with_gaps():
    store = DictStore()
    doc = [40, 41, 42, 43, 44, 45, 46, 47]
    for start in (0, 4):
        store.store_content(doc[start : start + 4])
    prompt = [1, 2, 3, 4, *doc, 9, 9]  # an unknown chunk first, then the document, then a question
    result, _ = plan(store, [prompt], approximate=True)
    row = result.rows[0]
    assert result.sparse and not row.is_leading_run
    assert spans_of(row) == [((4, 8), False), ((8, 12), False)]
    assert row.gaps == [(0, 4), (12, 14)] and row.approximate_spans == [(4, 8), (8, 12)]


def test_exact_hit_preferred_to_content_hit_and_prefix_lookups_go_on_after_a_miss():
    store = DictStore()
    tokens = list(range(16))
    keys = store.store_prefix(tokens, ChunkingConfig(CHUNK))
    del store.entries[keys[1]]
    store.store_content(tokens[4:8])
    result, _ = plan(store, [tokens], approximate=True)
    assert spans_of(result.rows[0]) == [((0, 4), True), ((4, 8), False), ((8, 12), True), ((12, 16), True)]


def test_segments_start_chunks_so_documents_hit_in_any_order():
    store = DictStore()
    a, b = [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24]
    for doc in (a, b):  # stored alone as segments: full chunk + its partial last chunk by content key
        for start, end in chunk_spans(doc, ChunkingConfig(CHUNK), segment_starts=[0, len(doc)]):
            store.store_content(doc[start:end])
    prompt, starts = [*b, *a, 7], [0, len(b), len(b) + len(a)]
    result, ledgers = plan(store, [prompt], approximate=True, starts=starts)
    assert ledgers[0].spans == [(0, 4), (4, 5), (5, 9), (9, 11)]
    assert [hit.span for hit in result.rows[0].hits] == [(0, 4), (4, 5), (5, 9), (9, 11)]
    assert not any(hit.exact for hit in result.rows[0].hits)


def test_batch_rows_with_padding_share_store_reads_and_stitch_to_the_shortest_cover():
    store = DictStore()
    shared = list(range(12))
    store.store_prefix(shared, ChunkingConfig(CHUNK))
    rows = [[*shared, 1], [*shared[:8], 5, 6, 7, 8, 9, 9, 9]]  # row 1 shares only two chunks
    width = max(map(len, rows))
    pads = [width - len(r) for r in rows]
    result, _ = plan(store, rows, limits=[width - 1 - p for p in pads])
    assert [r.covered for r in result.rows] == [12, 8]
    assert all(count == 1 for count in store.reads.values())  # the shared chunks were read once
    assert result.stitch_columns(pads, 0, width - 1) == min(pads[0] + 12, pads[1] + 8)


def test_approximate_plans_take_one_row():
    with pytest.raises(ValueError, match="one row"):
        plan(DictStore(), [[1, 2], [3, 4]], approximate=True)


rows_strategy = st.lists(st.integers(0, 6), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(rows_strategy, rows_strategy, st.integers(1, 8), st.booleans())
def test_hits_are_sorted_disjoint_inside_the_budget_and_exact_hits_match_stored_text(
    stored, prompt, chunk_size, approximate
):
    config = ChunkingConfig(chunk_size)
    store = DictStore()
    keys = store.store_prefix(stored, config)
    for start, end in chunk_spans(stored, config):
        store.store_content(stored[start:end])
    if keys and len(stored) > chunk_spans(stored, config)[-1][1]:
        store.store_tail(keys[-1], stored[chunk_spans(stored, config)[-1][1] :])
    limit = max(len(prompt) - 1, 0)
    result, _ = plan(store, [prompt], limits=[limit], config=config, approximate=approximate)
    row = result.rows[0]
    for a, b in itertools.pairwise(row.hits):
        assert a.span[1] <= b.span[0]
    for hit in row.hits:
        assert hit.span[0] < limit and hit.entry.num_tokens == hit.span[1] - hit.span[0]
    exact_run = 0
    for hit in row.hits:
        if not hit.exact or hit.span[0] != exact_run:
            break
        exact_run = hit.span[1]
    assert prompt[:exact_run] == stored[:exact_run]  # an exact leading run is the stored text, verbatim
    if not approximate:
        assert row.is_leading_run and not result.sparse
    covered = sum(min(h.span[1], limit) - h.span[0] for h in row.hits) + sum(e - s for s, e in row.gaps)
    assert covered == len(prompt)  # hits (clipped to the budget) and gaps partition the prompt


# ---------------------------------------------------------------------------------------------------- batching
def test_nonprefix_hits_are_chunks_stored_after_the_first_miss():
    config = ChunkingConfig(CHUNK)
    store = DictStore()
    tokens = list(range(1, 21))  # 5 chunks
    assert not has_nonprefix_hits(store, tokens, namespace=NS, chunking=config)  # nothing stored
    store.store_prefix(tokens[:8], config)
    assert not has_nonprefix_hits(store, tokens, namespace=NS, chunking=config)  # a leading run only: batchable
    assert not has_nonprefix_hits(store, tokens[:8], namespace=NS, chunking=config)  # every chunk stored
    store.put(content_key(NS, tokens[12:16]), CHUNK)  # a document chunk stored by content, later in the prompt
    assert has_nonprefix_hits(store, tokens, namespace=NS, chunking=config)
    other = DictStore()
    keys = chain_prefix_keys(NS, tokens, chunk_spans(tokens, config))
    other.put(keys[3], CHUNK)  # a prefix hit after a miss (the planner stitches it and recomputes the gap)
    assert has_nonprefix_hits(other, tokens, namespace=NS, chunking=config)
    assert not has_nonprefix_hits(other, tokens, namespace="another tenant", chunking=config)


def test_batch_policy_prefills_segments_and_repairs_alone():
    space = KeySpace("digest", "torch.float32", ChunkingConfig(CHUNK))
    store = DictStore()
    document = [90, 91, 92, 93]
    store.put(content_key(space.namespace(None), document), CHUNK)
    prompts = [[1, 2, 3, 4, *document], list(range(30, 41)), [5, 6], list(range(50, 53)), [7, 8, 9, 10, 11]]
    segments = (0, 2)  # prompts[3] as a segment prompt
    policy = BatchPolicy(store, space, "chunk_kv_reuse")
    # every prompt may share a batch; the scheduler prefills some alone and joins them
    assert policy.prefill_alone(prompts[0], None) and not policy.prefill_alone(prompts[1], None)  # a content hit
    assert policy.prefill_alone(prompts[3], None, segments) and not policy.prefill_alone(prompts[3], None)
    assert not policy.prefill_alone(prompts[0], "tenant-b")  # another tenant's namespace holds nothing
    assert policy.key(None) == policy.key(None) != policy.key("tenant-b")
    prefix = BatchPolicy(store, space, "prefix_cache")  # no repairs; segments still shape keys
    assert not prefix.prefill_alone(prompts[0], None) and prefix.prefill_alone(prompts[3], None, segments)
    assert not BatchPolicy(store, space, "baseline").prefill_alone(prompts[3], None, segments)
