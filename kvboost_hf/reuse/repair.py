"""Stage 5: repairing stitched K/V that were computed after other text (non-prefix hits).

A chunk found by content key was computed with a different past and at other positions. Its keys are moved to
their new positions exactly (:mod:`kvboost_hf.reuse.rope`), but its K/V still miss their real preceding context. The
strategies choose which of its tokens to recompute (every layer, in one forward with the gaps and the live
tail, each at its absolute position):

* ``none``: nothing (a baseline for benchmarks);
* ``selective``: at each seam, the first ``head_tokens`` (or ``ceil(ratio * chunk length)``) tokens of the reused
  chunk (those that most lack their real context: chunk-start realignment) plus ``overlap_k`` tokens before it;
* ``cacheblend`` (CacheBlend, EuroSys'25): the repair forward's layers through ``check_layer`` recompute every
  reused token; then only the tokens whose fresh key (``deviation="value"``: value) deviated most from the stored
  one go on, at once down to the ``ratio`` share (one-shot, as the public CacheBlend and LMCache code) or over
  ``filter_layers`` layers (the paper's gradual filtering), each layer choosing among the previous layer's
  survivors (:mod:`kvboost_hf.hf.blend`). ``head_tokens`` > 0 also recomputes every chunk's first tokens at every
  layer, counted in the share.

``sink_tokens`` keeps the first tokens of the prompt fresh under every strategy. With ``ratio = 1`` every reused
token is recomputed and the result equals a full prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvboost_hf.core.chunking import Span
from kvboost_hf.core.config import RecomputeStrategy, RepairConfig
from kvboost_hf.reuse.plan import RowPlan


def seam_positions(approx_spans: Sequence[Span], config: RepairConfig) -> list[int]:
    """Selective repair: the head of every reused chunk (``head_tokens``, or ``ceil(ratio * chunk length)`` when
    that is 0) and ``overlap_k`` tokens before it."""
    chosen: set[int] = set()
    for start, end in approx_spans:
        head = config.head_tokens or math.ceil(config.ratio * (end - start))
        chosen.update(range(max(0, start - config.overlap_k), min(end, start + head)))
    return sorted(chosen)


def chunk_heads(approx_spans: Sequence[Span], head_tokens: int) -> list[int]:
    """The first ``head_tokens`` positions of every reused chunk (computed without their real preceding context,
    a chunk warmed alone has its attention sink there: EPIC-style realignment)."""
    return [p for start, end in approx_spans for p in range(start, min(end, start + head_tokens))]


def candidates_per_layer(config: RepairConfig, candidates: int, budget: int, num_layers: int) -> list[int]:
    """CacheBlend: how many of ``candidates`` loaded tokens layer ``l`` computes (index ``l``), non-increasing.

    Every layer through ``check_layer`` computes all of them; after it the count falls linearly to ``budget``
    over ``filter_layers`` layers (gradual filtering), or at once when ``filter_layers`` is 0 (one-shot), and
    stays there.
    """
    budget = min(budget, candidates)
    span = max(config.filter_layers, 1)
    kept = []
    for layer in range(num_layers):
        remaining = min(max(span - (layer - config.check_layer), 0), span)  # span at the check layer, then down
        kept.append(budget + math.ceil((candidates - budget) * remaining / span))
    return kept


def position_mask(query_positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask ``[1, 1, len(query_positions), length]``: 0 where key position <= query position."""
    keys = torch.arange(length, device=query_positions.device)
    allowed = keys[None, :] <= query_positions[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass(frozen=True)
class RepairSelection:
    """Which positions of a sparse row are computed, as ``[num_tokens]`` bool masks.

    ``compute`` = gaps, sink tokens, the live tail and the chosen repairs: computed by every layer of the one
    repair forward. ``candidates`` (CacheBlend only, disjoint from ``compute``) = loaded approximate tokens the
    forward's first layers compute and filter by deviation; :meth:`settled` turns the survivors of the last layer
    into ``compute``. ``stale`` = approximate positions not in ``compute``; K/V stay exact up to the first of them.
    """

    reused: torch.Tensor
    approx: torch.Tensor
    compute: torch.Tensor
    candidates: torch.Tensor
    hit_chunks: int
    budget: int = 0  # candidates the last layers compute

    @property
    def stale(self) -> list[int]:
        return (self.approx & ~self.compute).nonzero().squeeze(1).tolist()

    @property
    def exact_tokens(self) -> int:
        stale = self.stale
        return stale[0] if stale else int(self.compute.numel())

    @property
    def cached_tokens(self) -> int:
        return int((self.reused & ~self.compute).sum())

    @property
    def recomputed_tokens(self) -> int:
        return int((self.reused & self.compute).sum())

    def settled(self, computed: torch.Tensor) -> RepairSelection:
        """The selection once the last layer of the repair forward computed the positions ``computed``."""
        compute = self.compute.clone()
        compute[computed.cpu()] = True
        return RepairSelection(self.reused, self.approx, compute, torch.zeros_like(compute), self.hit_chunks)


def select_repairs(row: RowPlan, config: RepairConfig) -> RepairSelection:
    """Choose what a sparse row recomputes under ``config``; CacheBlend leaves its choice to the forward."""
    reused = torch.zeros(row.num_tokens, dtype=torch.bool)
    approx = torch.zeros_like(reused)
    for hit in row.hits:
        start, end = hit.span[0], min(hit.span[1], row.limit)
        reused[start:end] = True
        approx[start:end] |= not hit.exact
    compute = ~reused
    sinks = slice(0, config.sink_tokens)
    compute[sinks] |= approx[sinks]
    spans = row.approximate_spans
    candidates = torch.zeros_like(reused)
    budget = 0
    if spans and config.strategy is not RecomputeStrategy.NONE:
        if config.ratio >= 1.0:
            compute |= approx
        elif config.strategy is RecomputeStrategy.SELECTIVE:
            compute[seam_positions(spans, config)] = True
        else:
            compute[chunk_heads(spans, config.head_tokens)] = True
            candidates = approx & ~compute
            budget = max(0, math.ceil(config.ratio * int(approx.sum())) - int((approx & compute).sum()))
    return RepairSelection(reused, approx, compute, candidates, len(row.hits), budget)
