"""The worker's Prometheus collector (kvmesh.workers.metrics) rendered and parsed: EngineStats'
counters under their `kvmesh_worker_` names, the KV connector's among them (what vLLM's stat
logger reports: connector prefix-cache queries and hits, bytes moved, failed transfers), and
`promtool check metrics` clean."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.runtime.metrics import render
from kvmesh.runtime.types import FinishReason, LoadInfo, ModelInfo, Role
from kvmesh.workers.metrics import EngineStats, WorkerCollector
from tests.integration.test_worker_observability import promtool_check, samples

pytestmark = pytest.mark.unit


def rendered(stats: EngineStats | None, role: Role = Role.DECODE) -> str:
    info = ModelInfo("m", "vllm", 32, 64, 1024, role=role)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector("w1", lambda: info, LoadInfo, stats))
    return render(registry).decode()


def test_kv_connector_counters_are_exported_from_engine_stats() -> None:
    stats = EngineStats()
    stats.external_prefix_query_tokens = 200
    stats.external_prefix_hit_tokens = 163
    stats.kv_transfer_bytes = 196_608
    stats.kv_transfer_failures = 2
    stats.kv_transfer.observe(0.004)
    stats.prompt_tokens = 163
    stats.finished[FinishReason.LENGTH] = 1
    text = rendered(stats)
    got = samples(text)
    labels = (("model", "m"), ("role", "decode"), ("worker_id", "w1"))
    for name, want in (
        ("kvmesh_worker_external_prefix_cache_queries_total", 200),
        ("kvmesh_worker_external_prefix_cache_hits_total", 163),
        ("kvmesh_worker_kv_transfer_bytes_total", 196_608),
        ("kvmesh_worker_kv_transfer_failures_total", 2),
        ("kvmesh_worker_kv_transfer_seconds_count", 1),
        ("kvmesh_worker_prompt_tokens_total", 163),
    ):
        assert got[(name, labels)] == want, name
    assert got[("kvmesh_worker_kv_transfer_seconds_sum", labels)] == pytest.approx(0.004)
    success = tuple(sorted((*labels, ("finished_reason", "length"))))
    assert got[("kvmesh_worker_request_success_total", success)] == 1
    promtool_check(text)


def test_a_fresh_engine_exports_zeros_and_one_without_stats_exports_load_only() -> None:
    got = samples(rendered(EngineStats(), Role.PREFILL))
    labels = (("model", "m"), ("role", "prefill"), ("worker_id", "w1"))
    for name in (
        "kvmesh_worker_external_prefix_cache_hits_total",
        "kvmesh_worker_kv_transfer_bytes_total",
        "kvmesh_worker_kv_transfer_failures_total",
    ):
        assert got[(name, labels)] == 0, name
    text = rendered(None)
    names = {name for name, _ in samples(text)}
    assert "kvmesh_worker_num_requests_running" in names
    assert not {n for n in names if "kv_transfer" in n or "external_prefix" in n}
    promtool_check(text)
