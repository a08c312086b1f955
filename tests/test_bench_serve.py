"""The serve benchmark's join measure, on fabricated chunk times (no server): fast."""

from __future__ import annotations

import math

from kvboost_hf.bench.serve import join_gaps


def test_join_gaps_split_steady_gaps_from_those_overlapping_the_join():
    """Two rows at 0.1 s per token, one stalled 2 s by a join sent at 1.05 s whose first token came at 3.0 s: the
    steady median is 100 ms, the worst gap overlapping the join 2,100 ms (the stall and the step around it)."""
    first = [0.1 * i for i in range(11)] + [3.1, 3.2, 3.3]  # 0.0 .. 1.0, then a 2.1 s gap, then steady again
    second = [0.05 + 0.1 * i for i in range(11)] + [3.15, 3.25]
    gaps = join_gaps([first, second], start=1.05, end=3.0)
    assert math.isclose(gaps["median_ms"], 100.0, abs_tol=1e-6)
    assert math.isclose(gaps["worst_ms"], 2100.0, abs_tol=1e-6)
    assert gaps["gaps_during_join"] == 2  # one per row: 1.0 -> 3.1 and 1.05 -> 3.15
    assert math.isclose(gaps["ratio"], 21.0, rel_tol=1e-9)


def test_join_gaps_without_gaps_on_a_side_are_nan():
    gaps = join_gaps([[0.0, 0.1]], start=5.0, end=6.0)
    assert gaps["median_ms"] > 0 and math.isnan(gaps["worst_ms"]) and math.isnan(gaps["ratio"])
