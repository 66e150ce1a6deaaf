"""What the live planner observes: the gateways' Prometheus metrics, read by name through one
adapter (`MetricNames`), turned into one `Observation` per interval.

Sources: the frontends' own `/metrics` (`--frontend-metrics URL[,URL...]`, summed), or a
Prometheus server that scrapes them (`--prometheus-url URL`: its `/federate` endpoint returns the
same text format for the series the planner names). Each scrape is a `Snapshot` (cumulative
histograms and gauges summed over every label set of the served model); the difference of
two snapshots is the interval's Observation: arrivals (prompt-length histogram count), mean
prompt and output lengths, first tokens with their mean TTFT and TTFT at a quantile (linear
inside the bucket, as Prometheus' histogram_quantile), mean ITL, the requests' own mean ITL at a
quantile (where the gateway exports that per-request histogram), and requests in flight (the
gauge, now). A counter that went down (a frontend restarted) counts from zero.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.planner.policy import Observation
from kvmesh.runtime.errors import InvalidRequest, Unavailable

__all__ = [
    "FRONTEND_METRICS",
    "HistogramValue",
    "MetricNames",
    "MetricsScraper",
    "Snapshot",
    "histogram_quantile",
    "observation",
    "parse_snapshot",
]


@dataclass(frozen=True, slots=True)
class MetricNames:
    """The gateway metrics the planner reads (a rename of the gateway's metrics is a change
    here only). Histograms are named without their _bucket/_sum/_count suffix."""

    prompt_tokens: str
    """Histogram, one observation per request: its prompt length."""
    output_tokens: str
    """Histogram, one observation per finished request: its output length."""
    ttft_seconds: str
    """Histogram of time to first token."""
    itl_seconds: str
    """Histogram of inter-token latency (one observation per gap)."""
    inflight: str
    """Gauge of requests in progress."""
    cached_tokens: str = ""
    """Histogram, one observation per finished request: its prompt tokens found in a prefix
    cache (empty: the gateway does not export it, and the planner prices every prompt token)."""
    request_itl_seconds: str = ""
    """Histogram, one observation per finished request of two tokens or more: its own mean
    ITL, (last token - first token) / (tokens - 1) (empty or absent: the planner sizes on the
    mean ITL with `--itl-headroom`)."""
    model_label: str = "model"

    @property
    def histograms(self) -> tuple[str, ...]:
        names = (self.prompt_tokens, self.output_tokens, self.ttft_seconds, self.itl_seconds)
        optional = (self.cached_tokens, self.request_itl_seconds)
        return (*names, *(n for n in optional if n))

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.histograms, self.inflight)


FRONTEND_METRICS = MetricNames(
    prompt_tokens="kvmesh_frontend_input_sequence_tokens",
    output_tokens="kvmesh_frontend_output_sequence_tokens",
    ttft_seconds="kvmesh_frontend_time_to_first_token_seconds",
    itl_seconds="kvmesh_frontend_inter_token_latency_seconds",
    inflight="kvmesh_frontend_inflight_requests",
    cached_tokens="kvmesh_frontend_cached_tokens",
    request_itl_seconds="kvmesh_frontend_request_itl_seconds",
)
"""What kvmesh's frontend exports (kvmesh.frontend.metrics); its per-request ITL histogram is
read where it exists (a frontend without it leaves the planner on the mean ITL)."""


@dataclass(slots=True)
class HistogramValue:
    """A cumulative histogram: (upper bound, cumulative count) ending with +Inf, sum, count."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def add(self, other: HistogramValue) -> None:
        """Sum another histogram with the same buckets into this one (bounds are merged)."""
        merged: dict[float, float] = dict(self.buckets)
        for le, n in other.buckets:
            merged[le] = merged.get(le, 0.0) + n
        self.buckets = sorted(merged.items())
        self.sum += other.sum
        self.count += other.count

    def minus(self, earlier: HistogramValue) -> HistogramValue:
        """The observations since `earlier` (all of these if a reset happened)."""
        if self.count < earlier.count:
            return self
        before = dict(earlier.buckets)
        return HistogramValue(
            [(le, max(0.0, n - before.get(le, 0.0))) for le, n in self.buckets],
            self.sum - earlier.sum,
            self.count - earlier.count,
        )

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear
    inside the bucket holding the rank; the highest finite bound if it falls in +Inf; NaN
    when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return lower
            if n == below:
                return le
            return lower + (le - lower) * (rank - below) / (n - below)
        lower, below = le, n
    return lower


def histogram_share(x: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The share of a histogram's observations at or under `x` (the inverse of
    `histogram_quantile`: linear inside the bucket holding `x`); NaN when empty or `x` is."""
    if not buckets or buckets[-1][1] <= 0 or math.isnan(x):
        return math.nan
    total = buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, n in buckets:
        if x <= le:
            if math.isinf(le):
                return below / total
            return (below + (n - below) * (x - lower) / (le - lower)) / total
        lower, below = le, n
    return 1.0


@dataclass(slots=True)
class Snapshot:
    """One scrape: the named histograms and gauges, summed over sources and label sets."""

    at: float
    histograms: dict[str, HistogramValue] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def parse_snapshot(
    texts: Iterable[str], names: MetricNames, model: str = "", at: float | None = None
) -> Snapshot:
    """Sum the named metrics of Prometheus text expositions (only `model`'s series when
    given). InvalidRequest when a text cannot be parsed."""
    snap = Snapshot(time.monotonic() if at is None else at)
    wanted = set(names.all)
    for text in texts:
        hists: dict[tuple[str, tuple[tuple[str, str], ...]], HistogramValue] = {}
        try:
            families = list(text_string_to_metric_families(text))
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"unreadable Prometheus metrics: {exc}") from None
        for family in families:
            if family.name not in wanted:
                continue
            for sample in family.samples:
                labels = dict(sample.labels)
                if model and labels.get(names.model_label, model) != model:
                    continue
                if family.type == "histogram":
                    le = labels.pop("le", None)
                    key = (family.name, tuple(sorted(labels.items())))
                    h = hists.setdefault(key, HistogramValue())
                    if sample.name.endswith("_bucket") and le is not None:
                        h.buckets.append((float(le), float(sample.value)))
                    elif sample.name.endswith("_sum"):
                        h.sum = float(sample.value)
                    elif sample.name.endswith("_count"):
                        h.count = float(sample.value)
                elif family.type == "gauge":
                    snap.gauges[family.name] = snap.gauges.get(family.name, 0.0) + sample.value
        for (name, _), h in hists.items():
            h.buckets.sort()
            snap.histograms.setdefault(name, HistogramValue()).add(h)
    return snap


def observation(
    earlier: Snapshot,
    now: Snapshot,
    names: MetricNames,
    quantile: float,
    itl_quantile: float,
    targets_ms: tuple[float, float] = (math.nan, math.nan),
) -> Observation:
    """The Observation of the interval between two snapshots (see the module doc): TTFT at
    `quantile`, the requests' own mean ITL at `itl_quantile`, and the shares within the
    (TTFT, ITL) `targets_ms`."""

    def delta(name: str) -> HistogramValue:
        cur = now.histograms.get(name, HistogramValue())
        return cur.minus(earlier.histograms.get(name, HistogramValue()))

    prompt = delta(names.prompt_tokens)
    output = delta(names.output_tokens)
    ttft = delta(names.ttft_seconds)
    itl = delta(names.itl_seconds)
    tail = histogram_quantile(quantile, ttft.buckets)
    cached = delta(names.cached_tokens).mean if names.cached_tokens else math.nan
    per_request = delta(names.request_itl_seconds) if names.request_itl_seconds else None
    itl_tail = itl_within = math.nan
    if per_request is not None and per_request.count > 0:
        itl_tail = histogram_quantile(itl_quantile, per_request.buckets)
        itl_within = histogram_share(targets_ms[1] / 1e3, per_request.buckets)
    return Observation(
        interval_s=max(now.at - earlier.at, 1e-9),
        requests=round(prompt.count),
        finished=round(output.count),
        isl_mean=prompt.mean,
        osl_mean=output.mean,
        cached_mean=cached,
        first_tokens=round(ttft.count),
        ttft_ms=1e3 * ttft.mean,
        ttft_tail_ms=1e3 * tail,
        itl_ms=1e3 * itl.mean,
        itl_tail_ms=1e3 * itl_tail,
        ttft_within=histogram_share(targets_ms[0] / 1e3, ttft.buckets),
        itl_within=itl_within,
        inflight=max(0, round(now.gauges.get(names.inflight, 0.0))),
    )


class MetricsScraper:
    """Reads the gateways' metrics: their /metrics URLs, or a Prometheus server's /federate."""

    def __init__(
        self,
        *,
        frontend_urls: Sequence[str] = (),
        prometheus_url: str = "",
        names: MetricNames = FRONTEND_METRICS,
        model: str = "",
        timeout_s: float = 5.0,
    ) -> None:
        if bool(frontend_urls) == bool(prometheus_url):
            raise InvalidRequest(
                "give the planner either --frontend-metrics URL[,URL...] or --prometheus-url URL"
            )
        self.names = names
        self.model = model
        if prometheus_url:
            match = '{__name__=~"' + "|".join(f"{n}(_bucket|_sum|_count)?" for n in names.all)
            query = urllib.parse.urlencode({"match[]": match + '"}'})
            self.urls = [f"{prometheus_url.rstrip('/')}/federate?{query}"]
        else:
            self.urls = list(frontend_urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def scrape(self) -> Snapshot:
        """One snapshot of every source (Unavailable when one cannot be read)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        texts: list[str] = []
        for url in self.urls:
            try:
                async with self._session.get(url) as r:
                    if r.status != 200:
                        raise Unavailable(f"metrics at {url} answered HTTP {r.status}")
                    texts.append(await r.text())
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise Unavailable(
                    f"cannot read metrics at {url}: {exc or type(exc).__name__}"
                ) from None
        return parse_snapshot(texts, self.names, self.model)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
