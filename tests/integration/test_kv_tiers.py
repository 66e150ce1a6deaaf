"""KV tiers end to end over real gRPC: mocker workers with a small device pool and a host tier
publish tier-tagged KV events and per-tier load metrics; the router's subscriber keeps the
index per tier, credits a host-tier hit (by its weight) in the cost, and exports the workers'
tier counters to Prometheus; the frontend's /metrics shows them for the workers it reaches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_scheduler import KvRouterConfig, KvScheduler
from kvmesh.router.kv_subscriber import KvSubscriber
from kvmesh.router.pool import WorkerHandle
from kvmesh.router.session import WorkerSession
from kvmesh.runtime import wire
from kvmesh.runtime.grpcutil import insecure_channel
from kvmesh.runtime.kv_events import KvTier
from kvmesh.runtime.kv_metrics import KvTierCollector
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.mocker import MockerConfig, MockerEngine
from kvmesh.workers.server import Worker

pytestmark = pytest.mark.integration

BS = 16
PROMPT = [10 + i % 700 for i in range(100)]  # 6 full blocks


def _engine(tiers: KvTierConfig | None) -> MockerEngine:
    return MockerEngine(
        MockerConfig(num_gpu_blocks=16, block_size=BS, speedup_ratio=1e4),
        served_model_name="m",
        vocab_size=1000,
        context_length=1024,
        tiers=tiers,
    )


async def _generate(stub: wpb_grpc.WorkerServiceStub, prompt: list[int]) -> cpb.Usage:
    req = wpb.GenerateRequest(
        token_ids=prompt,
        sampling=cpb.SamplingOptions(temperature=0.0),
        stop=cpb.StopConditions(max_tokens=4),
    )
    last = None
    async for msg in stub.Generate(req):
        last = msg
    assert last is not None and last.HasField("usage")
    return last.usage


@pytest.fixture
async def workers() -> AsyncIterator[list[tuple[Worker, WorkerHandle]]]:
    """Worker "tiered" (device pool of 16 blocks, host tier of 64) and "plain" (no tiers)."""
    out: list[tuple[Worker, WorkerHandle]] = []
    for wid, tiers in (("tiered", KvTierConfig(kv_host_blocks=64)), ("plain", None)):
        engine = _engine(tiers)
        worker = Worker(WorkerConfig(), engine)
        await worker.start()
        channel = insecure_channel(worker.address)
        stub = wpb_grpc.WorkerServiceStub(channel)
        handle = WorkerHandle(
            "i-" + wid,
            wid,
            worker.address,
            engine.info,
            channel,
            stub,
            WorkerSession(stub, worker.address),
        )
        out.append((worker, handle))
    yield out
    for worker, handle in out:
        await handle.channel.close()
        await worker.stop()


async def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_router_indexes_tiers_and_credits_host_hits(
    workers: list[tuple[Worker, WorkerHandle]],
) -> None:
    (_, th), (_, ph) = workers
    scheduler = KvScheduler(KvRouterConfig(host_hit_weight=0.75))
    subscriber = KvSubscriber(scheduler, load_interval_ms=20)
    try:
        subscriber.add(th)
        subscriber.add(ph)
        stub = th.stub
        await _generate(stub, PROMPT)
        for k in range(4):  # other prompts push PROMPT's blocks out of the 16-block device pool
            await _generate(stub, [800 + k * 11 + i % 150 for i in range(120)])
        hashes = block_hashes(PROMPT, BS)
        indexer = scheduler.indexer
        await _until(
            lambda: (
                not indexer.find_matches(hashes)
                and indexer.find_credits(hashes).get("tiered", 0) >= 0.75 * len(hashes)
            ),
            "the prompt to leave the device tier and show on the host tier",
        )
        stats = indexer.stats("tiered")
        assert stats.host_blocks >= len(hashes) and stats.disk_blocks == 0
        # The router credits the host copy: with both workers idle it picks "tiered" (without
        # the credit it would pick "plain", whose cache is emptier). Idle as the router sees
        # them: a load sample taken while the last request ran would weigh against "tiered".
        loads = subscriber.loads
        await _until(
            lambda: all(
                w in loads and not (loads[w].num_running or loads[w].num_waiting)
                for w in ("tiered", "plain")
            ),
            "both workers' load samples to read idle",
        )
        assert scheduler.select(PROMPT, 0.0).worker_id == "tiered"
        indexer.host_hit_weight = 0.0  # without the credit, the emptier cache wins
        assert "tiered" not in indexer.find_credits(hashes)
        assert scheduler.select(PROMPT, 0.0).worker_id == "plain"
        indexer.host_hit_weight = 0.75
        # Served from the host tier: cached tokens count the onboarded blocks.
        usage = await _generate(stub, PROMPT)
        assert usage.cached_tokens == len(hashes) * BS
        await _until(lambda: indexer.find_matches(hashes) == {"tiered": len(hashes)}, "onboard")
        # Load metrics carry the tier counters; the collector exports them.
        await _until(
            lambda: any(
                t.tier is KvTier.HOST and t.hit_tokens for t in subscriber.loads["tiered"].kv_tiers
            ),
            "host hit tokens in the load metrics",
        )
        metrics = (await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())).metrics
        host = next(t for t in wire.load_from_pb(metrics).kv_tiers if t.tier is KvTier.HOST)
        assert host.hit_tokens == len(hashes) * BS and host.onboard_blocks == len(hashes)
        assert host.offload_blocks > 0 and host.capacity_blocks == 64
        registry = CollectorRegistry(auto_describe=False)
        registry.register(KvTierCollector(lambda: list(subscriber.loads.items())))
        text = generate_latest(registry).decode()
        assert (
            f'kvmesh_worker_kv_hit_tokens_total{{tier="host",worker="tiered"}} '
            f"{float(len(hashes) * BS)}" in text
        )
        assert 'kvmesh_worker_kv_blocks{tier="device",worker="plain"}' in text
        assert 'tier="host",worker="plain"' not in text
    finally:
        await subscriber.close()
