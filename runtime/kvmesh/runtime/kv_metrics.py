"""Prometheus export of workers' per-tier KV cache counters (LoadInfo.kv_tiers).

One collector serves both places the numbers are visible: a worker process exporting its own
engine's load (`KvTierCollector(lambda: [(worker_id, engine.load())])`), and a frontend or router
exporting what each worker it routes to last reported in its load metrics stream
(KvSubscriber.loads). Every family is labelled `worker` and `tier` (`device`, `host`, `disk`):

  kvmesh_worker_kv_blocks                 gauge    cached blocks the tier holds
  kvmesh_worker_kv_capacity_blocks        gauge    blocks the tier can hold
  kvmesh_worker_kv_hit_tokens_total       counter  prompt tokens served from the tier
  kvmesh_worker_kv_offload_blocks_total   counter  blocks copied into the tier (and _bytes_)
  kvmesh_worker_kv_onboard_blocks_total   counter  blocks copied from the tier to the device
  kvmesh_worker_kv_tier_errors_total      counter  blocks the tier failed to store or return
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmesh.runtime.types import KvTierStats, LoadInfo

__all__ = ["KvTierCollector"]

PREFIX = "kvmesh_worker_kv_"

_GAUGES = (
    ("blocks", "Cached KV blocks the tier holds.", "blocks"),
    ("capacity_blocks", "KV blocks the tier can hold (0: unknown).", "capacity_blocks"),
)
_COUNTERS = (
    (
        "hit_tokens",
        "Prompt tokens served from the tier instead of computed (device: prefix-cache hits; "
        "host, disk: onboarded to the device).",
        "hit_tokens",
    ),
    (
        "offload_blocks",
        "KV blocks copied into the tier (host: from the device; disk: from the host).",
        "offload_blocks",
    ),
    ("offload_bytes", "Bytes of the KV blocks copied into the tier.", "offload_bytes"),
    ("onboard_blocks", "KV blocks copied from the tier back to the device.", "onboard_blocks"),
    ("onboard_bytes", "Bytes of the KV blocks copied from the tier back.", "onboard_bytes"),
    (
        "tier_errors",
        "KV blocks the tier failed to store or return (full or unwritable disk, corrupted "
        "block file); each was recomputed or not kept.",
        "errors",
    ),
)


class KvTierCollector:
    """Collector of the per-tier KV counters of the workers `source()` yields as (worker id,
    LoadInfo); workers reporting no tiers add nothing."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, LoadInfo]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        rows: list[tuple[str, KvTierStats]] = [
            (worker, t) for worker, load in self._source() for t in load.kv_tiers
        ]
        labels = ["worker", "tier"]
        for name, doc, attr in _GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for worker, t in rows:
                gauge.add_metric([worker, t.tier.label], getattr(t, attr))
            yield gauge
        for name, doc, attr in _COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for worker, t in rows:
                counter.add_metric([worker, t.tier.label], getattr(t, attr))
            yield counter
