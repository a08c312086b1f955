"""Stage 1 of the data path: cut token ids into chunks.

A chunk is a half-open span ``[start, end)`` of token indices. Invariants:

* cut points are a pure function of the token ids and the :class:`ChunkingConfig`, so the same text always
  yields the same chunks;
* the chunks of a sequence are a prefix of the chunks of any extension of it (a cut only looks at tokens
  before it), which is what lets turn ``n + 1`` of a conversation hit the chunks of turn ``n``;
* only full chunks are returned; the tokens after the last full chunk are the live tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {self.chunk_size!r}")
        if not isinstance(self.boundary_window, int) or not 0 <= self.boundary_window < self.chunk_size:
            raise ValueError(
                f"chunk_boundary_window must be in [0, chunk_size={self.chunk_size}), got {self.boundary_window!r}"
            )
        if self.boundary_window and not self.boundary_token_ids:
            raise ValueError("chunk_boundary_window > 0 needs boundary_token_ids (sentence or line end tokens)")

    def fingerprint(self) -> dict[str, object]:
        """The settings that change where chunks fall, for the store namespace."""
        return {
            "chunk_size": self.chunk_size,
            "boundary_window": self.boundary_window,
            "boundary_token_ids": sorted(self.boundary_token_ids) if self.boundary_window else [],
        }


def chunk_spans(token_ids: Sequence[int], config: ChunkingConfig, start: int = 0) -> list[Span]:
    """Full chunks of ``token_ids[start:]`` as absolute spans; the remainder after the last span is the tail."""
    spans: list[Span] = []
    size, window, boundaries = config.chunk_size, config.boundary_window, config.boundary_token_ids
    n = len(token_ids)
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


def boundary_token_ids_from_tokenizer(tokenizer: object, markers: str = ".!?\n") -> frozenset[int]:
    """Ids of the vocabulary tokens whose text ends a sentence or a line (ends with one of ``markers``)."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    ids = sorted(vocab.values())
    texts = tokenizer.batch_decode([[i] for i in ids])  # type: ignore[attr-defined]
    return frozenset(i for i, text in zip(ids, texts, strict=True) if text.rstrip(" ").endswith(tuple(markers)))
