"""Prometheus export of a router's RoutingStats and of the gateway's disaggregation counters
(registered by the process that owns them: the frontend on its /metrics, a standalone
`kvmesh router` on its --metrics-port).

Routing (label `policy`: kv, round-robin, random, least-loaded):
`kvmesh_router_overhead_seconds` (histogram: tokens in hand to worker chosen),
`kvmesh_router_decisions_total`, `kvmesh_router_overlap_blocks_total` (prompt blocks the chosen
worker already held: predicted prefix-cache hits) and `kvmesh_router_prompt_blocks_total`, whose
ratio is the predicted KV hit rate.
Disaggregation: `kvmesh_remote_prefill_total`, `kvmesh_local_prefill_total{reason}`,
`kvmesh_kv_transfer_bytes_total`.
Faults: `kvmesh_migrations_total{reason}` (requests resumed on another worker),
`kvmesh_stream_pauses_total` (generation paused for a client that stopped reading).
Peers (a KV router sharing bookings): `kvmesh_router_peers{state}` (followed, connected) and
`kvmesh_router_peer_bookings`.
Pool: `kvmesh_router_workers{model,role}`: live workers this process routes to (joined: its
model card read), and how many of them are marked down after failing to answer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvmesh.router.backend import DisaggStats, LocalPrefill, MigrationReason
from kvmesh.router.kv_subscriber import PeerLoadSync
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import Router, RoutingStats

PREFIX = "kvmesh_router_"


class RoutingCollector:
    """Collector for one RoutingStats: routing overhead and predicted prefix hits."""

    def __init__(self, stats: RoutingStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        labels = ["policy"]
        policy = [s.policy]
        overhead = HistogramMetricFamily(
            PREFIX + "overhead_seconds",
            "Time from tokens in hand to worker chosen (hashing, index lookup, cost).",
            labels=labels,
        )
        overhead.add_metric(policy, [(_le(b), n) for b, n in s.buckets()], s.total_s)
        yield overhead
        decisions = CounterMetricFamily(
            PREFIX + "decisions", "Routing decisions made.", labels=labels
        )
        decisions.add_metric(policy, s.decisions)
        yield decisions
        overlap = CounterMetricFamily(
            PREFIX + "overlap_blocks",
            "Prompt blocks the chosen worker already held (predicted prefix-cache hits).",
            labels=labels,
        )
        overlap.add_metric(policy, s.overlap_blocks)
        yield overlap
        prompt = CounterMetricFamily(
            PREFIX + "prompt_blocks", "Full prompt blocks routed.", labels=labels
        )
        prompt.add_metric(policy, s.prompt_blocks)
        yield prompt


class PeerCollector:
    """Collector for a KV router's peer replicas (PeerLoadSync)."""

    def __init__(self, sync: PeerLoadSync) -> None:
        self._sync = sync

    def collect(self) -> Iterator[Metric]:
        sync = self._sync
        peers = GaugeMetricFamily(
            PREFIX + "peers",
            "Peer router replicas this router follows (state followed), and those whose booking "
            "stream is open now (connected).",
            labels=["state"],
        )
        peers.add_metric(["followed"], len(sync.following))
        peers.add_metric(["connected"], len(sync.connected))
        yield peers
        bookings = GaugeMetricFamily(
            PREFIX + "peer_bookings", "Predicted-load bookings of peer replicas held now."
        )
        bookings.add_metric([], sync.bookings())
        yield bookings


def register_router_metrics(registry: CollectorRegistry, router: Router) -> None:
    """Export `router`'s RoutingStats in `registry`, and its peer replicas if it has any
    (routers that keep no stats, such as the client of a standalone router, export nothing
    here: that router exports its own)."""
    stats = getattr(router, "stats", None)
    if isinstance(stats, RoutingStats):
        registry.register(RoutingCollector(stats))
    sync = getattr(router, "peer_sync", None)
    if isinstance(sync, PeerLoadSync):
        registry.register(PeerCollector(sync))


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


class PoolCollector:
    """Collector for a WorkerPool: the workers this process routes to, by model and role (what
    an operator checks first when requests prefill locally or get 503s)."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        live: Counter[tuple[str, str]] = Counter()
        down: Counter[tuple[str, str]] = Counter()
        for w in self._pool.workers():
            key = (w.info.served_model_name, w.info.role.value)
            live[key] += 1
            if w.down_until > now:
                down[key] += 1
        labels = ["model", "role"]
        workers = GaugeMetricFamily(
            PREFIX + "workers", "Live workers this process routes to.", labels=labels
        )
        marked = GaugeMetricFamily(
            PREFIX + "workers_down",
            "Live workers avoided for now: they failed to answer.",
            labels=labels,
        )
        for key in sorted(live):
            workers.add_metric(list(key), live[key])
            marked.add_metric(list(key), down[key])
        yield workers
        yield marked


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
