"""Stage 4: the reuse plan. What a prompt can take from the store, decided before any tensor of a cache moves.

:func:`plan_reuse` reads the store (``get`` and ``tail_lengths``) and nothing else: it touches no cache tensors
and runs no model. Its :class:`ReusePlan` says, per batch row, which spans hit exactly (prefix key), which hit
approximately (content key: keys stored at position 0, to be re-rotated), which are gaps to compute, and how far
the row's K/V stay exact. Stitching (:mod:`.stitch`), repair (:mod:`.repair`) and write-back (:mod:`.write_back`)
consume it.

Terms (all counts in tokens, all offsets relative to a row's first real token, padding excluded):

* ``present``: tokens whose K/V a cache already holds before this plan;
* ``limit``: hits must start before it (the last ``keep`` prompt tokens are always computed: they give logits);
* a row's :class:`ChunkLedger` carries its chunk spans and prefix keys across calls, so a conversation is chunked
  and hashed once, incrementally.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.chunking import ChunkingConfig, Span, chunk_spans
from kvboost_hf.core.errors import InputError
from kvboost_hf.core.keys import chain_prefix_keys, content_key, prefix_key


class ChunkSource(Protocol):
    """What the planner reads: a :class:`~kvboost_hf.store.ChunkStore`, or a dict-backed fake in tests.
    ``contains_many`` is not counted as a hit or a miss; ``get`` and ``get_many`` are. ``device``: where the
    entries are needed (a quantizing store dequantizes there, after copying the compressed bytes)."""

    def get(self, key: str, device: torch.device | None = None) -> ChunkKV | None: ...

    def get_many(self, keys: Sequence[str], device: torch.device | None = None) -> list[ChunkKV | None]: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]: ...

    def tail_lengths(self, parent_key: str | None) -> list[int]: ...


logger = logging.getLogger(__name__)


@dataclass
class ChunkLedger:
    """Chunk bookkeeping of one batch row.

    Invariants: ``spans`` are consecutive ``(start, end)`` token offsets from 0 and ``keys[i]`` is the prefix key
    of ``spans[i]``; the first ``stored`` chunks are in the store (or were found there); the row's K/V are exact
    (computed or loaded with all preceding tokens as their real past) for its first ``exact_tokens`` tokens;
    ``stale`` holds positions of loaded, unrepaired approximate K/V (never stored under any key); ``approximate``
    the positions loaded from approximate hits, repaired or not (the context columns of an APE-style attention
    adjustment), all below the row's length.
    ``segment_starts`` (sorted token offsets) are the row's own: each starts a chunk (so they shape its spans and
    prefix keys), and a row with some stores its chunks by content key too. They travel with the ledger when rows
    are joined, selected or repeated, so every row of a batch keeps its own.
    """

    spans: list[Span] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    stored: int = 0
    exact_tokens: int = 0
    stale: frozenset[int] = frozenset()
    approximate: frozenset[int] = frozenset()
    segment_starts: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """Token offset where the last complete chunk ends (0 without chunks)."""
        return self.spans[-1][1] if self.spans else 0

    @property
    def last_key(self) -> str | None:
        return self.keys[-1] if self.keys else None

    def by_content(self, chunking: ChunkingConfig) -> bool:
        """Whether the row's chunks are also stored by content key: it has segment starts or content-defined
        chunks (text that may reappear elsewhere with the same chunk boundaries)."""
        return bool(self.segment_starts) or chunking.method == "content"

    def extend(self, tokens: Sequence[int], namespace: str, chunking: ChunkingConfig) -> None:
        """Add the chunks that ``tokens`` (the row's real tokens so far, a continuation of what was seen) complete."""
        new_spans = chunk_spans(tokens, chunking, self.end, self.segment_starts)
        self.keys += chain_prefix_keys(namespace, tokens, new_spans, self.last_key)
        self.spans += new_spans

    def truncate(self, num_tokens: int) -> None:
        """Forget chunks that are no longer fully inside the first ``num_tokens`` tokens."""
        keep = sum(1 for _, end in self.spans if end <= num_tokens)
        del self.spans[keep:], self.keys[keep:]
        self.stored = min(self.stored, keep)
        self.exact_tokens = min(self.exact_tokens, num_tokens)
        self.approximate = frozenset(p for p in self.approximate if p < num_tokens)

    def copy(self) -> ChunkLedger:
        return ChunkLedger(
            list(self.spans),
            list(self.keys),
            self.stored,
            self.exact_tokens,
            self.stale,
            self.approximate,
            self.segment_starts,
        )


@dataclass(frozen=True)
class Hit:
    """A stored entry for ``span``: exact (prefix key, usable as is) or approximate (content key, keys rotated to
    position 0, computed without this prompt's preceding text)."""

    span: Span
    entry: ChunkKV
    exact: bool


@dataclass
class RowPlan:
    """What one row reuses. ``hits`` are sorted, disjoint and lie in ``[present, limit + chunk)``."""

    num_tokens: int
    present: int
    limit: int
    hits: list[Hit]

    @property
    def is_leading_run(self) -> bool:
        """True when the hits are exact and contiguous from ``present`` (plain prefix caching)."""
        expected = self.present
        for hit in self.hits:
            if not hit.exact or hit.span[0] != expected:
                return False
            expected = hit.span[1]
        return True

    @property
    def covered(self) -> int:
        """Tokens held after stitching the leading run (``present`` when nothing hits)."""
        return self.hits[-1].span[1] if self.hits else self.present

    @property
    def approximate_spans(self) -> list[Span]:
        """Spans of content-key hits, clipped to ``limit``."""
        return [(h.span[0], min(h.span[1], self.limit)) for h in self.hits if not h.exact]

    @property
    def gaps(self) -> list[Span]:
        """Spans in ``[present, num_tokens)`` no hit covers: computed in place."""
        gaps, cursor = [], self.present
        for hit in self.hits:
            if hit.span[0] > cursor:
                gaps.append((cursor, hit.span[0]))
            cursor = max(cursor, min(hit.span[1], self.limit))
        if cursor < self.num_tokens:
            gaps.append((cursor, self.num_tokens))
        return gaps


@dataclass
class ReusePlan:
    """Per-row plans of one forward. ``sparse`` when row 0 must be stitched at scattered positions and repaired
    (approximate hits or gaps between hits: batch size 1 only); else rows stitch their leading exact run."""

    rows: list[RowPlan]
    sparse: bool = False

    def stitch_columns(self, pads: Sequence[int], columns: int, limit: int) -> int:
        """The column (padding included) up to which every row is covered by its leading run, capped at ``limit``
        columns; ``columns`` (already cached) when stitching gains nothing."""
        target = min(*(pad + row.covered for pad, row in zip(pads, self.rows, strict=True)), limit)
        return target if target > columns and any(row.hits for row in self.rows) else columns


def plan_reuse(
    store: ChunkSource,
    ledgers: Sequence[ChunkLedger],
    rows: Sequence[Sequence[int]],
    present: Sequence[int],
    limits: Sequence[int],
    *,
    namespace: str,
    chunking: ChunkingConfig,
    approximate: bool = False,
    entry_shape: tuple[int, int, int] | None = None,
    device: torch.device | None = None,
) -> ReusePlan:
    """Plan the reuse of ``rows`` (each row's real tokens) given what each row already holds.

    Without ``approximate`` each row takes its run of exact prefix hits after ``present[i]`` (stopping at the first
    miss, where the longest stored unfinished chunk may still hit). With ``approximate`` (one row only), later
    chunks are also looked up by prefix key, then by content key, and misses become gaps. The ledgers are
    extended to the rows' tokens (each row chunked at its own ledger's segment starts). Store reads are memoised
    across rows, so a shared prefix is read once, and a row's prefix chunks are read in one ``get_many`` call
    (hits and misses are counted as chunk by chunk).
    ``entry_shape`` ``(layers, kv_heads, head_dim)``: an entry of another shape, or whose token count is not its
    span's, is a miss (logged): K/V of the wrong shape are never stitched, and a request never fails on them.
    ``device``: where the hits will be stitched (the store dequantizes quantized entries there).
    """
    if approximate and len(rows) != 1:
        raise InputError(f"approximate reuse plans one row at a time, got {len(rows)} rows")
    reader = _Reader(store, namespace, approximate, entry_shape, device)
    plans = []
    for ledger, tokens, row_present, limit in zip(ledgers, rows, present, limits, strict=True):
        ledger.extend(tokens, namespace, chunking)
        plans.append(_plan_row(reader, ledger, tokens, row_present, limit))
    sparse = approximate and bool(plans[0].hits) and not plans[0].is_leading_run
    return ReusePlan(plans, sparse)


class _Reader:
    """The planner's memoised store reads for one plan (a shared prefix is read once for all rows)."""

    def __init__(
        self,
        store: ChunkSource,
        namespace: str,
        approximate: bool,
        shape: tuple[int, int, int] | None,
        device: torch.device | None,
    ) -> None:
        self.store, self.namespace, self.approximate, self.shape = store, namespace, approximate, shape
        self.device = device
        self.loaded: dict[str, ChunkKV | None] = {}

    def read(self, key: str, num_tokens: int) -> ChunkKV | None:
        """The entry stored under ``key`` when it holds ``num_tokens`` tokens of the expected shape, else None."""
        if key not in self.loaded:
            self.loaded[key] = self.store.get(key, self.device)
        entry = self.loaded[key]
        if entry is None:
            return None
        layers, heads, dim = self.shape or (entry.keys.shape[0], entry.keys.shape[1], entry.keys.shape[3])
        expected = (layers, heads, num_tokens, dim)
        if tuple(entry.keys.shape) != expected or tuple(entry.values.shape) != expected:
            logger.warning(
                "stored chunk %s... has K/V of shape %s, expected %s: treated as a miss",
                key[:12],
                tuple(entry.keys.shape),
                expected,
            )
            self.loaded[key] = None
            return None
        return entry

    def prefetch(self, keys: list[str]) -> None:
        """Read in one call the stored ones among ``keys`` that the row will use (one Redis round trip each for
        the check and the read, instead of one per chunk): the leading run, or every one when approximate."""
        keys = [key for key in dict.fromkeys(keys) if key not in self.loaded]
        if not keys:
            return
        stored = self.store.contains_many(keys)
        wanted = [key for key, found in zip(keys, stored, strict=True) if found]
        if not self.approximate:
            wanted = keys[: stored.index(False)] if False in stored else keys
        self.loaded.update(zip(wanted, self.store.get_many(wanted, self.device), strict=True))

    def tail_hit(
        self, parent: str | None, tokens: Sequence[int], start: int, max_tokens: int, present: int
    ) -> Hit | None:
        """The longest stored unfinished chunk (<= ``max_tokens``) after chunk ``parent``, starting at ``start`` and
        reaching past the ``present`` tokens."""
        for length in self.store.tail_lengths(parent):
            if present - start < length <= max_tokens:
                entry = self.read(prefix_key(self.namespace, parent, tokens[start : start + length]), length)
                if entry is not None:
                    return Hit((start, start + length), entry, exact=True)
        return None


def _plan_row(reader: _Reader, ledger: ChunkLedger, tokens: Sequence[int], present: int, limit: int) -> RowPlan:
    """One row's hits after its ``present`` tokens and starting before ``limit`` (its ledger already extended)."""
    chunks = list(zip(ledger.spans, ledger.keys, strict=True))
    reader.prefetch([key for span, key in chunks if present < span[1] and span[0] < limit])
    hits: list[Hit] = []
    missed = False
    for index, (span, key) in enumerate(chunks):
        if span[1] <= present:
            continue
        if span[0] >= limit:
            break
        if (entry := reader.read(key, span[1] - span[0])) is not None:
            hits.append(Hit(span, entry, exact=True))
            continue
        parent = ledger.keys[index - 1] if index else None
        tail = None if missed else reader.tail_hit(parent, tokens, *_tail_window(span), present)
        missed = True
        if tail is not None:
            hits.append(tail)
        if not reader.approximate:
            break
        content = content_key(reader.namespace, tokens[slice(*span)])
        approximate = None if tail is not None else reader.read(content, span[1] - span[0])
        if approximate is not None:
            hits.append(Hit(span, approximate, exact=False))
    start = ledger.end
    if not missed and present <= start < limit:  # every full chunk hit: look for the stored live tail
        tail = reader.tail_hit(ledger.last_key, tokens, start, len(tokens) - start, present)
        hits += [tail] if tail is not None else []
    return RowPlan(len(tokens), present, limit, hits)


def _tail_window(span: Span) -> tuple[int, int]:
    """Where an unfinished chunk may stand in place of a missed chunk: its start, and up to one token short."""
    return span[0], span[1] - span[0] - 1


def stored_prefix_tokens(
    store: ChunkSource, prompts: Sequence[Sequence[int]], *, namespace: str, chunking: ChunkingConfig
) -> list[int]:
    """Per prompt, the tokens its leading run of stored prefix chunks covers (what a plan of it alone would load,
    less any stored unfinished last chunk): one ``contains_many`` for all of them."""
    spans = [chunk_spans(tokens, chunking) for tokens in prompts]
    chains = [chain_prefix_keys(namespace, tokens, row_spans) for tokens, row_spans in zip(prompts, spans, strict=True)]
    found = store.contains_many([key for chain in chains for key in chain])
    covered, start = [], 0
    for chain, row_spans in zip(chains, spans, strict=True):
        flags = found[start : start + len(chain)]
        start += len(chain)
        run = flags.index(False) if False in flags else len(flags)
        covered.append(row_spans[run - 1][1] if run else 0)
    return covered


def has_nonprefix_hits(
    store: ChunkSource,
    tokens: Sequence[int],
    *,
    namespace: str,
    chunking: ChunkingConfig,
    segment_starts: Sequence[int] = (),
) -> bool:
    """Whether an approximate plan of ``tokens`` (one row, nothing cached) could hit a chunk at or after its first
    missed prefix chunk: one stored there under its prefix or content key. Such hits are stitched at scattered
    positions and repaired, which the cache does for a batch of one row only. Reads ``contains_many`` only (two
    calls at most); a stored unfinished chunk alone (the live tail of a conversation) does not count."""
    spans = chunk_spans(tokens, chunking, 0, segment_starts)
    stored = store.contains_many(chain_prefix_keys(namespace, tokens, spans))
    if all(stored):
        return False
    first_miss = stored.index(False)
    if any(stored[first_miss + 1 :]):
        return True
    return any(store.contains_many([content_key(namespace, tokens[start:end]) for start, end in spans[first_miss:]]))
