"""`kvmesh planner`: the SLA planner as a process.

Every `--adjustment-interval-s` it reads the gateways' metrics (kvmesh.planner.metrics), asks
its connector how the pools are (kvmesh.planner.connectors), lets the planner decide
(kvmesh.planner.policy.Planner: the same code `kvmesh replay --planner` runs in virtual time)
and calls `scale` for each pool whose target changes. A failed scrape or scale is logged and
the next interval tries again (a Scale refused with ABORTED, because the previous one is still
being applied, is simply retried). `kvmesh up --planner` runs the same loop (`PlannerLoop`)
against its own supervisor.

Between intervals, every `--surge-check-s` (sla), the loop scrapes again and lets the planner's
surge check (`Planner.surge`, over the window since the last scrape) grow a pool the load
already outgrew; a surge never shrinks a pool.

Connectors (`--connector`): `grpc` (a ScalingService: `--scaling-address`, e.g. `kvmesh up`'s
control port), `kubernetes` (kvmesh.planner.kubernetes: the worker Deployments' scale
subresource), `virtual` (kvmesh.planner.virtual: decisions published for an external system).

`--http-port` serves `/health` (200 while the last interval's step succeeded within three
intervals, else 503) and `/metrics` (Prometheus): `kvmesh_planner_target_replicas{pool}`,
`kvmesh_planner_predicted_requests_per_second`, `kvmesh_planner_worker_capacity_requests_per_second
{pool}`, `kvmesh_planner_steps_total{result}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.connectors import Connector, GrpcConnector
from kvmesh.planner.kubernetes import KubernetesConfig, KubernetesConnector
from kvmesh.planner.metrics import MetricsScraper, Snapshot, observation
from kvmesh.planner.policy import Decision, Observation, Planner, PoolState
from kvmesh.planner.profile import PerfProfile
from kvmesh.planner.virtual import VirtualConfig, VirtualConnector
from kvmesh.runtime.config import Flags, from_args, opt
from kvmesh.runtime.errors import InvalidRequest, KvmeshError
from kvmesh.runtime.grpcutil import MeshSecurity
from kvmesh.runtime.process import Entry, run, wait_for_signal
from kvmesh.runtime.telemetry import Span, TracingConfig, setup_tracing, shutdown_tracing, tracer
from kvmesh.runtime.tls import TlsConfig
from kvmesh.runtime.types import Role

__all__ = ["ENTRY", "ConnectorKind", "PlannerLoop", "PlannerProcessConfig"]

log = logging.getLogger(__name__)


class ConnectorKind(enum.Enum):
    """What the planner scales through."""

    GRPC = "grpc"
    KUBERNETES = "kubernetes"
    VIRTUAL = "virtual"


@dataclass
class PlannerProcessConfig:
    """Where `kvmesh planner` reads metrics and sends its decisions."""

    policy: PlannerPolicy = opt(
        PlannerPolicy.SLA, "sla (profile + predicted load) or queue (reactive baseline)"
    )
    frontend_metrics: list[str] = opt([], "the gateways' /metrics URLs (summed)")
    prometheus_url: str = opt(
        "", "a Prometheus server that scrapes the gateways (read through its /federate)"
    )
    model: str = opt("", "only this served model's metrics count; empty: every model")
    connector: ConnectorKind = opt(ConnectorKind.GRPC, "grpc, kubernetes or virtual")
    scaling_address: str = opt(
        "", "grpc: host:port of a ScalingService (kvmesh up prints its control port)"
    )
    http_host: str = opt("127.0.0.1", "address of the /health and /metrics server")
    http_port: int = opt(8002, "port of /health and /metrics; 0 picks a free one, -1: none")


class PlannerLoop:
    """Observe, decide, scale, once per interval, until stopped."""

    def __init__(
        self,
        config: PlannerConfig,
        policy: PlannerPolicy,
        scraper: MetricsScraper,
        connector: Connector,
        profile: PerfProfile | None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.scraper = scraper
        self.connector = connector
        self.profile = profile
        self.planner: Planner | None = None
        self.decisions: list[Decision] = []
        """Every decision so far (newest last)."""
        self.last_ok = -math.inf
        """Monotonic time of the last step that succeeded."""
        self.steps = {"ok": 0, "error": 0}

    async def step(self, previous: Snapshot | None) -> Snapshot:
        """One interval: scrape, decide, scale (one `plan` span when tracing is on). Returns the
        snapshot to compare with next."""
        span = tracer().start("plan", None, attributes={"kvmesh.planner.policy": self.policy.value})
        try:
            return await self._step(previous, span)
        except KvmeshError as exc:
            span.error(type(exc).__name__, str(exc))
            raise
        finally:
            span.end()

    async def _step(self, previous: Snapshot | None, span: Span) -> Snapshot:
        snap = await self.scraper.scrape()
        pools = await self.connector.pools()
        if self.planner is None:
            self.planner = Planner(self.config, self.policy, sorted(pools, key=str), self.profile)
        if previous is None:
            return snap
        obs = self._observation(previous, snap)
        decision = self.planner.decide(time.monotonic(), obs, pools)
        self.decisions.append(decision)
        await self._scale(decision, pools, span)
        return snap

    async def surge_step(self, previous: Snapshot) -> Snapshot:
        """One surge check between intervals: scrape, and grow the pools the load already
        outgrew (kvmesh.planner.policy.Planner.surge). Returns the snapshot to compare with
        next."""
        snap = await self.scraper.scrape()
        if self.planner is None:
            return snap
        pools = await self.connector.pools()
        obs = self._observation(previous, snap)
        decision = self.planner.surge(time.monotonic(), obs, pools)
        if decision.changes(pools):
            if self.decisions:  # the target gauges follow the surge
                self.decisions[-1].targets.update(decision.targets)
            span = tracer().start("plan", None, attributes={"kvmesh.planner.surge": True})
            try:
                await self._scale(decision, pools, span)
            finally:
                span.end()
        return snap

    def _observation(self, previous: Snapshot, snap: Snapshot) -> Observation:
        cfg = self.config
        return observation(
            previous, snap, self.scraper.names, cfg.ttft_quantile, cfg.itl_quantile,
            (cfg.ttft_slo_ms, cfg.itl_slo_ms),
        )  # fmt: skip

    async def _scale(self, decision: Decision, pools: Mapping[Role, PoolState], span: Span) -> None:
        """Log and apply the pools `decision` changes (their sizes and why, on `span`)."""
        changes = decision.changes(pools)
        if not changes:
            return
        for role, replicas in changes.items():
            log.info(
                "planner: %s pool %d -> %d (%s)",
                role.value,
                pools[role].target,
                replicas,
                decision.reasons.get(role, ""),
            )
            span.set(f"kvmesh.planner.{role.value}.replicas", replicas)
        reason = "; ".join(decision.reasons.get(r, "") for r in changes)
        span.set("kvmesh.planner.reason", reason)
        await self.connector.scale(changes, f"planner: {reason}"[:500])

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set."""
        previous: Snapshot | None = None
        interval = self.config.adjustment_interval_s
        check = self.config.surge_check_s if self.policy is PlannerPolicy.SLA else 0.0
        while not stop.is_set():
            deadline = time.monotonic() + interval
            try:
                previous = await self.step(previous)
                self.steps["ok"] += 1
                self.last_ok = time.monotonic()
            except KvmeshError as exc:
                self.steps["error"] += 1
                log.warning(
                    "planner: %s (%s); trying again next interval",
                    exc.message,
                    type(exc).__name__,
                )
            window = previous
            while check > 0 and window is not None and deadline - time.monotonic() > check:
                if await _stopped(stop, check):
                    return
                try:
                    window = await self.surge_step(window)
                except KvmeshError as exc:
                    log.warning("planner: surge check: %s (%s)", exc.message, type(exc).__name__)
            if await _stopped(stop, max(0.0, deadline - time.monotonic())):
                return

    async def close(self) -> None:
        await self.scraper.close()
        await self.connector.close()

    def healthy(self) -> bool:
        """Whether a step succeeded within the last three intervals."""
        return time.monotonic() - self.last_ok <= 3 * self.config.adjustment_interval_s

    def collect(self) -> Iterator[Metric]:
        """The planner's Prometheus metrics (see the module doc)."""
        target = GaugeMetricFamily(
            "kvmesh_planner_target_replicas", "Pool sizes last decided.", labels=["pool"]
        )
        capacity = GaugeMetricFamily(
            "kvmesh_planner_worker_capacity_requests_per_second",
            "Requests/s one worker serves within the targets (sla policy).",
            labels=["pool"],
        )
        predicted = GaugeMetricFamily(
            "kvmesh_planner_predicted_requests_per_second", "Request rate planned for."
        )
        if self.decisions:
            last = self.decisions[-1]
            for role, n in sorted(last.targets.items(), key=lambda kv: kv[0].value):
                target.add_metric([role.value], n)
            for role, cap in sorted(last.capacity_rps.items(), key=lambda kv: kv[0].value):
                capacity.add_metric([role.value], cap)
            predicted.add_metric([], last.predicted_rps)
        steps = CounterMetricFamily(
            "kvmesh_planner_steps", "Adjustment intervals, by outcome.", labels=["result"]
        )
        for result, n in self.steps.items():
            steps.add_metric([result], n)
        yield from (target, capacity, predicted, steps)


async def _stopped(stop: asyncio.Event, wait_s: float) -> bool:
    """Wait up to `wait_s` for `stop`; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), wait_s)
    return stop.is_set()


async def serve_status(loop: PlannerLoop, host: str, port: int) -> web.AppRunner:
    """/health and /metrics of `loop` on host:port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(loop)  # a collector: it has collect()

    async def health(request: web.Request) -> web.Response:
        ok = loop.healthy()
        return web.json_response({"status": "ok" if ok else "stale"}, status=200 if ok else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def build_connector(
    process: PlannerProcessConfig,
    k8s: KubernetesConfig,
    virtual: VirtualConfig,
    security: MeshSecurity | None = None,
) -> Connector:
    """The connector `--connector` names (`security`: the mesh TLS/token of the gRPC one)."""
    if process.connector is ConnectorKind.GRPC:
        if not process.scaling_address:
            raise InvalidRequest("--connector grpc needs --scaling-address HOST:PORT")
        return GrpcConnector(process.scaling_address, process.model, security=security)
    if process.connector is ConnectorKind.KUBERNETES:
        return KubernetesConnector(k8s)
    return VirtualConnector(virtual)


async def serve_planner(
    process: PlannerProcessConfig,
    config: PlannerConfig,
    k8s: KubernetesConfig,
    virtual: VirtualConfig,
    security: MeshSecurity | None = None,
    tracing: TracingConfig | None = None,
) -> None:
    """Run `kvmesh planner` until SIGINT/SIGTERM (tracing: see kvmesh.runtime.telemetry)."""
    setup_tracing(tracing or TracingConfig(), "planner")
    try:
        await _serve_planner(process, config, k8s, virtual, security)
    finally:
        shutdown_tracing()


async def _serve_planner(
    process: PlannerProcessConfig,
    config: PlannerConfig,
    k8s: KubernetesConfig,
    virtual: VirtualConfig,
    security: MeshSecurity | None,
) -> None:
    profile = None
    if process.policy is PlannerPolicy.SLA:
        if not config.profile:
            raise InvalidRequest("--policy sla needs --profile FILE (made by kvmesh profile)")
        profile = PerfProfile.load(config.profile)
    scraper = MetricsScraper(
        frontend_urls=process.frontend_metrics,
        prometheus_url=process.prometheus_url,
        model=process.model,
    )
    connector = build_connector(process, k8s, virtual, security)
    loop = PlannerLoop(config, process.policy, scraper, connector, profile)
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    status = None
    if process.http_port >= 0:
        status = await serve_status(loop, process.http_host, process.http_port)
    log.info("planner: %s policy, every %g s", process.policy.value, config.adjustment_interval_s)
    try:
        await wait_for_signal()
    finally:
        stop.set()
        await task
        await loop.close()
        if status is not None:
            await status.cleanup()


def main(ns: argparse.Namespace) -> int:
    """`kvmesh planner`: plan until SIGINT/SIGTERM."""
    run(
        serve_planner(
            from_args(PlannerProcessConfig, ns),
            from_args(PlannerConfig, ns),
            from_args(KubernetesConfig, ns),
            from_args(VirtualConfig, ns),
            MeshSecurity.load(from_args(TlsConfig, ns)),  # bad certificates stop it here
            from_args(TracingConfig, ns),
        )
    )
    return 0


ENTRY = Entry(
    "planner",
    "the SLA planner: scales worker pools to meet TTFT/ITL targets",
    Flags.of(
        PlannerProcessConfig,
        PlannerConfig,
        KubernetesConfig,
        VirtualConfig,
        TlsConfig,
        TracingConfig,
    ),
    main,
)
