"""The pieces of `kvmesh frontend --gateway-processes`: summing the processes' metrics, the
group's flag, the split of each worker's in-flight limit, the flags' checks, and how many CPUs
`--gateway-processes 0` counts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.group import GatewayGroup
from kvmesh.frontend.metrics import FrontendMetrics
from kvmesh.router.metrics import PoolCollector
from kvmesh.router.pool import HealthConfig
from kvmesh.runtime.metrics import sum_expositions
from kvmesh.runtime.process import _cgroup_cpu_quota, usable_cpus
from kvmesh.runtime.types import ModelInfo

pytestmark = pytest.mark.unit


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_sum_expositions_adds_counters_gauges_and_buckets() -> None:
    a, b = FrontendMetrics(), FrontendMetrics()
    for m, error in ((a, ""), (a, ""), (b, ""), (b, "validation")):
        m.started("m", "chat_completions", "stream")
        m.finished("m", "chat_completions", "stream", error)
    a.model("m").ttft.observe(0.02)
    b.model("m").ttft.observe(0.2)
    b.model("other").ttft.observe(3.0)  # a series only one process has
    a.model("m").inflight, b.model("m").inflight = 2, 5
    summed = sum_expositions([a.render_own(), b.render_own()])
    got = samples(summed)
    ok = (
        ("endpoint", "chat_completions"),
        ("error_type", ""),
        ("model", "m"),
        ("request_type", "stream"),
        ("status", "success"),
    )
    assert got[("kvmesh_frontend_requests_total", ok)] == 3
    started = (("endpoint", "chat_completions"), ("model", "m"), ("request_type", "stream"))
    assert got[("kvmesh_frontend_requests_started_total", started)] == 4
    assert got[("kvmesh_frontend_inflight_requests", (("model", "m"),))] == 7
    bucket = "kvmesh_frontend_time_to_first_token_seconds_bucket"
    assert got[(bucket, (("le", "0.025"), ("model", "m")))] == 1
    assert got[(bucket, (("le", "0.25"), ("model", "m")))] == 2
    assert got[(bucket, (("le", "+Inf"), ("model", "other")))] == 1
    assert got[("kvmesh_frontend_time_to_first_token_seconds_count", (("model", "m"),))] == 2
    assert got[("kvmesh_frontend_time_to_first_token_seconds_sum", (("model", "m"),))] == (
        pytest.approx(0.22)
    )
    # Families keep their types, and each series' samples stay together in bucket order.
    families = {f.name: f for f in text_string_to_metric_families(summed.decode())}
    assert families["kvmesh_frontend_requests"].type == "counter"
    assert families["kvmesh_frontend_time_to_first_token_seconds"].type == "histogram"
    names = [
        (s.labels.get("model"), s.name)
        for s in families["kvmesh_frontend_time_to_first_token_seconds"].samples
    ]
    assert names.index(("other", bucket)) > max(
        i for i, n in enumerate(names) if n[0] == "m"
    )  # "other" after every sample of "m"


def test_exposition_sums_own_metrics_and_shows_shared_ones_once() -> None:
    a, b = FrontendMetrics(), FrontendMetrics()
    a.started("m", "completions", "unary")
    b.started("m", "completions", "unary")

    class Pool:
        def workers(self) -> list[object]:
            return []

    a.shared.register(PoolCollector(Pool()))  # type: ignore[arg-type]

    async def peers() -> list[bytes]:
        return [b.render_own()]

    a.peers = peers
    text = asyncio.run(a.exposition())
    got = samples(text)
    started = (("endpoint", "completions"), ("model", "m"), ("request_type", "unary"))
    assert got[("kvmesh_frontend_requests_started_total", started)] == 2
    assert got[("kvmesh_frontend_gateway_processes", ())] == 2
    assert text.count(b"# TYPE kvmesh_router_workers gauge") == 1
    assert b"kvmesh_router_workers" not in b.render_own()


def test_gateway_group_flag() -> None:
    group = GatewayGroup.parse("/tmp/g,dir,1,3")  # a directory may hold commas
    assert group == GatewayGroup(Path("/tmp/g,dir"), 1, 3)
    assert group is not None
    assert GatewayGroup.parse(group.encode()) == group
    assert group.metrics_socket(2) == Path("/tmp/g,dir/metrics-2.sock")
    assert GatewayGroup.parse("") is None
    for bad in ("/tmp/g,1", "/tmp/g,x,2", "/tmp/g,2,2", ",0,2", "/tmp/g,-1,2"):
        with pytest.raises(ValueError, match="DIRECTORY,INDEX,COUNT"):
            GatewayGroup.parse(bad)


def test_each_gateway_keeps_its_share_of_a_workers_inflight_limit() -> None:
    card = ModelInfo(
        served_model_name="m",
        engine="mocker",
        kv_block_size=16,
        kv_total_blocks=64,
        context_length=2048,
        max_num_seqs=255,
    )
    assert HealthConfig().inflight_limit(card) == 255
    assert HealthConfig(gateway_replicas=2).inflight_limit(card) == 128  # rounded up
    assert HealthConfig(max_inflight_per_worker=10, gateway_replicas=4).inflight_limit(card) == 3
    assert HealthConfig(max_inflight_per_worker=0, gateway_replicas=4).inflight_limit(card) == 0
    with pytest.raises(ValueError, match="gateway_replicas"):
        HealthConfig(gateway_replicas=0)


def test_frontend_flags_of_the_group_are_checked() -> None:
    with pytest.raises(ValueError, match="gateway_processes"):
        FrontendConfig(gateway_processes=-1)
    with pytest.raises(ValueError, match="router_sync_port"):
        FrontendConfig(router_sync_port=-2)
    with pytest.raises(ValueError, match="--router-sync-port"):
        FrontendConfig(gateway_processes=2, router_sync_port=9000)
    FrontendConfig(gateway_processes=0)  # one per CPU core
    FrontendConfig(router_sync_port=0)


def test_usable_cpus_follow_the_containers_cpu_limit(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_quota(v2) is None
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert _cgroup_cpu_quota(v2) == 1.5
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_quota(tmp_path / "v1") is None
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")
    assert _cgroup_cpu_quota(tmp_path / "v1") == 4.0
    assert _cgroup_cpu_quota(tmp_path / "none") is None
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)
