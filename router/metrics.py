"""Prometheus export of a router's RoutingStats (registered by the process that owns it)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvmesh.router.routing import RoutingStats

PREFIX = "kvmesh_router_"


class RoutingCollector:
    """Collector for one RoutingStats: routing overhead and predicted prefix hits."""

    def __init__(self, stats: RoutingStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        overhead = HistogramMetricFamily(
            PREFIX + "overhead_seconds",
            "Time from tokens in hand to worker chosen (hashing, index lookup, cost).",
        )
        overhead.add_metric([], [(_le(b), n) for b, n in s.buckets()], s.total_s)
        yield overhead
        decisions = CounterMetricFamily(PREFIX + "decisions", "Routing decisions made.")
        decisions.add_metric([], s.decisions)
        yield decisions
        overlap = CounterMetricFamily(
            PREFIX + "overlap_blocks",
            "Prompt blocks the chosen worker already held (predicted prefix-cache hits).",
        )
        overlap.add_metric([], s.overlap_blocks)
        yield overlap
        prompt = CounterMetricFamily(PREFIX + "prompt_blocks", "Full prompt blocks routed.")
        prompt.add_metric([], s.prompt_blocks)
        yield prompt


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
