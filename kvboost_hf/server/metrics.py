"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms.

All metric objects are thread-safe; the worker thread and the HTTP layer update them concurrently.
Latencies are in seconds, sizes in rows, token counts in tokens.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable

LabelValues = tuple[str, ...]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Counter:
    """A monotonically increasing value per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, label_names
        self._values: dict[LabelValues, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {v:g}" for k, v in items]


class Histogram:
    """Cumulative buckets, ``_sum`` and ``_count`` (no labels)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def samples(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines, cumulative = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], counts, strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        return [*lines, f"{self.name}_sum {total:g}", f"{self.name}_count {cumulative}"]


class Scraped:
    """Values read at scrape time from ``read`` (returns ``{label values: value}``); ``kind`` is "gauge" or
    "counter" (a cumulative value kept elsewhere, e.g. store hits)."""

    def __init__(
        self,
        name: str,
        help_text: str,
        read: Callable[[], dict[LabelValues, float]],
        label_names: tuple[str, ...] = (),
        kind: str = "gauge",
    ) -> None:
        self.name, self.help, self.read, self.label_names, self.kind = name, help_text, read, label_names, kind

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {v:g}" for k, v in sorted(self.read().items())]


class Metrics:
    """Every metric the server exposes under ``/metrics`` (names prefixed ``kvboost_``)."""

    def __init__(self) -> None:
        self.requests = Counter("kvboost_requests_total", "HTTP requests answered.", ("endpoint", "code"))
        self.errors = Counter("kvboost_errors_total", "Requests answered with an error.", ("endpoint", "code"))
        self.batch_size = Histogram("kvboost_batch_size", "Rows per admitted batch.", BATCH_BUCKETS)
        self.ttft = Histogram("kvboost_ttft_seconds", "Arrival to first token, per choice.", LATENCY_BUCKETS_S)
        self.inter_token = Histogram(
            "kvboost_inter_token_seconds", "Time between consecutive tokens of a choice.", LATENCY_BUCKETS_S
        )
        self.prompt_tokens = Counter(
            "kvboost_prompt_tokens_total", "Prompt tokens by origin: loaded from the store or computed.", ("origin",)
        )
        self.completion_tokens = Counter("kvboost_completion_tokens_total", "Generated tokens.")
        self._scraped: list[Scraped] = []

    def add_scraped(self, metric: Scraped) -> None:
        self._scraped.append(metric)

    def observe_token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.inter_token).observe(seconds)
        self.completion_tokens.inc()

    def render(self) -> str:
        out: list[str] = []
        for metric in [
            self.requests,
            self.errors,
            self.batch_size,
            self.ttft,
            self.inter_token,
            self.prompt_tokens,
            self.completion_tokens,
            *self._scraped,
        ]:
            out += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}", *metric.samples()]
        return "\n".join(out) + "\n"
