"""Wiring of the frontend and router processes: discovery -> worker pool -> router -> server.

main() of each process builds its object graph here, explicitly; nothing is configured at
import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.config import opt
from kvmesh.discovery import open_discovery
from kvmesh.grpcutil import GrpcServer
from kvmesh.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.router.kv_router import KvRouter, KvRouterConfig
from kvmesh.router.mesh import DisaggConfig, MeshBackend
from kvmesh.router.metrics import DisaggCollector, RoutingCollector
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import Router, RouterMode, RoutingStats, SimpleRouter
from kvmesh.router.service import ROUTER_SERVICE, RemoteRouter, RouterServicer
from kvmesh.workers.engine import ModelInfo

if TYPE_CHECKING:
    from kvmesh.frontend.config import FrontendConfig

log = logging.getLogger(__name__)


@dataclass
class MeshConfig(DisaggConfig):
    """How a frontend or router finds workers and routes to them (with the conditional
    disaggregation thresholds of DisaggConfig)."""

    discovery: str = opt("", "discovery URL: file:///dir, static://h:p,h:p or etcd://h:p")
    router_mode: RouterMode = opt(
        RouterMode.KV,
        "routing policy of the in-process router; kv: KV-cache-aware (approximate for engines "
        "without KV events)",
    )
    router_address: str = opt("", "use a standalone `kvmesh router` at host:port instead")
    router_overlap_weight: float = opt(
        1.0, "kv: weight of blocks still to prefill against blocks decoding in the cost"
    )
    router_temperature: float = opt(
        0.0, "kv: 0 picks the lowest cost (ties at random); > 0 samples softmax(-cost/T)"
    )
    router_busy_kv_fraction: float = opt(
        0.0, "kv: skip workers whose KV usage reaches this fraction (0 disables)"
    )
    router_busy_waiting: int = opt(
        0, "kv: skip workers with at least this many queued requests (0 disables)"
    )
    router_approx_ttl_s: float = opt(
        120.0, "kv, engines without KV events: seconds a routed prompt counts as cached"
    )
    router_seed: int = opt(0, "seed of the router's tie-breaking and sampling")
    router_peers: list[str] = opt(
        [], "kv: host:port of peer `kvmesh router` replicas to share predicted load with"
    )


@dataclass
class RouterServerConfig:
    """Settings of the standalone router process."""

    host: str = opt("127.0.0.1", "address to bind the router's gRPC server to")
    port: int = opt(0, "router gRPC port; 0 picks a free one")


def build_router(mesh: MeshConfig) -> tuple[WorkerPool, Router]:
    """The worker pool and the router a frontend or router process uses."""
    if not mesh.discovery:
        raise ValueError("--discovery is required (file:///dir, static://host:port,...)")
    pool = WorkerPool(open_discovery(mesh.discovery))
    router: Router
    if mesh.router_address:
        router = RemoteRouter(mesh.router_address, pool)
    elif mesh.router_mode is RouterMode.KV:
        config = KvRouterConfig(
            overlap_weight=mesh.router_overlap_weight,
            temperature=mesh.router_temperature,
            busy_kv_fraction=mesh.router_busy_kv_fraction,
            busy_waiting_requests=mesh.router_busy_waiting,
            approx_ttl_s=mesh.router_approx_ttl_s,
            seed=mesh.router_seed,
        )
        router = KvRouter(pool, config, peers=mesh.router_peers)
    else:
        router = SimpleRouter(pool, mesh.router_mode, seed=mesh.router_seed)
    return pool, router


async def close_router(router: Router) -> None:
    """Stop a router's background tasks (subscriptions, peer sync), if it has any."""
    close = getattr(router, "close", None)
    if close is not None:
        await close()


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_router(config: RouterServerConfig, mesh: MeshConfig) -> None:
    """Run `kvmesh router` until SIGINT/SIGTERM."""
    pool, router = build_router(mesh)
    await pool.start()
    server = GrpcServer(config.host, config.port)
    server.add(
        rpb_grpc.add_RouterServiceServicer_to_server, RouterServicer(pool, router), ROUTER_SERVICE
    )
    await server.start()
    log.info("router (%s) serving on %s", mesh.router_mode.value, server.address)
    await wait_for_signal()
    await server.set_serving(False)
    await server.stop(2.0)
    await close_router(router)
    await pool.stop()


async def serve_frontend(config: FrontendConfig, mesh: MeshConfig) -> None:
    """Run `kvmesh frontend` until SIGINT/SIGTERM, then drain and stop."""
    from kvmesh.frontend.app import build_app, serve_http
    from kvmesh.frontend.kserve_grpc import serve_kserve_grpc
    from kvmesh.frontend.service import OpenAIService
    from kvmesh.frontend.tokenizer import Tokenizer

    tokenizers: dict[str, Tokenizer] = {}
    configured: dict[str, ModelInfo] = {}
    if config.model:
        # Preload the configured model; other models' tokenizers load from worker cards.
        info = ModelDirInfo.load(resolve_model_dir(config.model))
        name = config.served_model_name or info.name
        tokenizers[name] = Tokenizer.from_pretrained(
            info.path, chunk_cache_entries=config.tokenizer_cache_entries
        )
        configured[name] = ModelInfo(
            served_model_name=name,
            engine="",
            kv_block_size=0,
            kv_total_blocks=0,
            context_length=info.context_length,
            model_path=str(info.path),
            eos_token_ids=info.eos_token_ids,
        )
    pool, router = build_router(mesh)
    await pool.start()
    backend = MeshBackend(pool, router, configured, disagg=mesh)
    service = OpenAIService(backend, tokenizers, config)
    stats = getattr(router, "stats", None)
    if isinstance(stats, RoutingStats):
        service.metrics.registry.register(RoutingCollector(stats))
    service.metrics.registry.register(DisaggCollector(backend.stats))
    runner, port = await serve_http(build_app(service, config), config.http_host, config.http_port)
    log.info("frontend serving OpenAI API on http://%s:%d/v1", config.http_host, port)
    kserve = None
    if config.kserve_grpc_port > 0:
        kserve = await serve_kserve_grpc(service, config.http_host, config.kserve_grpc_port)
        log.info("frontend serving KServe v2 gRPC on %s", kserve.address)
    await wait_for_signal()
    service.start_drain()
    if kserve is not None:
        await kserve.set_serving(False)
    if not await service.wait_idle(config.drain_timeout_s):
        log.warning("drain timed out with %d requests in flight", service.in_flight)
    if kserve is not None:
        await kserve.stop(1.0)
    await runner.cleanup()
    await close_router(router)
    await pool.stop()
