"""`kvmesh frontend`: the OpenAI and KServe v2 gateway process.

Its flags are FrontendConfig's, MeshConfig's and TlsConfig's (`ENTRY`): the gateway's own
certificate, API keys and limits, its mesh links, and their mTLS. Builds the object graph explicitly
(tokenizers, the routing stack of kvmesh.router.stack, the OpenAIService both doors share, the
HTTP and KServe gRPC servers), serves until SIGINT/SIGTERM, then drains.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.frontend.config import FrontendConfig
from kvmesh.router.backend import MeshBackend
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.metrics import DisaggCollector, PoolCollector, register_router_metrics
from kvmesh.router.service import ROUTER_SERVICE, RouterServicer
from kvmesh.router.stack import MeshConfig, build_router, close_router
from kvmesh.runtime.config import ConfigError, Flags, from_args
from kvmesh.runtime.grpcutil import MeshSecurity, mesh_server
from kvmesh.runtime.kv_metrics import KvTierCollector
from kvmesh.runtime.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.runtime.process import (
    Entry,
    GlobalConfig,
    freeze_heap,
    run,
    usable_cpus,
    wait_for_signal,
)
from kvmesh.runtime.telemetry import TracingConfig, setup_tracing, shutdown_tracing
from kvmesh.runtime.tls import ReloadingTls, ServerSslContext, TlsConfig, TlsError, TlsFiles
from kvmesh.runtime.types import ModelInfo

if TYPE_CHECKING:
    from kvmesh.frontend.service import OpenAIService

log = logging.getLogger(__name__)


def gateway_tls(config: FrontendConfig) -> ReloadingTls | None:
    """The gateway's certificate (--http-tls-cert/--http-tls-key), read and checked now, or
    None for plaintext."""
    if not config.http_tls_cert and not config.http_tls_key:
        return None
    if not (config.http_tls_cert and config.http_tls_key):
        raise TlsError("gateway TLS needs both --http-tls-cert and --http-tls-key")
    files = TlsFiles(
        Path(config.http_tls_cert),
        Path(config.http_tls_key),
        flags=("--http-tls-cert", "--http-tls-key", ""),
    )
    return ReloadingTls(files)


async def serve_frontend(
    config: FrontendConfig,
    mesh: MeshConfig,
    security: MeshSecurity | None = None,
    tracing: TracingConfig | None = None,
    log_content: bool = False,
) -> bool:
    """Run `kvmesh frontend` until SIGINT/SIGTERM, then drain and stop (a second signal, or
    `drain_timeout_s`, ends the streams still open with an error event); whether every request
    finished (tracing: see kvmesh.runtime.telemetry; `log_content`: log prompts and outputs)."""
    setup_tracing(tracing or TracingConfig(), "frontend")
    try:
        return await _serve(config, mesh, security, log_content)
    finally:
        shutdown_tracing()


async def _serve(
    config: FrontendConfig, mesh: MeshConfig, security: MeshSecurity | None, log_content: bool
) -> bool:
    # Imported here, not at the top: every `kvmesh` command reads ENTRY to build its parser,
    # and only the frontend needs the gateway (aiohttp app, tokenizers, chat templates).
    from kvmesh.frontend.app import abort_streams, build_app, serve_http
    from kvmesh.frontend.auth import GatewayAuth
    from kvmesh.frontend.group import GatewayGroup, PeerMetrics, serve_own_metrics
    from kvmesh.frontend.service import OpenAIService
    from kvmesh.frontend.tokenizer import Tokenizer

    auth = GatewayAuth.from_config(config)
    tls = gateway_tls(config)  # a bad certificate stops the gateway here
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
    pool, router = build_router(mesh, security)
    await pool.start()
    backend = MeshBackend(pool, router, configured, disagg=mesh)
    service = OpenAIService(backend, tokenizers, config)
    service.log_content = log_content
    register_router_metrics(service.metrics.registry, router)
    service.metrics.registry.register(DisaggCollector(backend.stats))
    # What every process of a gateway group sees whole: shown once, never summed.
    if isinstance(router, KvRouter):  # the workers' KV tier counters, from their load streams
        loads = router.subscriber.loads
        service.metrics.shared.register(KvTierCollector(lambda: list(loads.items())))
    service.metrics.shared.register(PoolCollector(pool))
    group = GatewayGroup.parse(config.gateway_group)
    app = build_app(service, config, auth)
    runner, port = await serve_http(
        app,
        config.http_host,
        config.http_port,
        tls=ServerSslContext(tls) if tls is not None else None,
        reuse_port=group is not None,
        shutdown_timeout=1.0,
    )
    sync = registration = None
    if config.router_sync_port >= 0:
        if not isinstance(router, KvRouter):  # refused by main() already
            raise ConfigError("--router-sync-port serves an in-process KV router")
        # A group's processes follow each other on loopback, unless they find their peers in
        # discovery (kvmesh.frontend.group); otherwise a gateway is followed by other hosts'
        # gateways, on its own address, and registers it for those that discover theirs.
        loopback = group is not None and not mesh.router_peers_discovery
        sync_host = "127.0.0.1" if loopback else config.http_host
        sync = mesh_server(sync_host, config.router_sync_port, security)
        sync.add(
            rpb_grpc.add_RouterServiceServicer_to_server,
            RouterServicer(pool, router, mesh),
            ROUTER_SERVICE,
        )
        await sync.start()
        log.info("frontend serving its router's bookings (RouterService) on %s", sync.address)
        if not loopback:
            advertised = sync.address
            if config.router_sync_advertise_host:
                advertised = f"{config.router_sync_advertise_host}:{sync.port}"
            registration = router.register(advertised)
    scheme = "https" if tls is not None else "http"
    log.info(
        "frontend serving OpenAI API on %s://%s:%d/v1 (API keys: %s)",
        scheme,
        config.http_host,
        port,
        len(auth.keys) if auth is not None else "none",
    )
    kserve = None
    if config.kserve_grpc_port >= 0:
        # Imported here: it registers the `inference.*` protobuf symbols (see its docstring).
        from kvmesh.frontend.kserve_grpc import serve_kserve_grpc

        kserve = await serve_kserve_grpc(
            service,
            config.http_host,
            config.kserve_grpc_port,
            auth=auth,
            tls=tls,
            reuse_port=group is not None,
        )
        log.info("frontend serving KServe v2 gRPC on %s", kserve.address)
    own_metrics = peers = None
    if group is not None:
        peers = service.metrics.peers = PeerMetrics(group)
        own_metrics = await serve_own_metrics(service.metrics, group)  # last: "started"
    freeze_heap()
    await wait_for_signal()
    service.start_drain()
    if registration is not None:
        await registration.close()  # peers stop following this router
    if kserve is not None:
        await kserve.set_serving(False)
    drained = await _drain(service, config.drain_timeout_s)
    if not drained:
        cut = abort_streams(app, "the server is shutting down; the request was cut short")
        log.warning("%d streams ended with an error event", cut)
    if kserve is not None:
        await kserve.stop(1.0 if drained else 0)
    await runner.cleanup()
    if sync is not None:
        await sync.stop(0)
    if own_metrics is not None and peers is not None:
        await own_metrics.cleanup()
        await peers.close()
    await close_router(router)
    await pool.stop()
    return drained


async def _drain(service: OpenAIService, timeout_s: float) -> bool:
    """Let in-flight requests finish: whether they all did within `timeout_s`, before a second
    SIGINT/SIGTERM."""
    log.info("draining %d requests in flight (up to %g s)", service.in_flight, timeout_s)
    idle = asyncio.ensure_future(service.wait_idle(timeout_s))
    forced = asyncio.ensure_future(wait_for_signal())
    try:
        await asyncio.wait({idle, forced}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        forced.cancel()
        idle.cancel()
    if idle.done() and not idle.cancelled() and idle.result():
        return True
    why = "forced" if forced.done() and not forced.cancelled() else "drain timed out"
    log.warning("%s with %d requests in flight", why, service.in_flight)
    return False


def main(ns: argparse.Namespace) -> int:
    """`kvmesh frontend`: serve until SIGINT/SIGTERM; exit code 1 when the drain had to cut
    requests short."""
    tls_config = from_args(TlsConfig, ns)
    security = MeshSecurity.load(tls_config)  # bad certificates stop it here
    config = from_args(FrontendConfig, ns)
    mesh = from_args(MeshConfig, ns)
    if config.router_sync_port >= 0 and not mesh.kv_in_process:
        raise ConfigError(
            "--router-sync-port serves an in-process KV router (--router-mode kv, no "
            "--router-address)"
        )
    processes = config.gateway_processes or usable_cpus()
    if processes > 1:
        from kvmesh.frontend.auth import GatewayAuth
        from kvmesh.frontend.group import run_group

        # What each process would refuse, refused once, here.
        gateway_tls(config)
        GatewayAuth.from_config(config)
        return run(
            run_group(
                processes,
                config,
                mesh,
                tls_config,
                from_args(TracingConfig, ns),
                from_args(GlobalConfig, ns),
            )
        )
    drained = run(
        serve_frontend(
            config,
            mesh,
            security,
            from_args(TracingConfig, ns),
            from_args(GlobalConfig, ns).log_content,
        )
    )
    return 0 if drained else 1


ENTRY = Entry(
    "frontend",
    "OpenAI HTTP gateway and KServe v2 front doors (REST; gRPC with --kserve-grpc-port)",
    Flags.of(FrontendConfig, MeshConfig, TlsConfig, TracingConfig),
    main,
)
