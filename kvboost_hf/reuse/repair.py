"""Stage 5: repairing stitched K/V that were computed after other text (non-prefix hits).

A chunk found by content key was computed with a different past and at other positions. Its keys are moved to
their new positions exactly (:mod:`kvboost_hf.reuse.rope`), but its K/V still miss their real preceding context. The
strategies choose which of its tokens to recompute (every layer, in one forward with the gaps and the live
tail, each at its absolute position):

* ``none``: nothing (a baseline for benchmarks);
* ``selective``: at each seam, the first ``ceil(ratio * chunk length)`` tokens of the reused chunk (those that
  most lack their real context) plus ``overlap_k`` tokens before the seam;
* ``cacheblend``: a probe forward that stops after ``check_layer`` compares fresh and stored keys there; the
  ``ratio`` share of tokens with the largest deviation is recomputed (CacheBlend, EuroSys'25).

``sink_tokens`` keeps the first tokens of the prompt fresh under every strategy. With ``ratio = 1`` every reused
token is recomputed and the result equals a full prefill.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvboost_hf.core.chunking import Span
from kvboost_hf.core.config import RecomputeStrategy, RepairConfig
from kvboost_hf.reuse.plan import RowPlan


def seam_positions(approx_spans: Sequence[Span], config: RepairConfig) -> list[int]:
    """Selective repair: the head of every reused chunk and ``overlap_k`` tokens before it."""
    chosen: set[int] = set()
    for start, end in approx_spans:
        head = math.ceil(config.ratio * (end - start))
        chosen.update(range(max(0, start - config.overlap_k), min(end, start + head)))
    return sorted(chosen)


def most_deviating(positions: torch.Tensor, deviation: torch.Tensor, ratio: float) -> list[int]:
    """CacheBlend selection: the ``ceil(ratio * n)`` positions with the largest ``deviation`` (same order)."""
    return top_deviating(positions, deviation, math.ceil(ratio * positions.numel()))


def top_deviating(positions: torch.Tensor, deviation: torch.Tensor, count: int) -> list[int]:
    """The ``count`` positions (at most all) with the largest ``deviation``, sorted."""
    if count <= 0 or positions.numel() == 0:
        return []
    top = torch.topk(deviation.float(), min(count, positions.numel())).indices
    return sorted(positions[top].tolist())


def position_mask(query_positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask ``[1, 1, len(query_positions), length]``: 0 where key position <= query position."""
    keys = torch.arange(length, device=query_positions.device)
    allowed = keys[None, :] <= query_positions[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def heads_then_deviating(
    approx_spans: Sequence[Span], positions: torch.Tensor, deviation: torch.Tensor, ratio: float, head_tokens: int
) -> list[int]:
    """CacheBlend with attention-sink alignment (EPIC-style): the first ``head_tokens`` of every reused chunk (they
    were computed without their real preceding context; a chunk warmed alone has its attention sink there), then
    the most deviating of the other ``positions`` until ``ceil(ratio * len(positions))`` are chosen in all
    (never fewer than the heads). ``positions`` are the reused tokens, ``deviation`` their probe deviation."""
    heads = {p for start, end in approx_spans for p in range(start, min(end, start + head_tokens))}
    is_head = torch.tensor([p in heads for p in positions.tolist()], dtype=torch.bool)
    budget = max(0, math.ceil(ratio * positions.numel()) - int(is_head.sum()))
    chosen = top_deviating(positions[~is_head], deviation[~is_head], budget)
    return sorted(heads.intersection(positions.tolist()) | set(chosen))


KeyDeviation = Callable[[torch.Tensor], torch.Tensor]
"""CacheBlend probe: given positions ``[n]`` (long), the squared key deviation of each at the check layer ``[n]``."""


@dataclass(frozen=True)
class RepairSelection:
    """Which positions of a sparse row are computed, as ``[num_tokens]`` bool masks.

    ``compute`` = gaps, sink tokens, the live tail and the chosen repairs: one forward runs over exactly these.
    ``stale`` = approximate positions left as loaded; K/V stay exact up to the first of them (``exact_tokens``).
    """

    reused: torch.Tensor
    compute: torch.Tensor
    stale: list[int]
    hit_chunks: int

    @property
    def exact_tokens(self) -> int:
        return self.stale[0] if self.stale else int(self.compute.numel())

    @property
    def cached_tokens(self) -> int:
        return int((self.reused & ~self.compute).sum())

    @property
    def recomputed_tokens(self) -> int:
        return int((self.reused & self.compute).sum())


def select_repairs(row: RowPlan, config: RepairConfig, key_deviation: KeyDeviation) -> RepairSelection:
    """Choose what a sparse row recomputes under ``config`` (``key_deviation`` is only called for CacheBlend)."""
    reused = torch.zeros(row.num_tokens, dtype=torch.bool)
    approx = torch.zeros_like(reused)
    for hit in row.hits:
        start, end = hit.span[0], min(hit.span[1], row.limit)
        reused[start:end] = True
        approx[start:end] |= not hit.exact
    fresh = ~reused
    sinks = slice(0, config.sink_tokens)
    fresh[sinks] |= approx[sinks]
    compute = fresh.clone()
    compute[_chosen(row, config, approx, fresh, key_deviation)] = True
    stale = (approx & ~compute).nonzero().squeeze(1).tolist()
    return RepairSelection(reused, compute, stale, len(row.hits))


def _chosen(
    row: RowPlan, config: RepairConfig, approx: torch.Tensor, fresh: torch.Tensor, key_deviation: KeyDeviation
) -> list[int]:
    """Positions of loaded approximate tokens to recompute."""
    spans = row.approximate_spans
    if not spans or config.strategy is RecomputeStrategy.NONE:
        return []
    if config.ratio >= 1.0:
        return approx.nonzero().squeeze(1).tolist()
    if config.strategy is RecomputeStrategy.SELECTIVE:
        return seam_positions(spans, config)
    probe_positions = (approx | fresh).nonzero().squeeze(1)
    deviation = key_deviation(probe_positions)
    candidates = approx[probe_positions]
    if config.head_tokens:
        return heads_then_deviating(
            spans, probe_positions[candidates], deviation[candidates], config.ratio, config.head_tokens
        )
    return most_deviating(probe_positions[candidates], deviation[candidates], config.ratio)
