"""Stage 8 helper: decode steps run as compiled graphs (CUDA graphs on a GPU), one per batch-size bucket.

A decode forward over a static-mode :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (``max_cache_len``) has the same
shapes at every context length, so one captured graph serves it from the first step to the cache's capacity; only
the number of rows changes its shapes. :class:`GraphedDecoder` compiles the model's ``forward`` once
(``torch.compile(fullgraph=True, dynamic=False)``; on CUDA inductor with ``mode="reduce-overhead"``, i.e. CUDA
graphs) and runs a step through it when the cache is static and its rows are one of :attr:`GraphConfig.row_buckets`;
any other step (graphs off, a growing cache, a batch above the buckets) runs eagerly, with the same results.

Rows are padded by the caller, who owns the cache: build the cache for :meth:`GraphedDecoder.rows_for` rows (extra
rows repeating a real one: :func:`pad_rows`), feed them, read the real rows' logits. Dynamo keeps one graph per
(rows, capacity); each costs a capture (a compile the first time) and, on CUDA, memory in the graphs' pool, which
:attr:`GraphedDecoder.capture_bytes` counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.hf.models import CACHE_ARGUMENT

__all__ = ["GraphConfig", "GraphedDecoder", "pad_rows", "row_bucket"]

DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class GraphConfig:
    """Settings of graphed decoding."""

    enabled: bool = True
    """Run decode steps as compiled graphs where they fit; False runs every step eagerly."""
    row_buckets: tuple[int, ...] = DEFAULT_ROW_BUCKETS
    """Batch sizes (rows) a graph is kept for, ascending; a batch is padded up to the next one, a larger batch runs
    eagerly."""
    backend: str | None = None
    """``torch.compile`` backend; None: inductor with CUDA graphs (``mode="reduce-overhead"``) on CUDA, ``"eager"``
    (traced, no code generation) elsewhere."""

    def __post_init__(self) -> None:
        buckets = self.row_buckets
        if not buckets or any(rows < 1 for rows in buckets) or list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"row_buckets must be ascending distinct positive batch sizes, got {buckets}")


def row_bucket(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``rows`` rows, or None when ``rows`` is above every bucket."""
    if rows < 1:
        raise InputError(f"a decode step has at least one row, got {rows}")
    return next((bucket for bucket in buckets if bucket >= rows), None)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` (rows first) with its last row repeated up to ``rows`` rows: padded rows are valid inputs whose
    results are ignored (a fully masked row would make attention NaN there)."""
    missing = rows - tensor.shape[0]
    if missing < 0:
        raise InputError(f"cannot pad {tensor.shape[0]} rows down to {rows}")
    return torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])]) if missing else tensor


class GraphedDecoder:
    """Decode steps of ``model``: through one compiled ``forward`` when they fit a graph, eagerly otherwise.

    ``graphed_steps``/``eager_steps`` count the steps each way; ``graph_shapes`` lists the ``(rows, capacity)``
    shapes run graphed (one graph each); ``capture_bytes`` is the growth of the CUDA allocator's reserved memory
    over the first steps of each shape (compilation and capture; 0 on a CPU).
    """

    def __init__(self, model: PreTrainedModel, config: GraphConfig | None = None) -> None:
        self.model = model
        self.config = config or GraphConfig()
        self._compiled: Callable[..., Any] | None = None
        self.graphed_steps = 0
        self.eager_steps = 0
        self.graph_shapes: dict[tuple[int, int], int] = {}  # shape -> steps run with it
        self.capture_bytes = 0

    def rows_for(self, rows: int) -> int:
        """Rows to build a cache with for a batch of ``rows``: its bucket, or ``rows`` when it runs eagerly."""
        bucket = row_bucket(rows, self.config.row_buckets)
        return bucket if self.config.enabled and bucket is not None else rows

    def graphed(self, cache: Any, rows: int) -> bool:
        """Whether a step of ``rows`` rows over ``cache`` runs graphed."""
        return self.config.enabled and bool(getattr(cache, "is_compileable", False)) and rows in self.config.row_buckets

    def step(self, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One decode forward of ``input_ids`` (rows x 1) at ``position_ids`` through ``cache`` (each row's left
        padding masked, ``cache.pads``; the causal mask hides a static cache's unwritten columns); returns the
        logits ``[rows, vocab]`` (a copy: a graph overwrites its output at the next step). The caller records the
        step in the cache (``cache.record(input_ids)``), as after :func:`~kvboost_hf.hf.prefill.forward`'s model
        call."""
        rows = input_ids.shape[0]
        if self.graphed(cache, rows):
            forward, capacity = self._graph(), cache.max_cache_len
            shape = (rows, capacity)
            self.graphed_steps += 1
        else:
            forward, capacity, shape = self.model.forward, cache.get_seq_length() + input_ids.shape[1], None
            self.eager_steps += 1
        pads = torch.tensor(getattr(cache, "pads", None) or [0] * rows, device=input_ids.device)
        mask = (torch.arange(capacity, device=input_ids.device) >= pads[:, None]).long()  # left padding masked
        watch = shape is not None and self.graph_shapes.get(shape, 0) < 3 and input_ids.device.type == "cuda"
        before = torch.cuda.memory_reserved(input_ids.device) if watch else 0
        with torch.inference_mode():
            out = forward(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{CACHE_ARGUMENT: cache},
            )
            logits = out.logits[:, -1].clone()
        if watch:
            self.capture_bytes += torch.cuda.memory_reserved(input_ids.device) - before
        if shape is not None:
            self.graph_shapes[shape] = self.graph_shapes.get(shape, 0) + 1
        return logits

    def _graph(self) -> Callable[..., Any]:
        if self._compiled is None:
            cuda = next(self.model.parameters()).device.type == "cuda"
            backend = self.config.backend or ("inductor" if cuda else "eager")
            mode = "reduce-overhead" if backend == "inductor" and cuda else None
            self._compiled = torch.compile(
                self.model.forward, backend=backend, mode=mode, fullgraph=True, dynamic=False
            )
        return self._compiled
