"""`kvmesh router`: the router as a standalone gRPC service (RouterService).

Its flags are RouterServerConfig's and MeshConfig's but `--router-address` (`ENTRY`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.metrics import PoolCollector, register_router_metrics
from kvmesh.router.service import ROUTER_SERVICE, RouterServicer, serve_when_routable
from kvmesh.router.stack import MeshConfig, build_router, close_router
from kvmesh.runtime.config import Flags, from_args, opt
from kvmesh.runtime.discovery import Registration
from kvmesh.runtime.grpcutil import MeshSecurity, mesh_server
from kvmesh.runtime.metrics import METRICS_PORT_HELP, MetricsServer
from kvmesh.runtime.process import Entry, freeze_heap, run, wait_for_signal
from kvmesh.runtime.telemetry import TracingConfig, setup_tracing, shutdown_tracing
from kvmesh.runtime.tls import TlsConfig

log = logging.getLogger(__name__)


@dataclass
class RouterServerConfig:
    """Settings of the standalone router process."""

    host: str = opt("127.0.0.1", "address to bind the router's gRPC server to")
    advertise_host: str = opt(
        "",
        "host other routers use to reach this one, registered in --discovery for their "
        "--router-peers-discovery (kv); empty: --host (127.0.0.1 for a wildcard)",
    )
    port: int = opt(0, "router gRPC port; 0 picks a free one")
    metrics_port: int = opt(-1, METRICS_PORT_HELP)


async def serve_router(
    config: RouterServerConfig,
    mesh: MeshConfig,
    security: MeshSecurity | None = None,
    tracing: TracingConfig | None = None,
) -> None:
    """Run `kvmesh router` until SIGINT/SIGTERM."""
    setup_tracing(tracing or TracingConfig(), "router")
    pool, router = build_router(mesh, security)
    await pool.start()
    server = mesh_server(config.host, config.port, security)
    server.add(
        rpb_grpc.add_RouterServiceServicer_to_server,
        RouterServicer(pool, router, mesh),
        ROUTER_SERVICE,
    )
    metrics: MetricsServer | None = None
    if config.metrics_port >= 0:
        registry = CollectorRegistry(auto_describe=False)
        register_router_metrics(registry, router)
        registry.register(PoolCollector(pool))
        metrics = MetricsServer(registry, config.host, config.metrics_port)
    routable: asyncio.Task[None] | None = None
    registration: Registration | None = None
    try:
        await server.start()
        if isinstance(router, KvRouter):
            advertised = server.address
            if config.advertise_host:
                advertised = f"{config.advertise_host}:{server.port}"
            registration = router.register(advertised)
        routable = asyncio.create_task(serve_when_routable(server, pool), name="routable")
        if metrics is not None:
            await metrics.start()
        log.info(
            "router (%s) serving on %s%s",
            mesh.router_mode.value,
            server.address,
            f", metrics on :{metrics.port}/metrics" if metrics is not None else "",
        )
        freeze_heap()
        await wait_for_signal()
        if registration is not None:
            await registration.close()
            registration = None
        await server.set_serving(False)
        await server.stop(2.0)
    finally:
        if registration is not None:
            await registration.close()
        if routable is not None:
            routable.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await routable
        if metrics is not None:
            await metrics.stop()
        await close_router(router)
        await pool.stop()
        shutdown_tracing()


def main(ns: argparse.Namespace) -> int:
    """`kvmesh router`: serve until SIGINT/SIGTERM."""
    security = MeshSecurity.load(from_args(TlsConfig, ns))  # bad certificates stop it here
    run(
        serve_router(
            from_args(RouterServerConfig, ns),
            from_args(MeshConfig, ns),
            security,
            from_args(TracingConfig, ns),
        )
    )
    return 0


ENTRY = Entry(
    "router",
    "the router as a standalone gRPC service (RouterService)",
    # A router routes itself: it cannot delegate to another one.
    Flags.of(RouterServerConfig, MeshConfig, TlsConfig, TracingConfig, skip={"router_address"}),
    main,
)
