"""Several gateway processes on one port: `kvmesh frontend --gateway-processes N`.

One Python process serves about one core's worth of requests (the request path is Python:
HTTP, JSON, chat template, tokenizer tail, routing, the worker stream). The group runs N of
them behind the same ports, the way uvicorn and gunicorn workers do:

* a parent process (`run_group`) picks the ports (a free one for a port given as 0), starts N
  `kvmesh frontend` processes with the same flags plus `--gateway-group DIR,INDEX,N`, forwards
  SIGINT/SIGTERM to them (each drains as a single gateway does; a second signal cuts their
  streams), starts one again if it dies after it came up (a process that dies while starting:
  the group stops with its exit code: a bad flag or a port in use is not retried), and exits 1
  if any process had to cut requests short;
* each process binds the HTTP port (and the KServe gRPC port) with SO_REUSEPORT, so the kernel
  spreads new connections between them (per connection: one keep-alive connection stays with
  one process);
* each routes with its own in-process KV router and serves it as RouterService on a loopback
  port of its own (`--router-sync-port`); the others follow its bookings as peer replicas
  (`--router-peers`, kvmesh.router.kv_subscriber.PeerLoadSync), so every process costs the
  workers with the whole group's predicted load;
* `GET /metrics` on any process answers for the group: each process serves its own metrics on
  a Unix socket in the group's private directory (`DIR/metrics-INDEX.sock`), and the one
  scraped sums them (kvmesh.runtime.metrics.sum_expositions) with its view of the mesh (the
  workers, their KV tiers), which every process sees whole; `kvmesh_frontend_gateway_processes`
  says how many answered;
* the limits, which an operator sets for the gateway, are split: each process keeps 1/N
  (rounded up) of a worker's in-flight limit (`--gateway-replicas`), of
  `--max-concurrent-requests`, `--max-queued-requests` and `--disagg-max-prefill-inflight`,
  and of each API key's rate limits (a client whose connections all land on one process is
  limited at that process's share);
* connections a process had not accepted yet when it died are reset (Linux hands them to
  the others only with `net.ipv4.tcp_migrate_req=1`); its streams in flight end with it.

LoRA adapters loaded through any process reach the others as every gateway learns of them: from
the workers' cards in discovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvmesh.frontend.auth import API_KEY_ENV
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from kvmesh.router.stack import MeshConfig
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.process import ChildProcess, GlobalConfig, kvmesh_argv, wait_for_signal
from kvmesh.runtime.telemetry import TracingConfig
from kvmesh.runtime.tls import TlsConfig

__all__ = ["GatewayGroup", "PeerMetrics", "run_group", "serve_own_metrics"]

log = logging.getLogger(__name__)

CRASH_LOOP_S = 10.0
"""A process that exits this soon after it started again is restarted after a growing delay."""
RESTART_MAX_S = 30.0
"""The longest of those delays."""
PEER_METRICS_TIMEOUT_S = 2.0
"""A process whose metrics take longer is left out of that scrape (and of its count)."""


@dataclass(frozen=True)
class GatewayGroup:
    """Where one process stands in its group (`--gateway-group DIRECTORY,INDEX,COUNT`)."""

    directory: Path
    index: int
    count: int

    @classmethod
    def parse(cls, value: str) -> GatewayGroup | None:
        """The group `value` names; None for ""; ValueError when malformed."""
        if not value:
            return None
        malformed = f"--gateway-group wants DIRECTORY,INDEX,COUNT, not {value!r}"
        parts = value.rsplit(",", 2)
        if len(parts) != 3 or not parts[0]:
            raise ValueError(malformed)
        try:
            group = cls(Path(parts[0]), int(parts[1]), int(parts[2]))
        except ValueError:
            raise ValueError(malformed) from None
        if not 0 <= group.index < group.count:
            raise ValueError(malformed)
        return group

    def encode(self) -> str:
        return f"{self.directory},{self.index},{self.count}"

    def metrics_socket(self, index: int) -> Path:
        """The Unix socket process `index` serves its own metrics on."""
        return self.directory / f"metrics-{index}.sock"


async def serve_own_metrics(metrics: FrontendMetrics, group: GatewayGroup) -> web.AppRunner:
    """Serve `metrics.render_own()` at `GET /metrics` on this process's socket of `group` (its
    directory is private to the user, so the socket needs no key); stop with `cleanup()`."""

    async def own(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render_own(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", own)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    path = group.metrics_socket(group.index)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # left by a predecessor that was killed
    site = web.UnixSite(runner, str(path))
    await site.start()
    return runner


class PeerMetrics:
    """Fetches the other processes' own metrics (FrontendMetrics.peers); `close()` when done."""

    def __init__(self, group: GatewayGroup) -> None:
        self.group = group
        self._sessions = {
            i: aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(group.metrics_socket(i))),
                timeout=aiohttp.ClientTimeout(total=PEER_METRICS_TIMEOUT_S),
            )
            for i in range(group.count)
            if i != group.index
        }

    async def __call__(self) -> list[bytes]:
        """The expositions of the peers that answered in time."""
        got = await asyncio.gather(*(self._fetch(i) for i in self._sessions))
        return [text for text in got if text is not None]

    async def _fetch(self, index: int) -> bytes | None:
        try:
            async with self._sessions[index].get("http://gateway/metrics") as resp:
                if resp.status == 200:
                    return await resp.read()
                log.debug("gateway process %d answered its metrics with %d", index, resp.status)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("gateway process %d did not give its metrics: %r", index, exc)
        return None

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


def _share(value: int, count: int) -> int:
    """One process's share of a limit (0: none stays none), rounded up."""
    return -(-value // count)


async def run_group(
    count: int,
    config: FrontendConfig,
    mesh: MeshConfig,
    tls: TlsConfig,
    tracing: TracingConfig,
    log_config: GlobalConfig,
) -> int:
    """Run `count` gateway processes on the same ports until SIGINT/SIGTERM (module
    docstring); exit code 0 when every one drained its requests, else 1 (or the code of a
    process that failed to start)."""
    host = config.http_host
    http_port = config.http_port or free_port(host)
    kserve_port = config.kserve_grpc_port
    if kserve_port == 0:
        kserve_port = free_port(host)
    kv = mesh.kv_in_process
    # With --router-peers-discovery each process serves its bookings on --http-host and
    # registers there (its siblings and other hosts' routers find it alike); else the processes
    # follow each other on loopback, given as peers.
    discover = kv and mesh.router_peers_discovery
    sync_host = host if discover else "127.0.0.1"
    sync_ports = [free_port(sync_host) for _ in range(count)] if kv else []
    env: dict[str, str] = {}
    if config.api_key:  # keys go in the environment, never on a command line (ps shows it)
        given = os.environ.get(API_KEY_ENV, "")
        env[API_KEY_ENV] = ",".join([*config.api_key, *given.split(",")])
    directory = Path(tempfile.mkdtemp(prefix="kvmesh-gateway-"))
    groups = [GatewayGroup(directory, i, count) for i in range(count)]

    def argv(index: int) -> list[str]:
        fe = replace(
            config,
            gateway_processes=1,
            http_port=http_port,
            kserve_grpc_port=kserve_port,
            api_key=[],
            rate_limit_rpm=_share(config.rate_limit_rpm, count),
            rate_limit_tpm=_share(config.rate_limit_tpm, count),
            router_sync_port=sync_ports[index] if kv else -1,
            gateway_group=groups[index].encode(),
        )
        peers = (
            [] if discover else [f"127.0.0.1:{p}" for i, p in enumerate(sync_ports) if i != index]
        )
        routes = replace(
            mesh,
            router_peers=[*mesh.router_peers, *peers],
            gateway_replicas=mesh.gateway_replicas * count,
            max_concurrent_requests=_share(mesh.max_concurrent_requests, count),
            max_queued_requests=_share(mesh.max_queued_requests, count),
            disagg_max_prefill_inflight=_share(mesh.disagg_max_prefill_inflight, count),
        )
        return kvmesh_argv("frontend", log_config, fe, routes, tls, tracing)

    def start(index: int) -> ChildProcess:
        with contextlib.suppress(FileNotFoundError):
            groups[index].metrics_socket(index).unlink()
        return ChildProcess(argv(index), env)

    kserve = f" and KServe gRPC :{kserve_port}" if kserve_port > 0 else ""
    log.info("gateway: %d processes on %s:%d%s", count, host, http_port, kserve)
    children = [start(i) for i in range(count)]
    started = [time.monotonic()] * count
    quick_exits = [0] * count  # in a row, each within CRASH_LOOP_S of its start
    exits = {i: asyncio.ensure_future(c.wait()) for i, c in enumerate(children)}
    stop = asyncio.ensure_future(wait_for_signal())
    failed = 0
    try:
        while not failed:
            done, _ = await asyncio.wait({stop, *exits.values()}, return_when="FIRST_COMPLETED")
            if stop in done:
                break
            for i, waiter in list(exits.items()):
                if waiter not in done:
                    continue
                code = waiter.result()
                if not groups[i].metrics_socket(i).exists():
                    log.error("gateway process %d exited with %d while starting", i, code)
                    failed = code or 1
                    break
                quick = time.monotonic() - started[i] < CRASH_LOOP_S
                quick_exits[i] = quick_exits[i] + 1 if quick else 0
                delay = min(RESTART_MAX_S, 0.5 * 2 ** quick_exits[i]) if quick else 0.0
                log.warning(
                    "gateway process %d exited with %d; starting it again in %.1f s", i, code, delay
                )
                if delay:
                    await asyncio.wait({stop}, timeout=delay)
                    if stop.done():
                        break
                children[i] = start(i)
                started[i] = time.monotonic()
                exits[i] = asyncio.ensure_future(children[i].wait())
        codes = await _stop(children)
    finally:
        stop.cancel()
        for waiter in exits.values():
            waiter.cancel()
        for child in children:
            child.send_signal(signal.SIGKILL)  # any still running: an error above
        shutil.rmtree(directory, ignore_errors=True)
    if failed:
        return failed
    return 0 if all(code == 0 for code in codes) else 1


async def _stop(children: list[ChildProcess]) -> list[int]:
    """SIGTERM to every process (they drain), again on each further SIGINT/SIGTERM (they cut
    their streams); their exit codes."""
    for child in children:
        child.send_signal(signal.SIGTERM)
    waiting = asyncio.ensure_future(asyncio.gather(*(c.wait() for c in children)))
    while not waiting.done():
        again = asyncio.ensure_future(wait_for_signal())
        both: set[asyncio.Future[Any]] = {waiting, again}
        await asyncio.wait(both, return_when="FIRST_COMPLETED")
        if again.done():
            for child in children:
                child.send_signal(signal.SIGTERM)
        else:
            again.cancel()
    return list(waiting.result())
