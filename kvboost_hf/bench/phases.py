"""Where a request's time to first token goes, by stage of the data path (the benchmarks' breakdowns).

:data:`PHASES` names the functions that implement each stage; :func:`phase_breakdown` times every call of them
during one request (:class:`~kvboost_hf.bench.profiling.PhaseTimer`: CUDA events on a GPU, read once at the end,
so the request itself never waits for them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvboost_hf.hf.prefill as prefill_module
import kvboost_hf.reuse.plan as plan_module
from kvboost_hf.bench.profiling import PhaseTimer
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.graphs import GraphedDecoder
from kvboost_hf.hf.prompts import PromptEncoder
from kvboost_hf.store.chunk_store import ChunkStore

PHASES = (
    ("tokenize", PromptEncoder, "encode_segments"),  # what the engine's requests call
    ("keys", plan_module, "chain_prefix_keys"),
    ("lookup", ChunkStore, "get_many"),
    ("plan", prefill_module, "plan_reuse"),
    ("copy_into_cache", prefill_module.ChunkPrefiller, "_stitch"),
    ("forward", None, "forward"),  # the model's own forward (bound at run time)
    ("forward", GraphedDecoder, "prefill"),  # or the graphed prompt forward, which calls the compiled one
    ("write_back", ChunkReuseCache, "save"),
)
"""``(phase, owner, function)``: every call of ``owner.function`` during a request counts in ``phase`` (owner
None: the engine's model)."""


def phase_breakdown(engine: InferenceEngine, request: Callable[[], tuple[float, Any]]) -> tuple[Any, dict[str, float]]:
    """Run ``request()`` (one request of ``engine``, returning its TTFT in ms and its result) with every
    :data:`PHASES` function timed; returns the result and ms per phase, plus ``ttft`` and ``other`` (the TTFT spent
    in no phase; write-back runs after the first token, so it is left out of that sum)."""
    with PhaseTimer(engine.device) as timer:
        for name, owner, attribute in PHASES:
            timer.wrap(owner if owner is not None else engine.model, attribute, name)
        ttft, result = request()
        phases = timer.totals()
    before_first = sum(ms for name, ms in phases.items() if name != "write_back")
    breakdown = {name: round(phases.get(name, 0.0), 2) for name, _, _ in PHASES}
    return result, {**breakdown, "ttft": round(ttft, 2), "other": round(max(ttft - before_first, 0.0), 2)}
