"""The server's Prometheus metrics on ``prometheus_client`` (one registry per app, exposed under ``/metrics``).

All metric objects are thread-safe; the worker thread and the HTTP layer update them concurrently. A scrape
(:meth:`Metrics.render`, run in a thread) reads the engine's state once into :attr:`Metrics.state`, and every
scraped metric reads that snapshot. Latencies are in seconds, sizes in rows, token counts in tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ScrapedCounters(Collector):
    """A counter (labelled, or not when ``label`` is None) whose cumulative values live elsewhere and are read at
    scrape time; an unlabelled one reads ``{"": value}``."""

    def __init__(self, name: str, help_text: str, label: str | None, read: Callable[[], dict[str, float]]) -> None:
        self.name, self.help, self.label, self.read = name, help_text, label, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = [self.label] if self.label else []
        family = CounterMetricFamily(self.name, self.help, labels=labels)
        for value_label, value in sorted(self.read().items()):
            family.add_metric([value_label] if labels else [], value)
        yield family


class Metrics:
    """Every metric the server exposes (names prefixed ``kvboost_``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvboost_requests", "HTTP requests answered.", ("endpoint", "code"), registry=r)
        self.errors = Counter("kvboost_errors", "Requests answered with an error.", ("endpoint", "code"), registry=r)
        self.batch_size = Histogram("kvboost_batch_size", "Rows per admitted batch.", buckets=BATCH_BUCKETS, registry=r)
        self.ttft = Histogram(
            "kvboost_ttft_seconds", "Arrival to first token, per choice.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.inter_token = Histogram(
            "kvboost_inter_token_seconds",
            "Time between consecutive tokens of a choice.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvboost_prompt_tokens", "Prompt tokens by origin: loaded or computed.", ("origin",), registry=r
        )
        self.completion_tokens = Counter("kvboost_completion_tokens", "Generated tokens.", registry=r)
        self.state: Mapping[str, float] = {}
        self._read_state: Callable[[], Mapping[str, float]] = dict
        self._scrape_lock = threading.Lock()

    def read_state_with(self, read: Callable[[], Mapping[str, float]]) -> None:
        """``read()`` is called once per scrape; its result is :attr:`state` while the metrics are rendered."""
        self._read_state = read

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time."""
        Gauge(name, help_text, registry=self.registry).set_function(read)

    def scraped_counter(
        self, name: str, help_text: str, label: str | None, read: Callable[[], dict[str, float]]
    ) -> None:
        """A counter kept elsewhere (e.g. store hits), read at scrape time; ``name`` without ``_total``."""
        self.registry.register(_ScrapedCounters(name, help_text, label, read))

    def observe_token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.inter_token).observe(seconds)
        self.completion_tokens.inc()

    def render(self) -> bytes:
        """The exposition text: the state is read once, then every metric is rendered (blocking: call it from a
        thread, not the event loop)."""
        with self._scrape_lock:
            self.state = self._read_state()
            return generate_latest(self.registry)
