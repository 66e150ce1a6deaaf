"""Prometheus export of a router's RoutingStats and of the gateway's disaggregation counters
(registered by the process that owns them)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvmesh.router.backend import DisaggStats, LocalPrefill, MigrationReason
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


class DisaggCollector:
    """Collector for a MeshBackend's DisaggStats: which path requests of disaggregated pools
    took, and how many KV bytes moved."""

    def __init__(self, stats: DisaggStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        remote = CounterMetricFamily(
            "kvmesh_remote_prefill",
            "Requests prefilled on a prefill worker (PrefillRemote) and continued on a decode "
            "worker that pulled their KV.",
        )
        remote.add_metric([], s.remote_prefills)
        yield remote
        local = CounterMetricFamily(
            "kvmesh_local_prefill",
            "Requests of disaggregated pools prefilled on their decode worker instead, by reason "
            "(short_prompt, no_prefill_worker, prefill_saturated: conditional disaggregation; "
            "prefill_failed, transfer_failed: fallbacks).",
            labels=["reason"],
        )
        for reason in LocalPrefill:
            local.add_metric([reason.value], s.local_prefills[reason])
        yield local
        moved = CounterMetricFamily(
            "kvmesh_kv_transfer_bytes",
            "Prompt KV bytes decode workers pulled from prefill workers.",
        )
        moved.add_metric([], s.kv_transfer_bytes)
        yield moved
        migrations = CounterMetricFamily(
            "kvmesh_migrations",
            "Requests moved to another worker before they finished, by reason (stream_lost: "
            "the worker died or was cut off; unresponsive: health checks ejected it; "
            "worker_cancelled: it cancelled the request, e.g. a drain timed out; "
            "worker_unavailable: it refused the request before producing anything).",
            labels=["reason"],
        )
        for why in MigrationReason:
            migrations.add_metric([why.value], s.migrations[why])
        yield migrations
        pauses = CounterMetricFamily(
            "kvmesh_stream_pauses",
            "Times a worker stopped generating for a client that did not read its stream (the "
            "request resumes where it stopped when the client reads again).",
        )
        pauses.add_metric([], s.pauses)
        yield pauses


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
