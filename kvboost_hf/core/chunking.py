"""Stage 1 of the data path: cut token ids into chunks.

A chunk is a half-open span ``[start, end)`` of token indices. Invariants:

* cut points are a pure function of the token ids and the :class:`ChunkingConfig`, so the same text always
  yields the same chunks;
* the chunks of a sequence are a prefix of the chunks of any extension of it (a cut only looks at tokens
  before it), which is what lets turn ``n + 1`` of a conversation hit the chunks of turn ``n``;
* only full chunks are returned; the tokens after the last full chunk are the live tail;
* with segments (a document, a system prompt, a question), every segment start is a cut and the last partial
  chunk of every segment but the last is a chunk of its own; the text the model sees does not change.

Two cut methods: ``"fixed"`` (every ``chunk_size`` tokens) and ``"content"``: a cut falls where a rolling hash
of the preceding tokens hits a pattern, within ``[min_chunk, max_chunk]`` tokens, so the same text yields the same
chunks wherever it appears in a prompt (after at most one chunk of resynchronisation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from kvboost_hf.core.errors import ArgumentTypeError, ConfigError, InputError
from kvboost_hf.core.values import is_integer

Span = tuple[int, int]


@dataclass(frozen=True)
class ChunkingConfig:
    """How token ids are cut.

    ``chunk_size`` is the nominal chunk length in tokens. With ``boundary_window = W > 0`` each cut may move up
    to ``W`` tokens earlier so that it falls just after a token of ``boundary_token_ids`` (sentence or line
    ends), which keeps chunks aligned with text that is reused on its own. Chunks then hold between
    ``chunk_size - W`` and ``chunk_size`` tokens.
    """

    chunk_size: int = 128
    boundary_window: int = 0
    boundary_token_ids: frozenset[int] = field(default_factory=frozenset)
    method: str = "fixed"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive number of tokens, got {self.chunk_size!r}")
        if self.method not in ("fixed", "content"):
            raise ConfigError(f"chunking must be 'fixed' or 'content', got {self.method!r}")
        if not is_integer(self.boundary_window) or not 0 <= self.boundary_window < self.chunk_size:
            raise ConfigError(
                f"chunk_boundary_window must be a whole number in [0, chunk_size={self.chunk_size}), got "
                f"{self.boundary_window!r}"
            )
        ids = self.boundary_token_ids
        tokens = [] if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable) else list(ids)
        if (tokens == [] and ids) or not all(map(is_integer, tokens)):
            raise ConfigError(f"boundary_token_ids must be a collection of token ids, got {ids!r}")
        object.__setattr__(self, "boundary_token_ids", frozenset(int(token) for token in tokens))
        if self.boundary_window and not self.boundary_token_ids:
            raise ConfigError("chunk_boundary_window > 0 needs boundary_token_ids (sentence or line end tokens)")

    def fingerprint(self) -> dict[str, object]:
        """The settings that change where chunks fall, for the store namespace."""
        return {
            "method": self.method,
            "chunk_size": self.chunk_size,
            "boundary_window": self.boundary_window,
            "boundary_token_ids": sorted(self.boundary_token_ids) if self.boundary_window else [],
        }

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: object,
        chunk_size: int | None = None,
        boundary_window: int | None = None,
        method: str | None = None,
    ) -> ChunkingConfig:
        """A config whose cuts may slide back up to ``boundary_window`` tokens to end after one of ``tokenizer``'s
        sentence- or line-ending tokens (none are looked up when the window is 0); an argument left None takes
        the field's default."""
        defaults = cls()
        window = defaults.boundary_window if boundary_window is None else boundary_window
        return cls(
            chunk_size=defaults.chunk_size if chunk_size is None else chunk_size,
            boundary_window=window,
            boundary_token_ids=boundary_token_ids_from_tokenizer(tokenizer) if window else frozenset(),
            method=defaults.method if method is None else method,
        )

    @classmethod
    def of(cls, chunking: ChunkingConfig | int | None) -> ChunkingConfig:
        """``chunking`` as a config: None gives the defaults, an int fixed chunks of that many tokens; anything
        else is a TypeError."""
        if chunking is None:
            return cls()
        if isinstance(chunking, int) and not isinstance(chunking, bool):
            return cls(chunking)
        if not isinstance(chunking, ChunkingConfig):
            raise ArgumentTypeError(f"chunking must be a ChunkingConfig or a chunk size in tokens, got {chunking!r}")
        return chunking

    @property
    def min_chunk(self) -> int:
        """Content-defined chunks hold at least this many tokens (a quarter of ``chunk_size``)."""
        return max(1, self.chunk_size // 4)

    @property
    def shortest_chunk(self) -> int:
        """Tokens a chunk holds at least, cuts at segment starts aside: ``chunk_size`` for fixed chunks (a cut
        moved back into the boundary window is only taken once ``chunk_size`` tokens follow the last cut),
        :attr:`min_chunk` for content-defined ones. Fewer new tokens than this past a row's last chunk complete
        none."""
        return self.chunk_size if self.method == "fixed" else self.min_chunk

    @property
    def max_chunk(self) -> int:
        """Content-defined chunks hold at most this many tokens (twice ``chunk_size``)."""
        return 2 * self.chunk_size


def check_segment_starts(segment_starts: object) -> tuple[int, ...]:
    """``segment_starts`` as sorted, distinct token offsets (whole numbers >= 0); a 1-D tensor or array counts as
    the list of its values. Raises :class:`InputError` naming the problem otherwise."""
    values = segment_starts.tolist() if hasattr(segment_starts, "tolist") else segment_starts
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InputError(f"segment_starts must be a list of token offsets, got {segment_starts!r}")
    offsets = list(values)
    for offset in offsets:
        if not (is_integer(offset) and offset >= 0):
            raise InputError(f"segment_starts must be token offsets (whole numbers >= 0), got {offset!r} in {offsets}")
    return tuple(sorted({int(offset) for offset in offsets}))


def chunk_spans(
    token_ids: Sequence[int],
    config: ChunkingConfig,
    start: int = 0,
    segment_starts: Sequence[int] = (),
) -> list[Span]:
    """Chunks of ``token_ids[start:]`` as absolute spans; the remainder after the last span is the live tail.

    ``segment_starts`` are token offsets where a new segment begins: a cut is forced there and the partial
    chunk before it is kept (an offset equal to ``len(token_ids)`` closes the last segment the same way).
    """
    cuts = sorted({s for s in segment_starts if start < s <= len(token_ids)})
    segment = max((s for s in segment_starts if s <= start), default=0)
    spans: list[Span] = []
    for boundary in cuts:
        spans += _spans_within(token_ids, config, start, boundary, segment)
        last = spans[-1][1] if spans and spans[-1][1] > start else start
        if last < boundary:
            spans.append((last, boundary))
        start = segment = boundary
    return spans + _spans_within(token_ids, config, start, len(token_ids), segment)


def _spans_within(token_ids: Sequence[int], config: ChunkingConfig, start: int, stop: int, segment: int) -> list[Span]:
    """Full chunks of ``token_ids[start:stop]``, inside the segment that starts at ``segment <= start``."""
    if config.method == "content":
        return _content_spans(token_ids, config, start, stop, segment)
    spans: list[Span] = []
    size, window, boundaries = config.chunk_size, config.boundary_window, config.boundary_token_ids
    n = stop
    while start + size <= n:
        cut = start + size
        if window:
            for candidate in range(cut, cut - window - 1, -1):
                if token_ids[candidate - 1] in boundaries:
                    cut = candidate
                    break
        spans.append((start, cut))
        start = cut
    return spans


_HASH_WINDOW = 64  # tokens the hash bits a cut tests depend on, at most: a restart at ``start`` replays them


@cache
def _gear_table() -> np.ndarray:
    """Fixed pseudo-random 64-bit values per token bucket (the same on every machine)."""
    return np.random.default_rng(0x6B76626F).integers(0, 2**63, size=1 << 16, dtype=np.uint64)


def _content_spans(token_ids: Sequence[int], config: ChunkingConfig, start: int, stop: int, segment: int) -> list[Span]:
    """Gear-hash content-defined cuts (as in FastCDC) over token ids.

    Bit ``j`` of the hash at token ``i`` depends only on the ``j + 1`` tokens up to ``i``; candidates test bits
    16.., so they depend on the last ~20 tokens, not on where a text sits in the prompt. A cut is taken at the
    first candidate at least ``min_chunk`` tokens after the last cut, or forced at ``max_chunk``; candidates
    come about once per ``chunk_size - min_chunk`` tokens. The hash starts at the ``segment`` start (never from
    the tokens before it), so a segment's cuts depend on its own tokens only, wherever it is placed.
    """
    table = _gear_table()
    bits = max(1, int(np.log2(max(2, config.chunk_size - config.min_chunk))))
    mask = np.uint64((1 << bits) - 1) << np.uint64(16)  # bits 16.. depend on the last ~16 + bits tokens
    spans: list[Span] = []
    h = np.uint64(0)
    last = start
    warm_from = max(segment, start - _HASH_WINDOW)
    with np.errstate(over="ignore"):
        for i in range(warm_from, stop):
            h = (h << np.uint64(1)) + table[token_ids[i] & 0xFFFF]
            if i < start:
                continue
            length = i + 1 - last
            if (length >= config.min_chunk and not (h & mask)) or length >= config.max_chunk:
                spans.append((last, i + 1))
                last = i + 1
    return spans


def boundary_token_ids_from_tokenizer(tokenizer: object, markers: str = ".!?\n") -> frozenset[int]:
    """Ids of the vocabulary tokens whose text ends a sentence or a line (ends with one of ``markers``)."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    ids = sorted(vocab.values())
    texts = tokenizer.batch_decode([[i] for i in ids])  # type: ignore[attr-defined]
    return frozenset(i for i, text in zip(ids, texts, strict=True) if text.rstrip(" ").endswith(tuple(markers)))
