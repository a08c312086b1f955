"""Stage 9: storing what a forward computed, so later prompts hit it.

A row's chunk goes under its prefix key only when its K/V are exact (every earlier token was its real past:
``end <= ledger.exact_tokens``); segment and content-chunked text also goes under its content key, keys rotated
back to position 0, unless it holds stale approximate K/V. The unfinished last chunk of a finished generation is
stored under its prefix key and its length noted in the store, so the next turn recomputes only its new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.keys import content_key, prefix_key
from kvboost_hf.reuse.plan import ChunkLedger
from kvboost_hf.reuse.rope import KeyRotator
from kvboost_hf.store.chunk_store import ChunkStore

RowSlice = Callable[[int, int], ChunkKV]
"""``(start, end) -> `` a copy of the row's K/V for its tokens ``[start, end)`` in every layer."""


def write_chunks(
    store: ChunkStore,
    ledger: ChunkLedger,
    tokens: Sequence[int],
    row_slice: RowSlice,
    namespace: str,
    content_rotator: KeyRotator | None,
) -> None:
    """Store the row's complete chunks not stored yet; ``content_rotator`` also stores them by content key."""
    for index in range(ledger.stored, len(ledger.spans)):
        start, end = ledger.spans[index]
        exact = end <= ledger.exact_tokens
        rotator = None if ledger.stale.intersection(range(start, end)) else content_rotator
        if not exact and rotator is None:
            continue
        entry = row_slice(start, end)
        if exact and not store.contains(ledger.keys[index]):
            store.put(ledger.keys[index], entry)
        if rotator is not None:
            key = content_key(namespace, tokens[start:end])
            if not store.contains(key):
                store.put(key, ChunkKV(rotator.rotate(entry.keys, -start), entry.values))
    ledger.stored = len(ledger.spans)


def write_tail(
    store: ChunkStore, ledger: ChunkLedger, tokens: Sequence[int], row_slice: RowSlice, namespace: str
) -> None:
    """Store the row's unfinished last chunk when its K/V are exact, and note its length in the store."""
    start = ledger.end
    if not start < len(tokens) <= ledger.exact_tokens:
        return
    key = prefix_key(namespace, ledger.last_key, tokens[start:])
    if not store.contains(key):
        store.put(key, row_slice(start, len(tokens)))
    store.note_tail(ledger.last_key, len(tokens) - start)
