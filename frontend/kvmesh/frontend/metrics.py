"""Prometheus metrics of the gateway, in their own CollectorRegistry.

Observations happen on the event loop thread for every token, so the hot path avoids
prometheus_client's locked metric objects: counters and histograms are plain Python numbers
(bisect into fixed buckets) exposed through one custom collector at scrape time. Scrapes run on
the event loop too, so no locking is needed; do not observe from other threads.

Metric names (all prefixed `kvmesh_frontend_`):
- requests_total{endpoint,status}: finished HTTP requests.
- errors_total{type}: error responses and mid-stream errors by OpenAI error type.
- inflight_requests{model}: generation requests in progress.
- time_to_first_token_seconds{model}, inter_token_latency_seconds{model},
  request_duration_seconds{model}: latency histograms.
- input_sequence_tokens{model}, output_sequence_tokens{model}: ISL / OSL histograms.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = ["CONTENT_TYPE", "FrontendMetrics", "Histogram", "ModelMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content-Type of `FrontendMetrics.render()`."""

PREFIX = "kvmesh_frontend_"

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
ISL_BUCKETS = (
    16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0, 131072.0,
)  # fmt: skip
OSL_BUCKETS = (
    1.0, 4.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip


class Histogram:
    """A cumulative-at-export histogram with fixed upper bounds (`le` semantics)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        """`bounds`: sorted finite upper bounds; +Inf is implicit."""
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `value` `count` times."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.total += value * count

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs ending with +Inf, as Prometheus wants them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((_fmt(bound), float(running)))
        running += self.counts[-1]
        out.append(("+Inf", float(running)))
        return out


def _fmt(value: float) -> str:
    return repr(float(value))


class ModelMetrics:
    """The per-model histograms and in-flight count (attributes are the hot-path handles)."""

    __slots__ = ("duration", "inflight", "isl", "itl", "osl", "ttft")

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS)
        """Seconds from request arrival to the first generated token."""
        self.itl = Histogram(ITL_BUCKETS)
        """Seconds between consecutive tokens."""
        self.duration = Histogram(LATENCY_BUCKETS)
        """Seconds from arrival to the last token."""
        self.isl = Histogram(ISL_BUCKETS)
        """Prompt tokens per sequence."""
        self.osl = Histogram(OSL_BUCKETS)
        """Generated tokens per sequence."""
        self.inflight = 0
        """Generation requests in progress."""


class FrontendMetrics:
    """All gateway metrics, with their own registry (`registry`), rendered by `render()`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Register in `registry` (a new one by default; never the global registry)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self._requests: dict[tuple[str, str], int] = {}
        self._errors: dict[str, int] = {}
        self._models: dict[str, ModelMetrics] = {}
        self.registry.register(_Collector(self))

    def model(self, name: str) -> ModelMetrics:
        """The metric handles of served model `name` (created on first use)."""
        handles = self._models.get(name)
        if handles is None:
            handles = self._models[name] = ModelMetrics()
        return handles

    def request_done(self, endpoint: str, status: int) -> None:
        """Count one finished HTTP request."""
        key = (endpoint, str(status))
        self._requests[key] = self._requests.get(key, 0) + 1

    def error(self, type_: str) -> None:
        """Count one error of OpenAI error type `type_`."""
        self._errors[type_] = self._errors.get(type_, 0) + 1

    def requests(self, endpoint: str, status: int) -> int:
        """How many requests to `endpoint` finished with `status` (tests, dashboards)."""
        return self._requests.get((endpoint, str(status)), 0)

    def render(self) -> bytes:
        """Prometheus text exposition of the registry."""
        return bytes(generate_latest(self.registry))

    def collect(self) -> Iterator[Metric]:
        """Metric families for the collector."""
        requests = CounterMetricFamily(
            PREFIX + "requests", "Finished HTTP requests.", labels=["endpoint", "status"]
        )
        for (endpoint, status), n in sorted(self._requests.items()):
            requests.add_metric([endpoint, status], n)
        yield requests
        errors = CounterMetricFamily(
            PREFIX + "errors", "Errors returned to clients, by type.", labels=["type"]
        )
        for type_, n in sorted(self._errors.items()):
            errors.add_metric([type_], n)
        yield errors
        inflight = GaugeMetricFamily(
            PREFIX + "inflight_requests", "Generation requests in progress.", labels=["model"]
        )
        models = sorted(self._models.items())
        for name, m in models:
            inflight.add_metric([name], m.inflight)
        yield inflight
        specs = (
            ("time_to_first_token_seconds", "Time to first token.", "ttft"),
            ("inter_token_latency_seconds", "Time between consecutive tokens.", "itl"),
            ("request_duration_seconds", "Time from arrival to the last token.", "duration"),
            ("input_sequence_tokens", "Prompt tokens per sequence.", "isl"),
            ("output_sequence_tokens", "Generated tokens per sequence.", "osl"),
        )
        for suffix, doc, attr in specs:
            family = HistogramMetricFamily(PREFIX + suffix, doc, labels=["model"])
            for name, m in models:
                hist: Histogram = getattr(m, attr)
                family.add_metric([name], hist.buckets(), hist.total)
            yield family


class _Collector:
    """Adapter registering FrontendMetrics without exposing `describe` (no double collect)."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()
