"""`kvmesh router`: the router as a standalone gRPC service (RouterService).

Its flags are RouterServerConfig's and MeshConfig's but `--router-address` (`ENTRY`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.router.service import ROUTER_SERVICE, RouterServicer
from kvmesh.router.stack import MeshConfig, build_router, close_router
from kvmesh.runtime.config import Flags, from_args, opt
from kvmesh.runtime.grpcutil import MeshSecurity, mesh_server
from kvmesh.runtime.process import Entry, run, wait_for_signal
from kvmesh.runtime.tls import TlsConfig

log = logging.getLogger(__name__)


@dataclass
class RouterServerConfig:
    """Settings of the standalone router process."""

    host: str = opt("127.0.0.1", "address to bind the router's gRPC server to")
    port: int = opt(0, "router gRPC port; 0 picks a free one")


async def serve_router(
    config: RouterServerConfig, mesh: MeshConfig, security: MeshSecurity | None = None
) -> None:
    """Run `kvmesh router` until SIGINT/SIGTERM."""
    pool, router = build_router(mesh, security)
    await pool.start()
    server = mesh_server(config.host, config.port, security)
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


def main(ns: argparse.Namespace) -> int:
    """`kvmesh router`: serve until SIGINT/SIGTERM."""
    security = MeshSecurity.load(from_args(TlsConfig, ns))  # bad certificates stop it here
    run(serve_router(from_args(RouterServerConfig, ns), from_args(MeshConfig, ns), security))
    return 0


ENTRY = Entry(
    "router",
    "the router as a standalone gRPC service (RouterService)",
    # A router routes itself: it cannot delegate to another one.
    Flags.of(RouterServerConfig, MeshConfig, TlsConfig, skip={"router_address"}),
    main,
)
