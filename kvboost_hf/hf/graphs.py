"""Stage 8 helper: decode steps run as compiled graphs (CUDA graphs on a GPU), one per (rows, capacity) shape.

A decode forward over a static-mode :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (``max_cache_len``) has the same
shapes at every context length, so one captured graph serves it from the first step to the cache's capacity; only
the number of rows and the capacity change its shapes. :class:`GraphedDecoder` compiles the model's ``forward``
once (``torch.compile(fullgraph=True, dynamic=False)``; on CUDA inductor with ``mode="reduce-overhead"``, i.e. CUDA
graphs) and runs a step through it when the cache is static and its rows are one of :attr:`GraphConfig.row_buckets`;
any other step (graphs off, a growing cache, a batch above the buckets, more shapes than
:attr:`GraphConfig.max_graphs`, a shape whose compile failed) runs eagerly, with the same results.

Rows are padded by the caller, who owns the cache: build the cache for :meth:`GraphedDecoder.rows_for` rows (extra
rows repeating a real one: :func:`pad_rows`), feed them, read the real rows' logits. Dynamo keeps one graph per
(rows, capacity); each costs a capture (a compile the first time) and, on CUDA, memory in the graphs' pool, which
:attr:`GraphedDecoder.capture_bytes` counts. :func:`capacity_bucket` picks capacities from a short ladder so few
shapes serve every length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.hf.models import CACHE_ARGUMENT

__all__ = ["GraphConfig", "GraphedDecoder", "capacity_bucket", "pad_rows", "row_bucket"]

logger = logging.getLogger(__name__)

DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_CAPACITY = 256  # tokens: the smallest capacity bucket


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
    (traced, no code generation) elsewhere. Measured on an H200 (7B shape, bf16, batch 1): inductor 126 tok/s after
    a 33 s first compile; ``"cudagraphs"`` captures in ~10 s but copies the weights into its graph inputs (15 GB more
    memory for a 7B model) and ran 56 tok/s, barely above eager's 50: keep the default."""
    max_graphs: int = 8
    """Distinct (rows, capacity) shapes graphed at most (each costs a compile, ~30 s for a 7B model, and holds a
    capture's memory; dynamo recompiles a function 8 times by default); later shapes run eagerly."""
    max_capacity: int = 32768
    """Tokens: a step needing a larger cache runs eagerly."""

    def __post_init__(self) -> None:
        buckets = self.row_buckets
        if not buckets or any(rows < 1 for rows in buckets) or list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"row_buckets must be ascending distinct positive batch sizes, got {buckets}")
        if self.max_graphs < 0 or self.max_capacity < MIN_CAPACITY:
            raise ConfigError(
                f"max_graphs must be >= 0 and max_capacity >= {MIN_CAPACITY} tokens, got {self.max_graphs} and "
                f"{self.max_capacity}"
            )


def capacity_bucket(tokens: int, config: GraphConfig) -> int | None:
    """The static capacity (tokens) a graphed cache gets for ``tokens`` tokens: the next power of two from
    :data:`MIN_CAPACITY`, or None above ``config.max_capacity``."""
    capacity = max(MIN_CAPACITY, 1 << max(tokens - 1, 0).bit_length())
    return capacity if capacity <= config.max_capacity else None


def graphed_columns(width: int, config: GraphConfig) -> int:
    """Columns a cache may hold for a batch ``width`` wide when graphed decoding may make it static: the capacity
    bucket of ``width`` (:func:`capacity_bucket`), or ``width`` above the largest (that step runs eagerly)."""
    return capacity_bucket(width, config) or width


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
    shapes run graphed (one graph each) with their step counts; ``failed_shapes`` those whose compile or capture
    raised (logged once; they run eagerly from then on); ``capture_bytes`` is the growth of the CUDA allocator's
    reserved memory over the first steps of each shape (compilation and capture; 0 on a CPU), each step's growth
    counted from 0 up (memory the allocator hands back during a step, e.g. compilation's temporaries, is not
    subtracted).
    """

    def __init__(self, model: PreTrainedModel, config: GraphConfig | None = None) -> None:
        self.model = model
        self.config = config or GraphConfig()
        self._compiled: Callable[..., Any] | None = None
        self.graphed_steps = 0
        self.eager_steps = 0
        self.graph_shapes: dict[tuple[int, int], int] = {}  # shape -> steps run with it
        self.failed_shapes: set[tuple[int, int]] = set()
        self.capture_bytes = 0

    def rows_for(self, rows: int) -> int:
        """Rows to build a cache with for a batch of ``rows``: its bucket, or ``rows`` when it runs eagerly."""
        bucket = row_bucket(rows, self.config.row_buckets)
        return bucket if self.config.enabled and bucket is not None else rows

    def graphed(self, cache: Any, rows: int) -> bool:
        """Whether a step of ``rows`` rows over ``cache`` runs graphed."""
        if not (self.config.enabled and getattr(cache, "is_compileable", False) and rows in self.config.row_buckets):
            return False
        shape = (rows, cache.max_cache_len)
        if shape in self.failed_shapes:
            return False
        return shape in self.graph_shapes or len(self.graph_shapes) < self.config.max_graphs

    def step(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode forward of ``input_ids`` (rows x 1) at ``position_ids`` through ``cache``; returns the
        logits ``[rows, vocab]`` (a copy: a graph overwrites its output at the next step). ``attention_mask``: the
        2D mask of the held columns and the new one (``[rows, held + 1]``, 0 for padding), default each row's left
        padding (``cache.pads``); a graphed step widens it to the capacity with zeros (the causal mask hides the
        unwritten columns too). The caller records the step in the cache (``cache.record(input_ids)``), as after
        :func:`~kvboost_hf.hf.prefill.forward`'s model call."""
        rows = input_ids.shape[0]
        if self.graphed(cache, rows):
            shape = (rows, cache.max_cache_len)
            try:
                logits = self._run(self._graph(), cache, input_ids, position_ids, attention_mask, shape)
            except Exception:
                if shape in self.graph_shapes:  # it ran before: not a compile or capture failure
                    raise
                logger.warning("graphed decode of %d rows x %d tokens failed; it runs eagerly", *shape, exc_info=True)
                self.failed_shapes.add(shape)
                if (sync := getattr(cache, "sync_device_lengths", None)) is not None:
                    sync()  # a failed compile may have run part of the step
            else:
                self.graphed_steps += 1
                self.graph_shapes[shape] = self.graph_shapes.get(shape, 0) + 1
                return logits
        self.eager_steps += 1
        return self._run(self.model.forward, cache, input_ids, position_ids, attention_mask, None)

    def _run(
        self,
        forward: Callable[..., Any],
        cache: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        shape: tuple[int, int] | None,
    ) -> torch.Tensor:
        device = input_ids.device
        width = shape[1] if shape is not None else cache.get_seq_length() + input_ids.shape[1]
        if attention_mask is None:
            pads = torch.tensor(getattr(cache, "pads", None) or [0] * input_ids.shape[0], device=device)
            attention_mask = (torch.arange(width, device=device) >= pads[:, None]).long()  # left padding masked
        elif attention_mask.shape[1] < width:
            attention_mask = torch.nn.functional.pad(attention_mask, (0, width - attention_mask.shape[1]))
        watch = shape is not None and self.graph_shapes.get(shape, 0) < 3 and device.type == "cuda"
        before = torch.cuda.memory_reserved(device) if watch else 0
        with torch.inference_mode():
            out = forward(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=1,
                **{CACHE_ARGUMENT: cache},
            )
            logits = out.logits[:, -1].clone()
        if watch:
            self.capture_bytes += max(0, torch.cuda.memory_reserved(device) - before)
        return logits

    def stats(self) -> dict[str, Any]:
        """Counters for ``cache_stats()``: steps each way, shapes graphed and failed, capture bytes."""
        return {
            "graphed_steps": self.graphed_steps,
            "eager_steps": self.eager_steps,
            "graph_shapes": len(self.graph_shapes),
            "failed_shapes": len(self.failed_shapes),
            "capture_bytes": self.capture_bytes,
        }

    def _graph(self) -> Callable[..., Any]:
        if self._compiled is None:
            cuda = next(self.model.parameters()).device.type == "cuda"
            backend = self.config.backend or ("inductor" if cuda else "eager")
            mode = "reduce-overhead" if backend == "inductor" and cuda else None
            self._compiled = torch.compile(
                self.model.forward, backend=backend, mode=mode, fullgraph=True, dynamic=False
            )
        return self._compiled
