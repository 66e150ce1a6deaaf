"""Prometheus plumbing every component shares: a cheap histogram for the request path, and the
HTTP endpoint (`/metrics`) of processes that serve no HTTP of their own (workers, the
standalone router).

Observations happen on the event loop thread, so the hot path avoids prometheus_client's locked
metric objects: counters and histograms are plain Python numbers (bisect into fixed buckets),
exposed through custom collectors at scrape time. Scrapes run on the event loop too, so no
locking is needed; do not observe from other threads.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from aiohttp import web

__all__ = [
    "CONTENT_TYPE",
    "METRICS_PORT_HELP",
    "Histogram",
    "MetricsServer",
    "render",
    "sum_expositions",
]

METRICS_PORT_HELP = (
    "port of the Prometheus endpoint (GET /metrics, on the same host as the gRPC server); "
    "0 picks a free one, -1: none"
)
"""Help of the `--metrics-port` flag of every process that serves metrics on a port of its own."""

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content-Type of `render()`."""


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
            out.append((repr(float(bound)), float(running)))
        running += self.counts[-1]
        out.append(("+Inf", float(running)))
        return out


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of `registry`."""
    return bytes(generate_latest(registry))


_SampleKey = tuple[str, tuple[tuple[str, str], ...]]
"""A sample's name and its sorted labels."""


def sum_expositions(texts: Iterable[bytes], extra: Iterable[Metric] = ()) -> bytes:
    """One text exposition of several processes' `texts`: each sample (name and labels) the sum
    of its values in all of them, as Prometheus' `sum without (instance)` would give: counters,
    histogram buckets and gauges of what each process holds (requests in flight) add up. Help
    and type from the first text with the family; `extra` families are appended as they are.
    Only for samples that mean "this process's share": a gauge that every process sees whole
    (the workers it routes to) must not go through here."""
    families: dict[str, tuple[str, str]] = {}
    """name -> (help, type)"""
    sums: dict[str, dict[_SampleKey, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in families:
                families[family.name] = (family.documentation, family.type)
                sums[family.name] = {}
            values = sums[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                values[key] = values.get(key, 0.0) + sample.value

    class _Summed:
        def collect(self) -> Iterator[Metric]:
            for name, (documentation, kind) in families.items():
                family = Metric(name, documentation, kind)
                # A series' samples together (a histogram's buckets, _sum and _count), in the
                # order the first text that had it gave them.
                series: dict[tuple[tuple[str, str], ...], list[_SampleKey]] = {}
                for key in sums[name]:
                    base = tuple(kv for kv in key[1] if kv[0] != "le")
                    series.setdefault(base, []).append(key)
                for keys in series.values():
                    for key in keys:
                        family.add_sample(key[0], dict(key[1]), sums[name][key])
                yield family
            yield from extra

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Summed())
    return render(registry)


class MetricsServer:
    """`GET /metrics` (the registry's text exposition) on its own port, on the running loop.

    `port` 0 picks a free one (`port` tells which once started)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(
            status=200, body=render(self.registry), headers={"Content-Type": CONTENT_TYPE}
        )

    async def start(self) -> None:
        from aiohttp import web  # only processes that serve metrics load aiohttp

        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if runner.addresses:
            self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
