"""Where a request spends its time and bytes: a copy counter and a phase timer for the benchmarks.

* :class:`CopyCounter` (a ``TorchDispatchMode``, so it works on CPU and GPU alike) counts the bytes written by
  tensor operations that only move data (copies, concatenations, gathers, clones), split by direction
  (host-to-device, device-to-host, within a device). Compute operations (matmuls, attention) are not counted.
* :class:`PhaseTimer` attributes a request's time to named phases by wrapping the functions that implement them
  (tokenize, plan, stitch, forward, write-back): CUDA events on a GPU (one synchronisation at the end), the wall
  clock on a CPU. Nested phases count only in the innermost one.
* :class:`CharacterCounter` counts the characters handed to a fast tokenizer's backend (every encode path, the
  engine's token ids cache included, ends there).
* :func:`profile_call` runs a call under ``torch.profiler`` and ``cProfile`` together: wall against device time,
  the synchronisations, the top operations and the top Python functions (where a slow call's host time goes).
* :class:`SyncSites` records where the host waited on a CUDA device (``torch.cuda.set_sync_debug_mode``), by the
  innermost frame of this package in each wait's Python stack: the list of call sites to remove.
* :class:`GcTimer` counts Python's garbage collections while active and their ms, by generation (a full
  collection in a process holding compiled graphs can pause a request for tens of ms).
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import gc
import io
import pstats
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = torch.ops.aten
MOVING_OPS = frozenset(
    {
        _ATEN.copy_.default,
        _ATEN._to_copy.default,
        _ATEN.clone.default,
        _ATEN.cat.default,
        _ATEN.stack.default,
        _ATEN.index_copy_.default,
        _ATEN.index_copy.default,
        _ATEN.index_select.default,
        _ATEN.index.Tensor,
        _ATEN.index_put_.default,
        _ATEN.gather.default,
        _ATEN.repeat_interleave.self_int,
        _ATEN.repeat.default,
        _ATEN.constant_pad_nd.default,
        _ATEN.slice_scatter.default,
        _ATEN.expand_copy.default,
    }
)
"""ATen operations that only move data: their outputs' bytes are what :class:`CopyCounter` counts."""


def _direction(op: Any, args: tuple, out: torch.Tensor) -> str:
    source = args[1] if op is _ATEN.copy_.default and len(args) > 1 else args[0]
    if isinstance(source, (list, tuple)):
        source = source[0] if source else out
    if not isinstance(source, torch.Tensor) or source.device == out.device:
        return "within_device"
    return "host_to_device" if source.device.type == "cpu" else "device_to_host"


class CopyCounter(TorchDispatchMode):
    """Counts bytes written by data-moving operations (:data:`MOVING_OPS`) while active.

    ``bytes`` maps a direction (``host_to_device``, ``device_to_host``, ``within_device``) to bytes; ``total`` sums
    them. A ``copy_`` into a slice counts the slice's bytes (what was written), not the whole tensor's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MOVING_OPS:
            outputs = out if isinstance(out, (list, tuple)) else [out]
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor):
                    self.bytes[_direction(func, args, tensor)] += tensor.numel() * tensor.element_size()
        return out


class PhaseTimer:
    """Time per named phase of a request, in ms. Use :meth:`wrap` to time every call of a function (patched
    for the timer's lifetime, restored by :meth:`close`), or :meth:`phase` around a block.

    On CUDA each phase is bracketed by events on the current stream and read once at :meth:`totals` (no
    synchronisation inside the request); on a CPU by ``time.perf_counter``. A phase entered inside another is
    subtracted from the outer one, so the totals add up to the time spent in phases.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[str, Any, Any, list[int]]] = []  # (name, start, end, direct sub-phase indices)
        self._open: list[list[int]] = []  # per open phase, the indices of its finished direct sub-phases
        self._patches: list[tuple[Any, str, Any]] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._mark()
        self._open.append([])
        try:
            yield
        finally:
            children = self._open.pop()
            self._spans.append((name, start, self._mark(), children))
            if self._open:
                self._open[-1].append(len(self._spans) - 1)

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """Time every call of ``owner.attribute`` (a function of a module or class, or a bound method of an
        object) as phase ``name`` until :meth:`close`."""
        original = getattr(owner, attribute)
        timer = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with timer.phase(name):
                return original(*args, **kwargs)

        self._patches.append((owner, attribute, vars(owner).get(attribute)))
        setattr(owner, attribute, timed)

    def close(self) -> None:
        """Restore every wrapped function (an attribute that was only inherited is removed again)."""
        for owner, attribute, original in reversed(self._patches):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        self._patches.clear()

    def __enter__(self) -> PhaseTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def totals(self) -> dict[str, float]:
        """ms per phase name, each phase's sub-phases excluded (synchronises the device once on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        durations = [self._elapsed(start, end) for _, start, end, _ in self._spans]
        out: dict[str, float] = defaultdict(float)
        for (name, _, _, children), duration in zip(self._spans, durations, strict=True):
            out[name] += duration - sum(durations[child] for child in children)
        return dict(out)

    def _elapsed(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) if self.cuda else (end - start) * 1e3


def timed_call(function: Callable[[], Any], device: torch.device | str) -> tuple[float, Any]:
    """``(ms, result)`` of one call of ``function``, the device synchronised before and after."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = function()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3, result


def _characters(texts: object) -> int:
    """Characters in an encode argument: a string, a pair, or a batch of them (pre-tokenized words included)."""
    if isinstance(texts, str):
        return len(texts)
    if isinstance(texts, (list, tuple)):
        return sum(_characters(text) for text in texts)
    return 0


class _CountingBackend:
    """Forwards everything to a ``tokenizers.Tokenizer``, counting the characters of each encode call's input."""

    def __init__(self, backend: Any, counter: CharacterCounter) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_counter", counter)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._backend, name)
        if not name.startswith("encode") or not callable(attribute):
            return attribute

        def counted(texts: Any, *args: Any, **kwargs: Any) -> Any:
            self._counter.chars += _characters(texts)
            self._counter.calls += 1
            return attribute(texts, *args, **kwargs)

        return counted

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)


class CharacterCounter:
    """Counts characters handed to a fast tokenizer while installed (``with CharacterCounter(tokenizer) as c:``):
    ``chars`` (characters in every ``encode*`` call of its backend, ``tokenizer._tokenizer``, which transformers'
    ``tokenizer(...)`` and :class:`~kvboost_hf.hf.tokens.SegmentTokenizer` both call) and ``calls``. Outputs are
    unchanged; the backend is restored on exit."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chars = 0
        self.calls = 0

    def __enter__(self) -> CharacterCounter:
        self._backend = self.tokenizer._tokenizer
        self.tokenizer._tokenizer = _CountingBackend(self._backend, self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.tokenizer._tokenizer = self._backend

    def reset(self) -> None:
        self.chars = self.calls = 0


SYNCHRONIZING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that make the host wait on the device (``cudaMemcpyAsync`` excepted by name)."""


SYNC_WARNING = "called a synchronizing"
"""What ``torch.cuda.set_sync_debug_mode("warn")``'s warning says for every call that waits on the device."""


class SyncSites:
    """The synchronising calls made inside the block on CUDA (``with SyncSites() as sites:``), each as its Python
    stack (:attr:`stacks`, innermost frame last), through ``torch.cuda.set_sync_debug_mode("warn")`` with the
    warnings captured (not shown). On a CPU nothing waits and nothing is recorded. :meth:`by_site` groups them by
    the innermost frame in ``kvboost_hf`` (the call to change). Not reentrant; it sets the process-wide debug mode
    and warning hook while active."""

    def __init__(self, depth: int = 24) -> None:
        self.depth = depth
        self.stacks: list[traceback.StackSummary] = []
        self._warnings: Any = None

    def _record(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if SYNC_WARNING in str(message):
            self.stacks.append(traceback.StackSummary.from_list(traceback.extract_stack(limit=self.depth)[:-1]))

    def __enter__(self) -> SyncSites:
        if torch.cuda.is_available():
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self._warnings = None

    def by_site(self) -> dict[str, int]:
        """Synchronisations per call site, most first: ``path:line function`` of the innermost frame under
        ``kvboost_hf/`` (else the innermost frame), the path from the package's folder on."""
        return dict(Counter(_site(stack) for stack in self.stacks).most_common())

    def report(self) -> str:
        """Each synchronisation's stack (the last ``depth`` frames), numbered: a test's failure message."""
        return "".join(f"\n--- synchronisation {i}\n{''.join(stack.format())}" for i, stack in enumerate(self.stacks))


def _site(stack: traceback.StackSummary) -> str:
    ours = [frame for frame in stack if "/kvboost_hf/" in frame.filename and "/bench/" not in frame.filename]
    frame = (ours or list(stack))[-1]
    path = frame.filename.rsplit("/kvboost_hf/", 1)[-1] if "/kvboost_hf/" in frame.filename else frame.filename
    return f"{path}:{frame.lineno} {frame.name}"


def profile_call(
    call: Callable[[], Any], device: torch.device, per: int = 1, rows: int = 12
) -> tuple[Any, dict[str, Any]]:
    """Run ``call()`` once under ``torch.profiler`` (CPU activity, and CUDA's on a GPU) and ``cProfile``; returns
    the call's result and figures per unit of ``per`` (e.g. decode steps): ``profile_wall_ms_per_step`` (both
    profilers' overhead included), ``profile_device_ms_per_step`` (the kernels' total), ``profile_syncs_per_step``
    (host calls that wait on the device: every synchronize and blocking ``cudaMemcpy``), ``profile_sync_sites``
    (where they were called, per :meth:`SyncSites.by_site`, counts not divided; {} on a CPU), ``profile_table`` (the top
    ``rows`` operations by host time) and ``profile_python`` (the top Python functions by cumulative time, then by
    own time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    python = cProfile.Profile()
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        python.enable()
        try:
            with SyncSites() as sites:
                result = call()
            if cuda:
                torch.cuda.synchronize(device)
        finally:
            python.disable()
            wall_ms = (time.perf_counter() - started) * 1e3  # before the profiler's own processing at exit
    averages = profiler.key_averages()
    kernels_us = sum(
        getattr(event, "self_device_time_total", 0) for event in profiler.events()
        if str(getattr(event, "device_type", "")).endswith("CUDA")
    )  # fmt: skip
    syncs = sum(
        event.count for event in averages
        if event.key.startswith(SYNCHRONIZING_CALLS) and not event.key.startswith("cudaMemcpyAsync")
    )  # fmt: skip
    return result, {
        "profile_wall_ms_per_step": wall_ms / per,
        "profile_device_ms_per_step": kernels_us / 1e3 / per,
        "profile_syncs_per_step": syncs / per,
        "profile_sync_sites": sites.by_site(),
        "profile_table": averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60),
        "profile_python": _python_hotspots(python, 2 * rows),
    }


def _python_hotspots(python: cProfile.Profile, rows: int) -> str:
    """``rows`` functions by cumulative time, then by own time, as ``pstats`` prints them."""
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text).strip_dirs()
    for order in ("cumulative", "tottime"):
        stats.sort_stats(order).print_stats(rows)
    return text.getvalue()


def profile_report(figures: dict[str, Any], unit: str) -> str:
    """:func:`profile_call`'s figures as text, per ``unit`` (e.g. ``step``, ``call``)."""
    sites = "".join(f"\n  {count:>4}  {site}" for site, count in figures.get("profile_sync_sites", {}).items())
    return (
        f"profiled: wall {figures['profile_wall_ms_per_step']:.2f} ms/{unit}, device "
        f"{figures['profile_device_ms_per_step']:.2f} ms/{unit}, {figures['profile_syncs_per_step']:.1f} "
        f"synchronisations/{unit}"
        + (f"\nwhere the host waited (calls, all {unit}s):{sites}" if sites else "")
        + f"\n{figures['profile_table']}\n{figures['profile_python']}"
    )


class GcTimer:
    """Python's garbage collections while active (``with GcTimer() as timer:``): ``collections`` and ``ms`` by
    generation (0, 1, 2; wall time between the collector's start and stop callbacks). Nested use is not supported."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = min(int(info.get("generation", 2)), 2)
        self.collections[generation] += 1
        self.ms[generation] += (time.perf_counter() - self._started) * 1e3

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def as_dict(self) -> dict[str, Any]:
        """``{"collections": [gen0, gen1, gen2], "ms": [...]}`` (ms rounded to 0.01)."""
        return {"collections": list(self.collections), "ms": [round(ms, 2) for ms in self.ms]}
