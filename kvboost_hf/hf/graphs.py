"""Stage 8 helper: decode steps and short prefills run as compiled graphs (CUDA graphs on a GPU), one per shape.

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

Short prefills (:meth:`GraphedDecoder.prefill`): the prompt forward of a request's uncached tail over the K/V it
reused (a warm chat turn's new message: tens to hundreds of tokens) is graphed per ``(rows, capacity, queries)``,
the tail padded up to the next of :attr:`GraphConfig.query_buckets` with copies of its last token at the next
positions. Their K/V land in the columns after the real ones, which no real query attends (the causal mask), and
are dropped after the forward (the layers' lengths set back, so the next forward overwrites them): nothing padded
is recorded, written back or attended later. The logits are those of the last real token, picked inside the graph
by an index tensor (``logits_to_keep``), so the padding costs no host synchronisation.

A shape is ``(rows, capacity)`` for a decode step and ``(rows, capacity, queries)`` for a prefill (``queries`` >= 2,
a query bucket); a speculative verify forward's is a :class:`VerifyShape` (:mod:`kvboost_hf.hf.verify_graphs`).
Dynamo keeps one graph per shape; each costs a compile the first time it runs (~30 s for a 7B model
on a GPU) and, on CUDA, memory in the graphs' pool, which :attr:`GraphedDecoder.capture_bytes` counts.
:meth:`GraphedDecoder.warm_up` pays the compiles ahead of requests (verify shapes' too, given the verifier), with a
dummy cache that no request sees.
:func:`capacity_bucket` picks capacities from a short ladder so few shapes serve every length.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.core.values import is_integer
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.hf.static_buffers import StaticBufferPool
from kvboost_hf.hf.transfer import to_device
from kvboost_hf.reuse.rope import exact_reuse_length

__all__ = [
    "GraphConfig",
    "GraphWarmUp",
    "GraphedDecoder",
    "VerifyShape",
    "capacity_bucket",
    "draft_bucket",
    "graph_shape",
    "pad_rows",
    "parse_graph_shapes",
    "query_bucket",
    "row_bucket",
    "verify_graph_shape",
]

logger = logging.getLogger(__name__)

DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
DEFAULT_QUERY_BUCKETS = (16, 32, 64, 128, 256)
DEFAULT_DRAFT_BUCKETS = (2, 4, 8, 16, 32, 64)
Shape = tuple[int, ...]
"""A graph's shape: ``(rows, capacity)`` for a decode step, ``(rows, capacity, queries)`` for a prefill, a
:class:`VerifyShape` for a speculative verify forward."""


class VerifyShape(NamedTuple):
    """A verify graph's shape (:mod:`kvboost_hf.hf.verify_graphs`): a row bucket, a capacity (tokens) and a draft
    bucket (draft tokens per row, the root not counted). Its type tells it from a prefill's ``(rows, capacity,
    queries)`` in a list of shapes (it compares equal to a plain tuple of the same numbers: keep kinds apart by
    type where both may meet)."""

    rows: int
    capacity: int
    drafts: int


MIN_CAPACITY = 256  # tokens: the smallest capacity bucket
WARM_UP_STEPS = 3
"""Graphed steps a warm-up runs per shape: on CUDA the first compiles (and runs under cudagraph trees' warm-up), the
second records the CUDA graph, the third replays it."""

_reserved_graphs = 0  # graphs the process's decoders may keep together (dynamo's limit is at least this)
_reserve_lock = threading.Lock()


def reserve_recompiles(graphs: int) -> None:
    """Raise dynamo's ``recompile_limit`` (8 by default, process-wide) to hold ``graphs`` more.
    The limit counts compiles per code object, and every transformers model's ``forward`` runs one code object (its
    decorator's wrapper): the graphs of every decoder in the process, of every model (a target and its draft, two
    engines), count against one limit, so each decoder adds its ``max_graphs`` instead of asking for its own only."""
    global _reserved_graphs
    with _reserve_lock:
        _reserved_graphs += graphs
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _reserved_graphs)


@dataclass(frozen=True)
class GraphConfig:
    """Settings of graphed decoding and short prefills."""

    enabled: bool = True
    """Run decode steps and short prefills as compiled graphs where they fit; False runs every forward eagerly."""
    row_buckets: tuple[int, ...] = DEFAULT_ROW_BUCKETS
    """Batch sizes (rows) a graph is kept for, ascending; a batch is padded up to the next one, a larger batch runs
    eagerly."""
    query_buckets: tuple[int, ...] = DEFAULT_QUERY_BUCKETS
    """Query lengths (tokens, ascending, each >= 2) a prompt forward over reused K/V is graphed at: its uncached
    tail is padded up to the next one; a longer tail (above the last, the limit) runs eagerly; () graphs no
    prefill."""
    backend: str | None = None
    """``torch.compile`` backend; None: inductor with CUDA graphs (``mode="reduce-overhead"``) on CUDA, ``"eager"``
    (traced, no code generation) elsewhere. Measured on an H200 (7B shape, bf16, batch 1): inductor 126 tok/s after
    a 33 s first compile; ``"cudagraphs"`` captures in ~10 s but copies the weights into its graph inputs (15 GB more
    memory for a 7B model) and ran 56 tok/s, barely above eager's 50: keep the default."""
    max_graphs: int = 8
    """Distinct shapes (decode steps' and prefills' together) graphed at most (each costs a compile, ~30 s for a 7B
    model, and holds a capture's memory); later shapes run eagerly. Dynamo's ``recompile_limit`` (8 by default,
    process-wide, counting every model's graphs together) is raised by it for each decoder."""
    max_capacity: int = 32768
    """Tokens: a step needing a larger cache runs eagerly."""
    max_capture_bytes: int | None = None
    """Bytes: once the graphs' memory (:attr:`GraphedDecoder.capture_bytes`) reaches this, no new shape is graphed
    (lazily or at warm-up; shapes already graphed keep running graphed). None: no cap."""
    draft_buckets: tuple[int, ...] = DEFAULT_DRAFT_BUCKETS
    """Draft tokens per row (tree nodes below the root), ascending: a speculative verify forward is graphed with its
    nodes padded up to the next one (:mod:`kvboost_hf.hf.verify_graphs`); more run eagerly; () graphs no verify."""
    look_ahead: bool | None = None
    """Launch a graphed decode step of greedy rows before the host has read the tokens it feeds, so the host's work
    on one step's tokens overlaps the device's next step (:class:`~kvboost_hf.hf.decode.DecodeLoop`'s
    ``look_ahead``; the tokens are unchanged). None: on CUDA only (a CPU runs each forward as it is called: nothing
    overlaps, and a step cut off when rows leave or join is lost work)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled must be True or False, got {self.enabled!r}")
        if not all(is_integer(n) for n in (*self.row_buckets, *self.query_buckets, *self.draft_buckets)):
            raise ConfigError("row_buckets, query_buckets and draft_buckets must hold integers")
        if not is_integer(self.max_graphs) or not is_integer(self.max_capacity):
            raise ConfigError(
                f"max_graphs and max_capacity must be integers, got {self.max_graphs!r}, {self.max_capacity!r}"
            )
        buckets = self.row_buckets
        if not buckets or any(rows < 1 for rows in buckets) or list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"row_buckets must be ascending distinct positive batch sizes, got {buckets}")
        queries = self.query_buckets
        if any(length < 2 for length in queries) or list(queries) != sorted(set(queries)):
            raise ConfigError(f"query_buckets must be ascending distinct query lengths >= 2, got {queries}")
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
        if self.look_ahead not in (None, True, False):
            raise ConfigError(f"look_ahead must be True, False or None, got {self.look_ahead!r}")

    def looks_ahead(self, device: torch.device) -> bool:
        """Whether decode loops on ``device`` launch steps ahead (:attr:`look_ahead`; None: on CUDA)."""
        return self.enabled and (self.look_ahead if self.look_ahead is not None else device.type == "cuda")


def capacity_bucket(tokens: int, config: GraphConfig) -> int | None:
    """The static capacity (tokens) a graphed cache gets for ``tokens`` tokens: the next power of two from
    :data:`MIN_CAPACITY`, or None above ``config.max_capacity``."""
    capacity = max(MIN_CAPACITY, 1 << max(tokens - 1, 0).bit_length())
    return capacity if capacity <= config.max_capacity else None


def parse_graph_shapes(text: str, config: GraphConfig) -> tuple[Shape, ...]:
    """The graph shapes a text such as ``"1x2048,3x4000,1x2048x40,2x4096v8"`` names (comma separated; empty:
    none): batch rows x tokens of cache for a decode step, with x query tokens for a prefill of that many new
    tokens, or with v draft tokens for a speculative verify forward of that many draft tokens per row; each rounded
    up to its buckets (:func:`graph_shape`, :func:`verify_graph_shape`: ``3x4000`` -> ``(4, 4096)``,
    ``1x2048x40`` -> ``(1, 2048, 64)``, ``3x4000v5`` -> ``VerifyShape(4, 4096, 8)``), in order, once each. Raises
    :class:`~kvboost_hf.core.errors.ConfigError` for a malformed entry or one above the buckets."""
    shapes: dict[tuple[bool, Shape], Shape] = {}  # keyed by kind too: a verify shape equals a prefill's tuple
    for entry in filter(None, (part.strip() for part in text.split(","))):
        forward, verify, drafts = entry.lower().partition("v")
        numbers = [part.strip() for part in forward.split("x")]
        if (
            len(numbers) not in ((2,) if verify else (2, 3))
            or not all(number.isdigit() for number in numbers)
            or (verify and not drafts.strip().isdigit())
        ):
            raise ConfigError(
                f"a graph shape is ROWSxTOKENS, ROWSxTOKENSxQUERIES or ROWSxTOKENSvDRAFTS with positive integers "
                f"(e.g. 4x2048, 1x2048x64 or 2x2048v8), got {entry!r}"
            )
        rows, tokens, *queries = map(int, numbers)
        shape = (
            verify_graph_shape(rows, tokens, int(drafts), config)
            if verify
            else graph_shape(rows, tokens, config, *queries)
        )
        shapes[(bool(verify), shape)] = shape
    return tuple(shapes.values())


def graph_shape(rows: int, tokens: int, config: GraphConfig, queries: int = 1) -> Shape:
    """The graph shape that a forward of ``queries`` new tokens per row (1: a decode step) for ``rows`` rows whose
    cache needs ``tokens`` tokens runs with: ``(rows bucket, capacity bucket)``, or ``(rows bucket, capacity bucket,
    query bucket)`` for a prefill (the capacity holding at least the padded queries and one reused column). Raises
    :class:`~kvboost_hf.core.errors.ConfigError` when it runs eagerly (above the largest row or query bucket or
    ``config.max_capacity``) or for a count below 1."""
    if rows < 1 or tokens < 1 or queries < 1:
        raise ConfigError(f"a graph shape has at least one row, token and query, got {rows} x {tokens} x {queries}")
    padded = 1 if queries == 1 else query_bucket(queries, config.query_buckets)
    bucket, capacity, padded = _buckets(
        rows, tokens, padded, 1, config, f"{rows} rows x {tokens} tokens x {queries} queries",
        f"query bucket {config.query_buckets[-1:]}",
    )  # fmt: skip
    return (bucket, capacity) if padded == 1 else (bucket, capacity, padded)


def _buckets(
    rows: int, tokens: int, padded: int | None, held: int, config: GraphConfig, shape: str, third: str
) -> tuple[int, int, int]:
    """``(rows bucket, capacity bucket, padded)`` of a graph for ``rows`` rows whose cache needs ``tokens`` tokens,
    and at least ``padded`` (queries or draft tokens rounded up to their bucket; None above them) plus ``held``
    columns. Raises :class:`~kvboost_hf.core.errors.ConfigError` naming ``shape`` and the ``third`` kind of bucket
    when a count is above its buckets or ``config.max_capacity``."""
    bucket = row_bucket(rows, config.row_buckets)
    capacity = capacity_bucket(max(tokens, (padded or 0) + held), config)
    if bucket is None or capacity is None or padded is None:
        raise ConfigError(
            f"{shape} is above the largest row bucket {config.row_buckets[-1]}, {third} or max_capacity "
            f"{config.max_capacity}: such forwards run eagerly"
        )
    return bucket, capacity, padded


def verify_graph_shape(rows: int, tokens: int, drafts: int, config: GraphConfig) -> VerifyShape:
    """The graph shape that a speculative verify forward of ``drafts`` draft tokens per row (tree nodes below the
    root) for ``rows`` rows whose cache needs ``tokens`` tokens (prompt, answer and a tree) runs with: the rows'
    bucket, the capacity bucket (holding at least one held column, the root and the padded drafts) and the drafts'
    bucket. Raises :class:`~kvboost_hf.core.errors.ConfigError` when it runs eagerly (above the largest row or
    draft bucket or ``config.max_capacity``) or for a count below 1."""
    if rows < 1 or tokens < 1 or drafts < 1:
        raise ConfigError(f"a verify graph shape has at least one row, token and draft token, got {rows} x "
                          f"{tokens} v {drafts}")  # fmt: skip
    bucket, capacity, padded = _buckets(
        rows, tokens, draft_bucket(drafts, config.draft_buckets), 2, config,
        f"{rows} rows x {tokens} tokens v {drafts} draft tokens", f"draft bucket {config.draft_buckets[-1:]}",
    )  # fmt: skip
    return VerifyShape(bucket, capacity, padded)


def draft_bucket(nodes: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``nodes`` draft tokens (tree nodes below the root, >= 1), or None above every
    bucket."""
    return next((bucket for bucket in buckets if bucket >= nodes), None)


def query_bucket(queries: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest query bucket holding ``queries`` new tokens, or None above every bucket."""
    return next((bucket for bucket in buckets if bucket >= queries), None)


def graphed_columns(width: int, config: GraphConfig) -> int:
    """Columns a cache may hold for a batch ``width`` wide when graphed decoding may make it static: the capacity
    bucket of ``width`` (:func:`capacity_bucket`), or ``width`` above the largest (that step runs eagerly)."""
    return capacity_bucket(width, config) or width


def graphed_drafts(nodes: int, config: GraphConfig) -> int:
    """Draft tokens a verify forward of ``nodes`` nodes holds when it may run graphed: its draft bucket
    (:func:`draft_bucket`, padding nodes after the real ones until the verifier drops them), or ``nodes`` above the
    largest (eager)."""
    return draft_bucket(nodes, config.draft_buckets) or nodes


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
    """What one :meth:`GraphedDecoder.warm_up` did, by :data:`Shape`: ``warmed`` compiled and captured now;
    ``skipped`` not (graphs off, graphed already, over ``max_graphs`` or ``max_capture_bytes``, or a dummy cache
    larger than the device's free memory; each logged); ``failed`` whose compile or capture raised (they run
    eagerly); ``seconds`` the warm-up's wall time."""

    warmed: tuple[Shape, ...]
    skipped: tuple[Shape, ...]
    failed: tuple[Shape, ...]
    seconds: float


class VerifyGraphs(Protocol):
    """What :class:`GraphedDecoder` uses of the verify graphs built on it
    (:class:`~kvboost_hf.hf.verify_graphs.GraphedVerifier`, which imports this module): their shapes, counted against
    ``max_graphs``, and their warm-up."""

    shapes: dict[VerifyShape, int]
    warmed: set[VerifyShape]

    def may_warm(self, shape: VerifyShape) -> bool: ...

    def warm_shape(self, cache: Any, shape: VerifyShape) -> bool | None: ...


class GraphedDecoder:
    """Decode steps and short prefills of ``model``: through one compiled ``forward`` when they fit a graph, eagerly
    otherwise.

    ``graphed_steps``/``eager_steps`` count the decode steps each way and ``graphed_prefills``/``eager_prefills``
    the prompt forwards handed to :meth:`prefill` (a warm-up's not included); ``graph_shapes`` lists the shapes
    (:data:`Shape`) run graphed (one graph each) with their runs (a warm-up's included); ``failed_shapes`` those
    whose compile or capture raised (logged once; they run eagerly from then on); ``capture_bytes`` is the growth
    of the CUDA allocator's reserved memory over the first runs of each shape (compilation and capture; 0 on a
    CPU), each run's growth counted from 0 up (memory the allocator hands back during a run, e.g. compilation's
    temporaries, is not subtracted); ``warmed_shapes`` the shapes :meth:`warm_up` compiled, ``warm_up_seconds``
    the time its calls took; :attr:`state` what a readiness probe reads; ``verifiers`` the
    :class:`~kvboost_hf.hf.verify_graphs.GraphedVerifier` s built on it, whose graphs count against ``max_graphs``
    too (:attr:`graph_count`).
    """

    def __init__(self, model: PreTrainedModel, config: GraphConfig | None = None) -> None:
        self.model = model
        self.config = config or GraphConfig()
        self._compiled: Callable[..., Any] | None = None
        self.graphed_steps = 0
        self.eager_steps = 0
        self.graphed_prefills = 0
        self.eager_prefills = 0
        self.graph_shapes: dict[Shape, int] = {}  # shape -> runs with it
        self.failed_shapes: set[Shape] = set()
        self.capture_bytes = 0
        self.warmed_shapes: set[Shape] = set()
        self.warm_up_seconds = 0.0
        self.verifiers: list[VerifyGraphs] = []
        self._warm_up = "lazy"  # "warming" while warm_up() runs, "ready" once one returned
        self.buffers = StaticBufferPool()
        """The static K/V buffers every cache made static for these graphs takes (:meth:`adopt`): a graph replays at
        the addresses it was recorded with, request after request, instead of re-recording."""

    def adopt(self, cache: Any) -> None:
        """Let ``cache`` (a :class:`~kvboost_hf.hf.cache.ChunkReuseCache`) take its static buffers from
        :attr:`buffers` when it becomes static."""
        cache.static_buffers = self.buffers

    @property
    def state(self) -> str:
        """``"off"`` (graphs disabled), ``"warming"`` (a :meth:`warm_up` runs), ``"ready"`` (a warm-up returned,
        whatever it skipped), or ``"lazy"`` (no warm-up yet: each shape compiles at its first step)."""
        return self._warm_up if self.config.enabled else "off"

    def rows_for(self, rows: int) -> int:
        """Rows to build a cache with for a batch of ``rows``: its bucket, or ``rows`` when it runs eagerly."""
        bucket = row_bucket(rows, self.config.row_buckets)
        return bucket if self.config.enabled and bucket is not None else rows

    def graphed(self, cache: Any, rows: int, queries: int = 1) -> bool:
        """Whether a forward of ``queries`` new tokens (1: a decode step; else a query bucket) for ``rows`` rows
        over ``cache`` runs graphed."""
        if not (self.config.enabled and getattr(cache, "is_compileable", False) and rows in self.config.row_buckets):
            return False
        if queries == 1:
            return self._may_graph((rows, cache.max_cache_len))
        return queries in self.config.query_buckets and self._may_graph((rows, cache.max_cache_len, queries))

    def prefill_capacity(self, rows: int, held: int, queries: int, answer: int) -> int | None:
        """The static capacity (tokens) a cache holding ``held`` reused columns gets for a graphed prefill of
        ``queries`` new tokens per row of ``rows`` followed by up to ``answer`` decode steps: the capacity bucket
        of ``held + queries + answer``, what the decode steps after it run over (and what a K/V budget counts:
        :func:`graphed_columns`). None when the prefill runs eagerly: graphs off, no reused column, a tail above
        the query buckets, rows above the row buckets, a capacity above ``max_capacity``, a padded tail that would
        not fit that capacity (``held`` plus the query bucket past it: near a bucket's end with a short answer), a
        padded tail whose positions would pass the model's length-dependent RoPE limit
        (:func:`~kvboost_hf.reuse.rope.exact_reuse_length`: the padding's positions would switch every query's
        frequencies), or a shape not graphed that :meth:`_may_graph` refuses."""
        bucket = query_bucket(queries, self.config.query_buckets)
        rows_bucket = row_bucket(rows, self.config.row_buckets)
        if not self.config.enabled or held < 1 or bucket is None or rows_bucket is None:
            return None
        capacity = capacity_bucket(held + queries + answer, self.config)
        if capacity is None or held + bucket > capacity or not self._may_graph((rows_bucket, capacity, bucket)):
            return None
        limit = exact_reuse_length(self.model)
        if limit is not None and held + bucket > limit:
            return None
        return capacity

    def _may_graph(self, shape: Shape) -> bool:
        """Whether ``shape`` runs graphed: graphed already, or room for one more graph (``max_graphs``, the capture
        memory cap), and not failed."""
        if shape in self.failed_shapes:
            return False
        if shape in self.graph_shapes:
            return True
        cap = self.config.max_capture_bytes
        return self.graph_count < self.config.max_graphs and (cap is None or self.capture_bytes < cap)

    @property
    def graph_count(self) -> int:
        """Graphs captured for this model: decode and prefill shapes, and the verify shapes of :attr:`verifiers`."""
        return len(self.graph_shapes) + sum(len(verifier.shapes) for verifier in self.verifiers)

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

    def prefill(
        self, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """The prompt forward of the uncached tail ``input_ids`` ``[rows, queries]`` at ``position_ids`` over the
        reused K/V ``cache`` holds (static, with room for the tail's query bucket: :meth:`prefill_capacity`);
        ``attention_mask``: the 2D mask of the held columns and the tail's (``[rows, held + queries]``, 0 for left
        padding). Returns the last token's logits ``[rows, vocab]``, the layers holding exactly ``held + queries``
        columns; the caller records ``input_ids`` in the cache.

        Graphed when the shape fits (:meth:`graphed`): the tail padded to its query bucket with copies of its last
        token at the following positions (attended columns), the last real token's logits picked by an index
        tensor; the padding's K/V, written after the real columns where the causal mask hides them from every real
        query, are then cut off (the lengths set back). Otherwise, or when the shape's compile fails, eagerly."""
        rows, queries = input_ids.shape
        bucket = query_bucket(queries, self.config.query_buckets)
        if bucket is not None and self.graphed(cache, rows, bucket):
            extra, device = bucket - queries, input_ids.device
            following = position_ids[:, -1:] + torch.arange(1, extra + 1, device=device)
            last = torch.tensor([queries - 1]).to(device, non_blocking=True)
            logits = self._graphed_run(
                cache,
                torch.cat([input_ids, input_ids[:, -1:].expand(rows, extra)], dim=1),
                torch.cat([position_ids, following], dim=1),
                torch.nn.functional.pad(attention_mask, (0, extra), value=1),
                last,
            )
            if logits is not None:
                cache.crop(-extra)  # the padding's columns: the next forward overwrites them
                self.graphed_prefills += 1
                return logits
        self.eager_prefills += 1
        return self._run(self.model.forward, cache, input_ids, position_ids, attention_mask, None)

    def _graphed_run(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        keep: int | torch.Tensor = 1,
    ) -> torch.Tensor | None:
        """A forward through the compiled ``forward`` (``keep``: ``logits_to_keep``); None when this shape's first
        run (its compile or capture) raised (:meth:`guarded`): the forward is then the caller's to run eagerly."""
        rows, queries = input_ids.shape
        shape: Shape = (rows, cache.max_cache_len) if queries == 1 else (rows, cache.max_cache_len, queries)
        return self.guarded(
            shape,
            self.graph_shapes,
            self.failed_shapes,
            cache,
            input_ids.device,
            lambda: self._run(self._graph(), cache, input_ids, position_ids, attention_mask, shape, keep),
        )

    def guarded(
        self,
        shape: tuple[int, ...],
        runs: dict[Any, int],
        failed: set[Any],
        cache: Any,
        device: torch.device,
        forward: Callable[[], torch.Tensor],
    ) -> torch.Tensor | None:
        """``forward()``, a graphed forward of ``shape``, under the graphs' rules: counted in ``runs`` (runs per
        shape); on CUDA its first three runs add the memory they reserve to :attr:`capture_bytes`; after its first
        run (the compile) a garbage collection frees what the compile left in reference cycles, which held the
        traced cache's static buffers (the pool, :attr:`buffers`, would collect for them inside a later request);
        when the shape's first run raises (its compile or capture), the shape joins ``failed`` (logged), the cache's
        device lengths are re-synced (a failed compile may have run part of the forward) and the result is None; a
        later raise is not a compile's and propagates."""
        watch = runs.get(shape, 0) < 3 and device.type == "cuda"
        before = torch.cuda.memory_reserved(device) if watch else 0
        try:
            logits = forward()
        except Exception:
            if shape in runs:  # it ran before: not a compile or capture failure
                raise
            logger.warning("graphed forward of shape %s failed; it runs eagerly", shape, exc_info=True)
            failed.add(shape)
            if (sync := getattr(cache, "sync_device_lengths", None)) is not None:
                sync()
            return None
        if watch:
            self.capture_bytes += max(0, torch.cuda.memory_reserved(device) - before)
        if shape not in runs:  # it compiled: free what the compile left in reference cycles (it traced this cache,
            gc.collect()  # whose static buffers the pool would otherwise collect for inside a later request)
        runs[shape] = runs.get(shape, 0) + 1
        return logits

    def warm_up(
        self,
        new_cache: Callable[[], Any],
        shapes: Iterable[tuple[int, ...]],
        *,
        progress: bool = True,
        verifier: VerifyGraphs | None = None,
    ) -> GraphWarmUp:
        """Compile and capture the graphs of ``shapes`` (``(rows, tokens)`` for decode steps, ``(rows, tokens,
        queries)`` for prefills of that many new tokens, each rounded up to its buckets: :func:`graph_shape`; a
        :class:`VerifyShape` ``(rows, tokens, drafts)`` for ``verifier``'s verify forwards of that many draft tokens
        per row: :func:`verify_graph_shape`) before any request needs them, so no request's forward pays a compile
        (a later cache of a warmed shape replays its graph; on CUDA its buffers' new addresses cost a re-record, not
        a compile).

        Per shape: a dummy cache from ``new_cache()`` (a fresh, empty :class:`~kvboost_hf.hf.cache.ChunkReuseCache`
        with the settings requests' caches get, so the compiled graph's guards hold for them), one eager forward of
        one token per row straight through the model (no store lookup, nothing recorded, nothing written back), the
        cache made static at the capacity, then :data:`WARM_UP_STEPS` graphed forwards (decode steps, prefills of
        the query bucket or verify forwards of the draft bucket, each cut off after); the cache is dropped after.
        The store, the caches of requests and the counters of steps, prefills and verifies are untouched. Shapes are
        skipped (logged) when graphs are off, when graphed already, beyond ``max_graphs`` or ``max_capture_bytes``,
        for a verify shape without a ``verifier`` (no speculative decoding), or when the dummy cache's static K/V
        would not fit the device's free memory; a failed compile leaves its shape eager, as a lazy one would.
        ``progress``: a tqdm bar over the shapes. Raises :class:`~kvboost_hf.core.errors.ConfigError` (before any
        work) for a shape above the buckets."""
        wanted: dict[tuple[bool, Shape], Shape] = {}  # keyed by kind too: a verify shape equals a prefill's tuple
        for named in shapes:
            if isinstance(named, VerifyShape):
                shape: Shape = verify_graph_shape(named.rows, named.capacity, named.drafts, self.config)
            else:
                shape = graph_shape(named[0], named[1], self.config, *named[2:])
            wanted[(isinstance(shape, VerifyShape), shape)] = shape
        warmed: list[Shape] = []
        skipped: list[Shape] = []
        failed: list[Shape] = []
        started = time.perf_counter()
        self._warm_up = "warming"
        try:
            for shape in tqdm(list(wanted.values()), desc="forward graphs", unit="shape", disable=not progress):
                if isinstance(shape, VerifyShape):
                    ready = verifier is not None and verifier.may_warm(shape)
                else:
                    ready = shape not in self.graph_shapes and self._may_graph(shape)
                if not (self.config.enabled and ready):
                    logger.info("graph warm-up skips shape %s: graphs off, graphed already, failed before, "
                                "max_graphs/max_capture_bytes reached or no verifier", shape)  # fmt: skip
                    skipped.append(shape)
                    continue
                began = time.perf_counter()
                if isinstance(shape, VerifyShape):
                    assert verifier is not None
                    outcome = verifier.warm_shape(new_cache(), shape)
                else:
                    outcome = self._warm_shape(new_cache(), shape)
                (skipped if outcome is None else warmed if outcome else failed).append(shape)
                logger.info("graph warm-up of shape %s: %s in %.1f s", shape,
                            {None: "skipped", True: "captured", False: "failed"}[outcome],
                            time.perf_counter() - began)  # fmt: skip
        finally:
            self._warm_up = "ready"
            self.warm_up_seconds += time.perf_counter() - started
        self.warmed_shapes.update(shape for shape in warmed if not isinstance(shape, VerifyShape))
        if verifier is not None:
            verifier.warmed.update(shape for shape in warmed if isinstance(shape, VerifyShape))
        return GraphWarmUp(tuple(warmed), tuple(skipped), tuple(failed), time.perf_counter() - started)

    def dummy_column(self, cache: Any, rows: int, capacity: int) -> bool:
        """A warm-up's start on the empty dummy ``cache``: one eager forward of one token per row straight through
        the model (no store lookup, nothing recorded), then the cache made static at ``capacity`` tokens. False
        (logged, the cache left growing) when on CUDA that static K/V would not fit the device's free memory."""
        device = next(self.model.parameters()).device
        ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        with torch.inference_mode():  # the prompt forward: one column of K/V per row
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_ARGUMENT: cache})
        self.adopt(cache)
        if device.type == "cuda":
            per_column = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)  # all rows, 1 column
            needed, free = per_column * capacity, torch.cuda.mem_get_info(device)[0]
            if needed > free:
                logger.warning("graph warm-up: a %d-row cache of %d tokens needs %d bytes, %d are free",
                               rows, capacity, needed, free)  # fmt: skip
                return False
        cache.set_max_cache_len(capacity)
        return True

    def _warm_shape(self, cache: Any, shape: Shape) -> bool | None:
        """Warm the decode or prefill ``shape`` up on the empty dummy ``cache``: True once graphed, False when its
        compile failed, None when its static K/V would not fit the device's free memory (see :meth:`warm_up`)."""
        rows, capacity, queries = (*shape, 1)[:3]
        if not self.dummy_column(cache, rows, capacity):
            return None
        device = next(self.model.parameters()).device
        ids = torch.zeros(rows, queries, dtype=torch.long, device=device)
        last = 1 if queries == 1 else torch.tensor([queries - 1], device=device)  # a prefill's keeps an index
        for _ in range(WARM_UP_STEPS):
            held = cache.get_seq_length()  # settles the layers' host lengths, as a request's record() does
            position = torch.arange(held, held + queries, device=device).repeat(rows, 1)  # contiguous, as a request's
            mask = torch.ones(rows, held + queries, dtype=torch.long, device=device)
            if self._graphed_run(cache, ids, position, mask, last) is None:
                return False
            if queries > 1:
                cache.crop(-queries)  # as a prefill's padding: the dummy cache back to its one column
        return True

    def _run(
        self,
        forward: Callable[..., Any],
        cache: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        shape: Shape | None,
        keep: int | torch.Tensor = 1,
    ) -> torch.Tensor:
        device = input_ids.device
        width = shape[1] if shape is not None else cache.get_seq_length() + input_ids.shape[1]
        if attention_mask is None:
            pads = to_device(getattr(cache, "pads", None) or [0] * input_ids.shape[0], device)
            attention_mask = (torch.arange(width, device=device) >= pads[:, None]).long()  # left padding masked
        elif attention_mask.shape[1] < width:
            attention_mask = torch.nn.functional.pad(attention_mask, (0, width - attention_mask.shape[1]))
        with torch.inference_mode():
            out = forward(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=keep,
                **{CACHE_ARGUMENT: cache},
            )
            return out.logits[:, -1].clone()

    def stats(self) -> dict[str, Any]:
        """Counters for ``cache_stats()``: decode steps and prefills each way, shapes graphed and failed, capture
        bytes, shapes warmed up and the warm-ups' seconds, and the static K/V buffers handed out again, allocated
        and kept (bytes, in use or free: device memory the pool holds between requests)."""
        return {
            "graphed_steps": self.graphed_steps,
            "eager_steps": self.eager_steps,
            "graphed_prefills": self.graphed_prefills,
            "eager_prefills": self.eager_prefills,
            "graph_shapes": len(self.graph_shapes),
            "failed_shapes": len(self.failed_shapes),
            "capture_bytes": self.capture_bytes,
            "warmed_shapes": len(self.warmed_shapes),
            "warm_up_seconds": self.warm_up_seconds,
            "static_buffers_reused": self.buffers.reused,
            "static_buffers_allocated": self.buffers.allocated,
            "static_buffers_bytes": self.buffers.kept_bytes,
        }

    def _graph(self) -> Callable[..., Any]:
        if self._compiled is None:
            cuda = next(self.model.parameters()).device.type == "cuda"
            backend = self.config.backend or ("inductor" if cuda else "eager")
            mode = "reduce-overhead" if backend == "inductor" and cuda else None
            reserve_recompiles(self.config.max_graphs)  # every shape is a recompile of one function
            self._compiled = torch.compile(
                self.model.forward, backend=backend, mode=mode, fullgraph=True, dynamic=False
            )
        return self._compiled
