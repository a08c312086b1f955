"""Stage 8 helper: decode steps run as compiled graphs (CUDA graphs on a GPU), one per (rows, capacity) shape.

A decode forward over a static-mode :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (``max_cache_len``) has the same
shapes at every context length, so one captured graph serves it from the first step to the cache's capacity; only
the number of rows and the capacity change its shapes. :class:`GraphedDecoder` compiles the model's ``forward``
once (``torch.compile(fullgraph=True, dynamic=False)``; on CUDA inductor with ``mode="reduce-overhead"``, i.e. CUDA
graphs) and runs a step through it when the cache is static and its rows are one of :attr:`GraphConfig.row_buckets`;
any other step (graphs off, a growing cache, a batch above the buckets, more shapes than
:attr:`GraphConfig.max_graphs` or graph memory above :attr:`GraphConfig.max_capture_bytes`, a shape whose compile
failed) runs eagerly, with the same results.

Rows are padded by the caller, who owns the cache: give the cache :meth:`GraphedDecoder.rows_for` rows (extra rows
repeating a real one: :func:`pad_rows`, or :meth:`~kvboost_hf.hf.cache.ChunkReuseCache.pad_batch` as the decode loop
does), feed them, read the real rows' logits. A padding row attends to its own columns only (rows never see each
other), so it changes no real row's result beyond the last bits a matrix product's row count can change.

Dynamo keeps one graph per (rows, capacity); each costs a compile the first time it runs (~30 s for a 7B model on a
GPU) and, on CUDA, memory in the graphs' pool, which :attr:`GraphedDecoder.capture_bytes` counts.
:meth:`GraphedDecoder.warm_up` pays the compiles ahead of requests, with a dummy cache that no request sees.
:func:`capacity_bucket` picks capacities from a short ladder so few shapes serve every length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.hf.models import CACHE_ARGUMENT

__all__ = [
    "GraphConfig",
    "GraphWarmUp",
    "GraphedDecoder",
    "capacity_bucket",
    "graph_shape",
    "pad_rows",
    "parse_graph_shapes",
    "row_bucket",
]

logger = logging.getLogger(__name__)

DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
DEFAULT_DRAFT_BUCKETS = (2, 4, 8, 16, 32, 64)
MIN_CAPACITY = 256  # tokens: the smallest capacity bucket
WARM_UP_STEPS = 3
"""Graphed steps a warm-up runs per shape: on CUDA the first compiles (and runs under cudagraph trees' warm-up), the
second records the CUDA graph, the third replays it."""


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
    max_capture_bytes: int | None = None
    """Bytes: once the graphs' memory (:attr:`GraphedDecoder.capture_bytes`) reaches this, no new shape is graphed
    (lazily or at warm-up; shapes already graphed keep running graphed). None: no cap."""
    draft_buckets: tuple[int, ...] = DEFAULT_DRAFT_BUCKETS
    """Draft tokens per row (tree nodes below the root), ascending: a speculative verify forward is graphed with its
    nodes padded up to the next one (:mod:`kvboost_hf.hf.verify_graphs`); more run eagerly; () graphs no verify."""

    def __post_init__(self) -> None:
        buckets = self.row_buckets
        if not buckets or any(rows < 1 for rows in buckets) or list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"row_buckets must be ascending distinct positive batch sizes, got {buckets}")
        if self.max_graphs < 0 or self.max_capacity < MIN_CAPACITY:
            raise ConfigError(
                f"max_graphs must be >= 0 and max_capacity >= {MIN_CAPACITY} tokens, got {self.max_graphs} and "
                f"{self.max_capacity}"
            )
        if self.max_capture_bytes is not None and self.max_capture_bytes < 0:
            raise ConfigError(f"max_capture_bytes must be >= 0 or None, got {self.max_capture_bytes}")
        drafts = self.draft_buckets
        if any(nodes < 1 for nodes in drafts) or list(drafts) != sorted(set(drafts)):
            raise ConfigError(f"draft_buckets must be ascending distinct positive draft token counts, got {drafts}")


def capacity_bucket(tokens: int, config: GraphConfig) -> int | None:
    """The static capacity (tokens) a graphed cache gets for ``tokens`` tokens: the next power of two from
    :data:`MIN_CAPACITY`, or None above ``config.max_capacity``."""
    capacity = max(MIN_CAPACITY, 1 << max(tokens - 1, 0).bit_length())
    return capacity if capacity <= config.max_capacity else None


def parse_graph_shapes(text: str, config: GraphConfig) -> tuple[tuple[int, int], ...]:
    """The graph shapes ``(rows, capacity)`` a text such as ``"1x2048,3x4000"`` names (batch rows x tokens, comma
    separated; empty: none), each rounded up to its buckets (:func:`graph_shape`: ``3x4000`` -> ``(4, 4096)``), in
    order, once each. Raises :class:`~kvboost_hf.core.errors.ConfigError` for a malformed entry or one above the
    buckets."""
    shapes: dict[tuple[int, int], None] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        rows, _, tokens = (part.strip() for part in entry.lower().partition("x"))
        if not (rows.isdigit() and tokens.isdigit()):
            raise ConfigError(f"a graph shape is ROWSxTOKENS with positive integers (e.g. 4x2048), got {entry!r}")
        shapes[graph_shape(int(rows), int(tokens), config)] = None
    return tuple(shapes)


def graph_shape(rows: int, tokens: int, config: GraphConfig) -> tuple[int, int]:
    """The graph ``(rows bucket, capacity bucket)`` that a step of ``rows`` rows needing ``tokens`` tokens of cache
    runs with. Raises :class:`~kvboost_hf.core.errors.ConfigError` when it runs eagerly (above the largest row
    bucket or ``config.max_capacity``) or for a count below 1."""
    if rows < 1 or tokens < 1:
        raise ConfigError(f"a graph shape has at least one row and one token, got {rows} x {tokens}")
    bucket, capacity = row_bucket(rows, config.row_buckets), capacity_bucket(tokens, config)
    if bucket is None or capacity is None:
        raise ConfigError(
            f"{rows} rows x {tokens} tokens is above the largest row bucket {config.row_buckets[-1]} or max_capacity "
            f"{config.max_capacity}: such steps run eagerly"
        )
    return bucket, capacity


def graphed_columns(width: int, config: GraphConfig) -> int:
    """Columns a cache may hold for a batch ``width`` wide when graphed decoding may make it static: the capacity
    bucket of ``width`` (:func:`capacity_bucket`), or ``width`` above the largest (that step runs eagerly)."""
    return capacity_bucket(width, config) or width


def graphed_rows(rows: int, config: GraphConfig) -> int:
    """Rows a cache may hold for a batch of ``rows`` rows when graphed decoding may pad it: the row bucket of
    ``rows`` (:func:`row_bucket`, the padding rows copies of the last), or ``rows`` above the largest (eager)."""
    return row_bucket(rows, config.row_buckets) or rows


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


@dataclass(frozen=True)
class GraphWarmUp:
    """What one :meth:`GraphedDecoder.warm_up` did, by shape ``(rows, capacity)``: ``warmed`` compiled and captured
    now; ``skipped`` not (graphs off, graphed already, over ``max_graphs`` or ``max_capture_bytes``, or a dummy cache
    larger than the device's free memory; each logged); ``failed`` whose compile or capture raised (they run
    eagerly); ``seconds`` the warm-up's wall time."""

    warmed: tuple[tuple[int, int], ...]
    skipped: tuple[tuple[int, int], ...]
    failed: tuple[tuple[int, int], ...]
    seconds: float


class GraphedDecoder:
    """Decode steps of ``model``: through one compiled ``forward`` when they fit a graph, eagerly otherwise.

    ``graphed_steps``/``eager_steps`` count the steps each way (a warm-up's not included); ``graph_shapes`` lists the
    ``(rows, capacity)`` shapes run graphed (one graph each) with their runs (a warm-up's included);
    ``failed_shapes`` those whose compile or capture raised (logged once; they run eagerly from then on);
    ``capture_bytes`` is the growth of the CUDA allocator's reserved memory over the first runs of each shape
    (compilation and capture; 0 on a CPU), each run's growth counted from 0 up (memory the allocator hands back
    during a run, e.g. compilation's temporaries, is not subtracted); ``warmed_shapes`` the shapes
    :meth:`warm_up` compiled, ``warm_up_seconds`` the time its calls took; :attr:`state` what a readiness probe reads.
    """

    def __init__(self, model: PreTrainedModel, config: GraphConfig | None = None) -> None:
        self.model = model
        self.config = config or GraphConfig()
        self._compiled: Callable[..., Any] | None = None
        self.graphed_steps = 0
        self.eager_steps = 0
        self.graph_shapes: dict[tuple[int, int], int] = {}  # shape -> runs with it
        self.failed_shapes: set[tuple[int, int]] = set()
        self.capture_bytes = 0
        self.warmed_shapes: set[tuple[int, int]] = set()
        self.warm_up_seconds = 0.0
        self._warm_up = "lazy"  # "warming" while warm_up() runs, "ready" once one returned

    @property
    def state(self) -> str:
        """``"off"`` (graphs disabled), ``"warming"`` (a :meth:`warm_up` runs), ``"ready"`` (a warm-up returned,
        whatever it skipped), or ``"lazy"`` (no warm-up yet: each shape compiles at its first step)."""
        return self._warm_up if self.config.enabled else "off"

    def rows_for(self, rows: int) -> int:
        """Rows to build a cache with for a batch of ``rows``: its bucket, or ``rows`` when it runs eagerly."""
        bucket = row_bucket(rows, self.config.row_buckets)
        return bucket if self.config.enabled and bucket is not None else rows

    def graphed(self, cache: Any, rows: int) -> bool:
        """Whether a step of ``rows`` rows over ``cache`` runs graphed."""
        if not (self.config.enabled and getattr(cache, "is_compileable", False) and rows in self.config.row_buckets):
            return False
        return self._may_graph((rows, cache.max_cache_len))

    def _may_graph(self, shape: tuple[int, int]) -> bool:
        """Whether ``shape`` runs graphed: graphed already, or room for one more graph (``max_graphs``, the capture
        memory cap), and not failed."""
        if shape in self.failed_shapes:
            return False
        if shape in self.graph_shapes:
            return True
        cap = self.config.max_capture_bytes
        return len(self.graph_shapes) < self.config.max_graphs and (cap is None or self.capture_bytes < cap)

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
        if self.graphed(cache, input_ids.shape[0]):
            logits = self._graphed_run(cache, input_ids, position_ids, attention_mask)
            if logits is not None:
                self.graphed_steps += 1
                return logits
        self.eager_steps += 1
        return self._run(self.model.forward, cache, input_ids, position_ids, attention_mask, None)

    def _graphed_run(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """A step through the compiled forward; None when this shape's first run (its compile or capture) raised:
        the shape is then failed (logged) and the step is the caller's to run eagerly."""
        shape = (input_ids.shape[0], cache.max_cache_len)
        try:
            logits = self._run(self._graph(), cache, input_ids, position_ids, attention_mask, shape)
        except Exception:
            if shape in self.graph_shapes:  # it ran before: not a compile or capture failure
                raise
            logger.warning("graphed decode of %d rows x %d tokens failed; it runs eagerly", *shape, exc_info=True)
            self.failed_shapes.add(shape)
            if (sync := getattr(cache, "sync_device_lengths", None)) is not None:
                sync()  # a failed compile may have run part of the step
            return None
        self.graph_shapes[shape] = self.graph_shapes.get(shape, 0) + 1
        return logits

    def warm_up(
        self, new_cache: Callable[[], Any], shapes: Iterable[tuple[int, int]], *, progress: bool = True
    ) -> GraphWarmUp:
        """Compile and capture the graphs of ``shapes`` (``(rows, tokens)``, each rounded up to its row and capacity
        buckets) before any request needs them, so no request's step pays a compile (a later cache of a warmed
        shape replays its graph; on CUDA its buffers' new addresses cost a re-record, not a compile).

        Per shape: a dummy cache from ``new_cache()`` (a fresh, empty :class:`~kvboost_hf.hf.cache.ChunkReuseCache`
        with the settings requests' caches get, so the compiled graph's guards hold for them), one eager forward of
        one token per row straight through the model (no store lookup, nothing recorded, nothing written back), the
        cache made static at the capacity, then :data:`WARM_UP_STEPS` graphed steps; the cache is dropped after.
        The store, the caches of requests and the step counters are untouched. Shapes are skipped (logged) when
        graphs are off, when graphed already, beyond ``max_graphs`` or ``max_capture_bytes``, or when the dummy
        cache's static K/V would not fit the device's free memory; a failed compile leaves its shape eager, as a
        lazy one would. ``progress``: a tqdm bar over the shapes. Raises
        :class:`~kvboost_hf.core.errors.ConfigError` (before any work) for a shape above the buckets
        (:func:`graph_shape`)."""
        wanted = [graph_shape(rows, tokens, self.config) for rows, tokens in shapes]
        warmed: list[tuple[int, int]] = []
        skipped: list[tuple[int, int]] = []
        failed: list[tuple[int, int]] = []
        started = time.perf_counter()
        self._warm_up = "warming"
        try:
            for shape in tqdm(list(dict.fromkeys(wanted)), desc="decode graphs", unit="shape", disable=not progress):
                if not self.config.enabled or shape in self.graph_shapes or not self._may_graph(shape):
                    logger.info("decode graph warm-up skips %d rows x %d tokens: graphs off, graphed already, failed "
                                "before, or max_graphs/max_capture_bytes reached", *shape)  # fmt: skip
                    skipped.append(shape)
                    continue
                began = time.perf_counter()
                outcome = self._warm_shape(new_cache(), *shape)
                (skipped if outcome is None else warmed if outcome else failed).append(shape)
                logger.info("decode graph warm-up of %d rows x %d tokens: %s in %.1f s", *shape,
                            {None: "skipped", True: "captured", False: "failed"}[outcome],
                            time.perf_counter() - began)  # fmt: skip
        finally:
            self._warm_up = "ready"
            self.warm_up_seconds += time.perf_counter() - started
        self.warmed_shapes.update(warmed)
        return GraphWarmUp(tuple(warmed), tuple(skipped), tuple(failed), time.perf_counter() - started)

    def _warm_shape(self, cache: Any, rows: int, capacity: int) -> bool | None:
        """Warm one shape up on the empty dummy ``cache``: True once graphed, False when its compile failed, None
        when its static K/V would not fit the device's free memory (see :meth:`warm_up`)."""
        device = next(self.model.parameters()).device
        ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        with torch.inference_mode():  # the prompt forward: one column of K/V per row
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_ARGUMENT: cache})
        if device.type == "cuda":
            per_column = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)  # all rows, 1 column
            needed, free = per_column * capacity, torch.cuda.mem_get_info(device)[0]
            if needed > free:
                logger.warning("decode graph warm-up: a %d-row cache of %d tokens needs %d bytes, %d are free",
                               rows, capacity, needed, free)  # fmt: skip
                return None
        cache.set_max_cache_len(capacity)
        for step in range(WARM_UP_STEPS):
            position = torch.full((rows, 1), 1 + step, device=device)
            mask = torch.ones(rows, 2 + step, dtype=torch.long, device=device)
            if self._graphed_run(cache, ids, position, mask) is None:
                return False
            cache.get_seq_length()  # settles the layers' host lengths, as a request's record() does after a step
        return True

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
        """Counters for ``cache_stats()``: steps each way, shapes graphed and failed, capture bytes, shapes warmed
        up and the warm-ups' seconds."""
        return {
            "graphed_steps": self.graphed_steps,
            "eager_steps": self.eager_steps,
            "graph_shapes": len(self.graph_shapes),
            "failed_shapes": len(self.failed_shapes),
            "capture_bytes": self.capture_bytes,
            "warmed_shapes": len(self.warmed_shapes),
            "warm_up_seconds": self.warm_up_seconds,
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
