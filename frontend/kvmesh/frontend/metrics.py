"""Prometheus metrics of the gateway, in their own CollectorRegistry: Dynamo's frontend metrics
(`dynamo_frontend_*`) under the `kvmesh_frontend_` prefix, same names, labels and meanings, so
dashboards and planners written for Dynamo read them with a prefix change.

Observations happen on the event loop thread for every token, so the hot path avoids
prometheus_client's locked metric objects (kvmesh.runtime.metrics.Histogram, plain counters),
exposed through one custom collector at scrape time.

Metric names (all prefixed `kvmesh_frontend_`; OpenTelemetry GenAI semantics in brackets):
- requests_total{model,endpoint,request_type,status,error_type}: finished LLM requests.
  endpoint: chat_completions, completions, embeddings, messages, count_tokens (Anthropic),
  kserve_infer, kserve_generate,
  kserve_generate_stream, kserve_grpc_infer, kserve_grpc_stream_infer; request_type: stream |
  unary; status: success | error; error_type ("" on success): validation, not_found, overload,
  unavailable, cancelled (the client went away), not_implemented, internal. `model` is
  `unknown_model` for names the gateway does not serve (bounded cardinality, as Dynamo).
- requests_started_total{model,endpoint,request_type}: requests accepted for processing.
- inflight_requests{model}: generation requests in progress; queued_requests{model}: those
  still waiting for their first token.
- disconnected_clients: clients that went away before their response ended (a gauge that only
  grows, as Dynamo's).
- time_to_first_token_seconds{model} [gen_ai.server.time_to_first_token],
  inter_token_latency_seconds{model} [gen_ai.server.time_per_output_token; one observation per
  token gap], request_itl_seconds{model} (one observation per finished sequence of two or more
  tokens: its mean gap, (last token - first token) / (tokens - 1); what a per-request ITL SLO
  judges, read by the SLA planner), request_duration_seconds{model}
  [gen_ai.server.request.duration]: histograms.
- input_sequence_tokens{model}, output_sequence_tokens{model} [gen_ai.client.token.usage by
  gen_ai.token.type input / output]: per sequence; cached_tokens{model}: prompt tokens a
  sequence found in the prefix cache; output_tokens_total{model}: tokens generated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvmesh.runtime.metrics import CONTENT_TYPE, Histogram, render, sum_expositions

__all__ = [
    "CONTENT_TYPE",
    "UNKNOWN_MODEL",
    "FrontendMetrics",
    "ModelMetrics",
    "error_type",
]

PREFIX = "kvmesh_frontend_"
UNKNOWN_MODEL = "unknown_model"
"""The `model` label of requests for a model the gateway does not serve."""

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
CACHED_BUCKETS = (0.0, *ISL_BUCKETS)

_ERROR_TYPES = {
    400: "validation",
    404: "not_found",
    405: "validation",
    413: "validation",
    422: "validation",
    429: "overload",
    499: "cancelled",
    501: "not_implemented",
    503: "unavailable",
    504: "response_timeout",
}


def error_type(status: int) -> str:
    """Dynamo's error_type label of a request answered with HTTP `status` ("" for success)."""
    if status < 400:
        return ""
    return _ERROR_TYPES.get(status, "validation" if status < 500 else "internal")


class ModelMetrics:
    """The per-model histograms and gauges (attributes are the hot-path handles)."""

    __slots__ = (
        "cached",
        "duration",
        "inflight",
        "isl",
        "itl",
        "osl",
        "output_tokens",
        "queued",
        "request_itl",
        "ttft",
    )

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS)
        """Seconds from request arrival to the first generated token."""
        self.itl = Histogram(ITL_BUCKETS)
        """Seconds between consecutive tokens."""
        self.request_itl = Histogram(ITL_BUCKETS)
        """Mean seconds between the tokens of one sequence, per finished sequence."""
        self.duration = Histogram(LATENCY_BUCKETS)
        """Seconds from arrival to the last token."""
        self.isl = Histogram(ISL_BUCKETS)
        """Prompt tokens per sequence."""
        self.osl = Histogram(OSL_BUCKETS)
        """Generated tokens per sequence."""
        self.cached = Histogram(CACHED_BUCKETS)
        """Prompt tokens per sequence served from a prefix cache."""
        self.output_tokens = 0
        """Tokens generated."""
        self.inflight = 0
        """Generation requests in progress."""
        self.queued = 0
        """Generation requests in progress without their first token yet."""


class FrontendMetrics:
    """All gateway metrics, with their own registry (`registry`), rendered by `render()`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Register in `registry` (a new one by default; never the global registry)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        """This process's own metrics: what it served, routed, holds in flight."""
        self.shared = CollectorRegistry(auto_describe=False)
        """Metrics of the mesh this process sees whole, as every gateway process does (the
        workers it routes to, their KV tiers): with --gateway-processes, never summed."""
        self.peers: Callable[[], Awaitable[list[bytes]]] | None = None
        """With --gateway-processes: the other processes' `render_own()`, summed into
        `exposition()` (kvmesh.frontend.group)."""
        self._requests: dict[tuple[str, str, str, str], int] = {}
        self._started: dict[tuple[str, str, str], int] = {}
        self._models: dict[str, ModelMetrics] = {}
        self.disconnected_clients = 0
        self.registry.register(_Collector(self))

    def model(self, name: str) -> ModelMetrics:
        """The metric handles of served model `name` (created on first use)."""
        handles = self._models.get(name)
        if handles is None:
            handles = self._models[name] = ModelMetrics()
        return handles

    def started(self, model: str, endpoint: str, request_type: str) -> None:
        """Count one request accepted for processing."""
        key = (model, endpoint, request_type)
        self._started[key] = self._started.get(key, 0) + 1

    def finished(self, model: str, endpoint: str, request_type: str, error: str = "") -> None:
        """Count one finished request; `error`: its error_type ("" for success)."""
        key = (model, endpoint, request_type, error)
        self._requests[key] = self._requests.get(key, 0) + 1
        if error == "cancelled":
            self.disconnected_clients += 1

    def requests(
        self, endpoint: str, *, model: str = "", request_type: str = "", error: str | None = None
    ) -> int:
        """Finished requests to `endpoint`, of `model` and `request_type` (empty: any), with
        error_type `error` (None: any) (tests, dashboards)."""
        return sum(
            n
            for (m, e, t, err), n in self._requests.items()
            if e == endpoint
            and (not model or m == model)
            and (not request_type or t == request_type)
            and (error is None or err == error)
        )

    def render(self) -> bytes:
        """Prometheus text exposition of this process's metrics."""
        return render(self.registry) + render(self.shared)

    def render_own(self) -> bytes:
        """The exposition of `registry` alone (what a gateway process adds to the others')."""
        return render(self.registry)

    async def exposition(self) -> bytes:
        """What `GET /metrics` serves: `render()`, or with peer processes, every process's own
        metrics summed (and how many answered: `gateway_processes`) and the shared ones."""
        if self.peers is None:
            return self.render()
        texts = [self.render_own(), *await self.peers()]
        answered = GaugeMetricFamily(
            PREFIX + "gateway_processes",
            "Gateway processes (--gateway-processes) whose metrics this exposition sums.",
        )
        answered.add_metric([], len(texts))
        return sum_expositions(texts, [answered]) + render(self.shared)

    def collect(self) -> Iterator[Metric]:
        """Metric families for the collector."""
        requests = CounterMetricFamily(
            PREFIX + "requests",
            "Finished LLM requests.",
            labels=["model", "endpoint", "request_type", "status", "error_type"],
        )
        for (model, endpoint, rtype, error), n in sorted(self._requests.items()):
            status = "error" if error else "success"
            requests.add_metric([model, endpoint, rtype, status, error], n)
        yield requests
        started = CounterMetricFamily(
            PREFIX + "requests_started",
            "LLM requests accepted for processing.",
            labels=["model", "endpoint", "request_type"],
        )
        for key, n in sorted(self._started.items()):
            started.add_metric(list(key), n)
        yield started
        disconnected = GaugeMetricFamily(
            PREFIX + "disconnected_clients",
            "Clients that went away before their response ended.",
        )
        disconnected.add_metric([], self.disconnected_clients)
        yield disconnected
        models = sorted(self._models.items())
        for suffix, doc, attr in (
            ("inflight_requests", "Generation requests in progress.", "inflight"),
            ("queued_requests", "Generation requests waiting for their first token.", "queued"),
        ):
            gauge = GaugeMetricFamily(PREFIX + suffix, doc, labels=["model"])
            for name, m in models:
                gauge.add_metric([name], getattr(m, attr))
            yield gauge
        output = CounterMetricFamily(
            PREFIX + "output_tokens", "Tokens generated.", labels=["model"]
        )
        for name, m in models:
            output.add_metric([name], m.output_tokens)
        yield output
        specs = (
            ("time_to_first_token_seconds", "Time to first token.", "ttft"),
            ("inter_token_latency_seconds", "Time between consecutive tokens.", "itl"),
            ("request_itl_seconds", "Mean time between the tokens of a sequence.", "request_itl"),
            ("request_duration_seconds", "Time from arrival to the last token.", "duration"),
            ("input_sequence_tokens", "Prompt tokens per sequence.", "isl"),
            ("output_sequence_tokens", "Generated tokens per sequence.", "osl"),
            ("cached_tokens", "Prompt tokens per sequence found in a prefix cache.", "cached"),
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
