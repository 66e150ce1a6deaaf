"""The live planner loop (`kvmesh planner`, `kvmesh up --planner`): every interval it scrapes the
gateway's /metrics and decides; between intervals its surge checks grow a pool the load already
outgrew. A real MetricsScraper reads a Prometheus exposition served over HTTP; the connector
records what it is asked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.main import PlannerLoop
from kvmesh.planner.metrics import FRONTEND_METRICS, MetricsScraper
from kvmesh.planner.policy import PoolState
from kvmesh.planner.predictors import PredictorKind
from kvmesh.planner.profile import DecodeGrid, PerfProfile, PrefillCurve, RoleProfile
from kvmesh.runtime.types import Role

pytestmark = pytest.mark.unit

AGG = Role.AGGREGATED
CONC = [1.0, 16.0, 64.0, 256.0]
PROFILE = PerfProfile(
    "test", "m", "hand-made",
    {AGG: RoleProfile(
        PrefillCurve([100.0, 10000.0], [12.0, 210.0], [4e4, 4e4]),
        DecodeGrid([512.0, 8192.0], CONC, [[5.0 + 0.05 * c for c in CONC]] * 2,
                   [[c / (5.0 + 0.05 * c) * 1e3 for c in CONC]] * 2),
    )},
)  # fmt: skip


class Gateway:
    """The frontend's planner-facing metrics, as it exports them (same names)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        names = FRONTEND_METRICS
        self.prompt = Histogram(names.prompt_tokens, "", buckets=[512, 2048, 8192],
                                registry=self.registry)  # fmt: skip
        self.inflight = Gauge(names.inflight, "", registry=self.registry)

    def arrive(self, n: int) -> None:
        for _ in range(n):
            self.prompt.observe(1000)

    async def serve(self) -> tuple[web.AppRunner, str]:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner, f"http://127.0.0.1:{port}/metrics"


class Recorder:
    """A connector over one aggregated pool whose workers are ready at once."""

    def __init__(self) -> None:
        self.target = 1
        self.calls: list[tuple[float, int, str]] = []

    async def pools(self) -> dict[Role, PoolState]:
        return {AGG: PoolState(AGG, target=self.target, ready=self.target)}

    async def scale(self, targets: Mapping[Role, int], reason: str = "") -> None:
        self.target = targets[AGG]
        self.calls.append((time.monotonic(), self.target, reason))

    async def close(self) -> None:
        pass


async def _run(surge_check_s: float) -> tuple[list[tuple[float, int, str]], float]:
    """A load that jumps just after an interval: when (after the jump) the pool grew."""
    gateway = Gateway()
    runner, url = await gateway.serve()
    config = PlannerConfig(ttft_slo_ms=200.0, itl_slo_ms=20.0, adjustment_interval_s=1.0,
                           worker_startup_s=0.0, predictor=PredictorKind.CONSTANT,
                           surge_check_s=surge_check_s, max_workers=50)  # fmt: skip
    connector = Recorder()
    loop = PlannerLoop(config, PlannerPolicy.SLA, MetricsScraper(frontend_urls=[url]), connector,
                       PROFILE)  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        while len(loop.decisions) < 1:  # two scrapes: the first decision (1 worker)
            gateway.arrive(2)
            await asyncio.sleep(0.05)
        jump = time.monotonic()
        gateway.arrive(3000)  # a burst: thousands of requests/s
        await asyncio.sleep(1.4)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await loop.close()
        await runner.cleanup()
    return [c for c in connector.calls if c[0] > jump], jump


async def test_surge_checks_grow_the_pool_between_intervals() -> None:
    calls, jump = await _run(0.2)
    assert calls, "the surge check did not grow the pool"
    at, target, reason = calls[0]
    assert target > 1 and "sla surge" in reason
    assert at - jump < 0.7  # within a few checks, before the next interval
    without, jump = await _run(0.0)
    # without surge checks only the next interval's decision (about 1 s later) reacts
    assert without and without[0][0] - jump > 0.7
