"""`kvmesh up`: a whole mesh on one machine, as separate processes, with no etcd.

Starts N workers, optionally a standalone router, and the frontend, all pointed at an embedded
file registry (a temporary directory). Waits for the gateway to report healthy and prints how
to call it. While running it keeps each worker pool at its target size (a worker that dies is
replaced) and serves `ScalingService` on a control port, so a planner (or an operator with
grpcurl) can scale the pools: scale-up starts workers, scale-down drains the newest ones (they
leave discovery first, finish their requests, then exit). On Ctrl-C / SIGTERM it shuts down in
order: frontend first (drains), then router and workers (each drains), killing whatever is
still alive after the grace period.

Pools: `--workers N` aggregated workers, or a disaggregated mesh with `--prefill-workers N
--decode-workers M` (workers started with `--role prefill` / `--role decode`; the gateway
prefills on the prefill pool and decodes on the decode pool, see kvmesh.router.backend). Only the
pools a mesh starts with can be scaled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.router.backend import DisaggConfig
from kvmesh.router.routing import RouterMode
from kvmesh.runtime.config import opt, to_argv
from kvmesh.runtime.discovery import EventKind, open_discovery
from kvmesh.runtime.errors import InvalidRequest, NotFound
from kvmesh.runtime.grpcutil import GrpcServer
from kvmesh.runtime.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.runtime.process import run
from kvmesh.runtime.types import Role
from kvmesh.workers.config import EngineKind
from kvmesh.workers.main import engine_arg_groups

SCALING_SERVICE = spb.DESCRIPTOR.services_by_name["ScalingService"].full_name


@dataclass
class UpConfig(DisaggConfig):
    """Settings of `kvmesh up` (with the gateway's conditional disaggregation thresholds)."""

    engine: EngineKind = opt(EngineKind.MOCKER, "engine every worker runs")
    model: str = opt("", "local Hugging Face model directory; empty: the built-in tiny model")
    served_model_name: str = opt("", "model name clients use; empty: the directory's name")
    workers: int = opt(
        -1,
        "number of aggregated worker processes; -1: 2, or 0 when --prefill-workers or "
        "--decode-workers is set",
    )
    prefill_workers: int = opt(
        0, "number of prefill worker processes (disaggregated serving, with --decode-workers)"
    )
    decode_workers: int = opt(0, "number of decode worker processes (disaggregated serving)")
    max_workers: int = opt(64, "largest pool size Scale accepts")
    http_host: str = opt("127.0.0.1", "gateway bind address")
    http_port: int = opt(8000, "gateway HTTP port")
    kserve_grpc_port: int = opt(
        0, "KServe v2 gRPC port of the gateway (0: pick a free one; -1: no KServe gRPC server)"
    )
    control_port: int = opt(0, "port of the ScalingService (gRPC); 0 picks a free one")
    router_mode: RouterMode = opt(RouterMode.KV, "routing policy")
    router_process: bool = opt(
        False, "run the router as its own process (kvmesh router) instead of inside the frontend"
    )
    discovery: str = opt("", "discovery URL; empty: an embedded file registry in a temp dir")
    startup_timeout_s: float = opt(60.0, "how long to wait for the mesh to become healthy")
    shutdown_timeout_s: float = opt(15.0, "grace period for children to exit before SIGKILL")

    def __post_init__(self) -> None:
        DisaggConfig.__post_init__(self)
        if self.prefill_workers < 0 or self.decode_workers < 0 or self.workers < -1:
            raise ValueError("worker counts must be >= 0")
        if self.prefill_workers and not self.decode_workers:
            raise ValueError("--prefill-workers needs --decode-workers (they decode)")

    @property
    def disaggregated(self) -> bool:
        """Whether the mesh runs prefill/decode pools."""
        return bool(self.prefill_workers or self.decode_workers)

    def pool_sizes(self) -> dict[Role, int]:
        """The pools this mesh runs and their initial sizes."""
        aggregated = self.workers if self.workers >= 0 else (0 if self.disaggregated else 2)
        sizes = {Role.AGGREGATED: aggregated} if aggregated or not self.disaggregated else {}
        if self.disaggregated:
            sizes[Role.PREFILL] = self.prefill_workers
            sizes[Role.DECODE] = self.decode_workers
        return sizes


@dataclass
class _Pool:
    """The workers of one role and their target count."""

    role: Role
    target: int
    children: list[Child] = field(default_factory=list)
    next_index: int = 0

    def active(self) -> list[Child]:
        """Workers alive and not draining."""
        return [w for w in self.children if w.alive() and not w.draining]


class Child:
    """A child process in its own session, so Ctrl-C reaches only the supervisor."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.started = time.monotonic()
        self.draining = False

    @classmethod
    async def spawn(cls, name: str, argv: list[str]) -> Child:
        return cls(name, await asyncio.create_subprocess_exec(*argv, start_new_session=True))

    def alive(self) -> bool:
        return self.proc.returncode is None

    def terminate(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            print(f"kvmesh up: {self.name} did not exit in time; killing it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


def _kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh", *args]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Supervisor:
    """The processes of one `kvmesh up` and the worker pool's target size."""

    def __init__(self, config: UpConfig, ns: argparse.Namespace) -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.served = config.served_model_name or ModelDirInfo.load(self.model_dir).name
        self.registry: Path | None = None
        self.discovery = config.discovery
        if not self.discovery:
            self.registry = Path(tempfile.mkdtemp(prefix="kvmesh-registry-"))
            self.discovery = f"file://{self.registry}"
        self.log_level = ["--log-level", getattr(ns, "log_level", "info")]
        self.engine_flags: list[str] = []
        for group in engine_arg_groups():
            fields = {k: getattr(ns, k) for k in group.__dataclass_fields__ if hasattr(ns, k)}
            self.engine_flags += to_argv(group(**fields))
        self.pools = {role: _Pool(role, n) for role, n in config.pool_sizes().items()}
        self.kserve_grpc_port = config.kserve_grpc_port
        """The frontend's KServe v2 gRPC port (a free one is picked when configured as 0)."""
        self.others: list[Child] = []  # frontend (first), router
        self.registered: set[str] = set()
        self._pid = os.getpid()

    @property
    def workers(self) -> list[Child]:
        """Every worker process of every pool."""
        return [w for pool in self.pools.values() for w in pool.children]

    def _common(self) -> list[str]:
        return [
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served,
            "--discovery",
            self.discovery,
        ]

    async def start_worker(self, role: Role = Role.AGGREGATED) -> None:
        pool = self.pools[role]
        i, pool.next_index = pool.next_index, pool.next_index + 1
        prefix = "worker" if role is Role.AGGREGATED else role.value
        wid = f"{prefix}-{i}-{self._pid}"
        argv = _kvmesh(
            *self.log_level,
            "worker",
            "--engine",
            self.config.engine.value,
            *self._common(),
            "--worker-id",
            wid,
            "--role",
            role.value,
            *self.engine_flags,
        )
        pool.children.append(await Child.spawn(wid, argv))

    async def start(self) -> Child:
        """Start workers, router and frontend; returns the frontend."""
        for pool in self.pools.values():
            for _ in range(pool.target):
                await self.start_worker(pool.role)
        router_args: list[str] = []
        cfg = self.config
        if cfg.router_process:
            port = _free_port("127.0.0.1")
            argv = _kvmesh(
                *self.log_level,
                "router",
                "--port",
                str(port),
                "--discovery",
                self.discovery,
                "--router-mode",
                cfg.router_mode.value,
            )
            self.others.append(await Child.spawn("router", argv))
            router_args = ["--router-address", f"127.0.0.1:{port}"]
        if cfg.kserve_grpc_port == 0:
            self.kserve_grpc_port = _free_port(cfg.http_host)
        argv = _kvmesh(
            *self.log_level,
            "frontend",
            "--http-host",
            cfg.http_host,
            "--http-port",
            str(cfg.http_port),
            "--kserve-grpc-port",
            str(max(self.kserve_grpc_port, 0)),
            *self._common(),
            "--router-mode",
            cfg.router_mode.value,
            *router_args,
            *to_argv(DisaggConfig(**{f.name: getattr(cfg, f.name) for f in fields(DisaggConfig)})),
        )
        frontend = await Child.spawn("frontend", argv)
        self.others.insert(0, frontend)
        return frontend

    # -- pool ----------------------------------------------------------------------------------

    def active(self, role: Role = Role.AGGREGATED) -> list[Child]:
        """Workers of `role` alive and not draining."""
        pool = self.pools.get(role)
        return pool.active() if pool is not None else []

    async def scale(self, replicas: int, role: Role = Role.AGGREGATED) -> int:
        """Set a pool's target; start or drain workers now. Returns the previous target."""
        pool = self.pools.get(role)
        if pool is None:
            raise InvalidRequest(
                f"this mesh runs no {role.value} pool (pools: "
                + ", ".join(r.value for r in self.pools)
                + ")",
                param="role",
            )
        if replicas > self.config.max_workers:
            raise InvalidRequest(
                f"replicas {replicas} exceeds --max-workers {self.config.max_workers}",
                param="replicas",
            )
        previous, pool.target = pool.target, replicas
        await self.reconcile()
        return previous

    async def reconcile(self) -> None:
        """Reap exited workers, replace dead ones, drain extra ones, in every pool."""
        for pool in self.pools.values():
            for w in [w for w in pool.children if not w.alive()]:
                pool.children.remove(w)
                if not w.draining:
                    print(
                        f"kvmesh up: {w.name} exited with {w.proc.returncode}; replacing it",
                        file=sys.stderr,
                    )
            active = pool.active()
            for _ in range(pool.target - len(active)):
                await self.start_worker(pool.role)
            for w in sorted(active, key=lambda c: c.started)[pool.target :]:
                w.draining = True
                w.terminate()  # the worker deregisters, finishes its requests, exits

    def pool_status(self, role: Role = Role.AGGREGATED) -> spb.PoolStatus:
        pool = self.pools[role]
        active = pool.active()
        ready = sum(1 for w in active if w.name in self.registered)
        return spb.PoolStatus(
            model=self.served,
            role=_ROLE_TO_PB[role],
            target_replicas=pool.target,
            ready_replicas=ready,
            starting_replicas=len(active) - ready,
            draining_replicas=sum(1 for w in pool.children if w.alive() and w.draining),
        )

    async def watch_registrations(self) -> None:
        async for event in open_discovery(self.discovery).watch("worker"):
            if event.kind is EventKind.ADDED:
                self.registered.add(event.instance.instance_id)
            else:
                self.registered.discard(event.instance.instance_id)

    async def shutdown(self) -> None:
        # Frontend first so no new work arrives, then everything else.
        groups = [self.others[:1], self.others[1:] + self.workers]
        for group in groups:
            for c in group:
                c.terminate()
            await asyncio.gather(*(c.wait(self.config.shutdown_timeout_s) for c in group))
        if self.registry is not None:
            shutil.rmtree(self.registry, ignore_errors=True)


_ROLE_TO_PB: dict[Role, cpb.WorkerRole.ValueType] = {
    Role.AGGREGATED: cpb.WORKER_ROLE_AGGREGATED,
    Role.PREFILL: cpb.WORKER_ROLE_PREFILL,
    Role.DECODE: cpb.WORKER_ROLE_DECODE,
}
_ROLE_FROM_PB: dict[int, Role] = {v: k for k, v in _ROLE_TO_PB.items()}


class ScalingServicer(spb_grpc.ScalingServiceServicer):
    """ScalingService over the local supervisor (its aggregated, or prefill and decode, pools)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    def _check(self, model: str) -> None:
        if model and model != self.sup.served:
            raise NotFound(f"this mesh serves {self.sup.served!r}, not {model!r}")

    def _role(self, role: int) -> Role:
        found = _ROLE_FROM_PB.get(role)
        if found is None or found not in self.sup.pools:
            pools = ", ".join(cpb.WorkerRole.Name(_ROLE_TO_PB[r]) for r in self.sup.pools)
            raise InvalidRequest(f"this mesh runs the pools {pools}; role must be one of them")
        return found

    async def Scale(
        self, request: spb.ScaleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> spb.ScaleResponse:
        self._check(request.model)
        role = self._role(request.role)
        previous = await self.sup.scale(request.replicas, role)
        if request.reason:
            print(
                f"kvmesh up: scaling {role.value} to {request.replicas} ({request.reason})",
                file=sys.stderr,
            )
        return spb.ScaleResponse(
            previous_replicas=previous, target_replicas=self.sup.pools[role].target
        )

    async def ListPools(
        self, request: spb.ListPoolsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> spb.ListPoolsResponse:
        self._check(request.model)
        return spb.ListPoolsResponse(pools=[self.sup.pool_status(r) for r in self.sup.pools])


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _up(config: UpConfig, ns: argparse.Namespace) -> int:
    sup = Supervisor(config, ns)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    control = GrpcServer("127.0.0.1", config.control_port)
    control.add(
        spb_grpc.add_ScalingServiceServicer_to_server, ScalingServicer(sup), SCALING_SERVICE
    )
    watcher = asyncio.create_task(sup.watch_registrations())
    try:
        frontend = await sup.start()
        await control.start()
        host = "127.0.0.1" if config.http_host in ("0.0.0.0", "::") else config.http_host
        base = f"http://{host}:{config.http_port}"
        deadline = time.monotonic() + config.startup_timeout_s
        async with aiohttp.ClientSession() as http:
            while not await _healthy(http, base + "/health"):
                dead = [c.name for c in (*sup.others, *sup.workers) if not c.alive()]
                if dead or stop.is_set() or time.monotonic() > deadline:
                    why = (
                        f"{', '.join(dead)} exited"
                        if dead
                        else ("interrupted" if stop.is_set() else "timed out")
                    )
                    print(f"kvmesh up: mesh did not become healthy ({why})", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.2)
        kserve = f"{host}:{sup.kserve_grpc_port}" if sup.kserve_grpc_port > 0 else ""
        _banner(base, sup.served, config, control.address, kserve)
        while not stop.is_set():
            if not frontend.alive():
                print("kvmesh up: the frontend exited; shutting down", file=sys.stderr)
                return 1
            await sup.reconcile()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return 0
    finally:
        watcher.cancel()
        await control.stop(0)
        await sup.shutdown()


def run_up(config: UpConfig, ns: argparse.Namespace) -> int:
    """Run the mesh until interrupted; returns the process exit code."""
    return run(_up(config, ns))


def _banner(base: str, model: str, config: UpConfig, control: str, kserve: str) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
            "stream": True,
        }
    )
    pools = ", ".join(f"{n} {role.value}" for role, n in config.pool_sizes().items())
    print(
        f"\nkvmesh is up: {config.engine.value} workers ({pools}), "
        f"router {config.router_mode.value}{' (own process)' if config.router_process else ''}\n"
        f"  OpenAI API : {base}/v1   (model {model!r})\n"
        f"  health     : {base}/health    metrics: {base}/metrics\n"
        f"  KServe v2  : {base}/v2 (REST)"
        + (f"   grpc {kserve} (inference.GRPCInferenceService)" if kserve else "")
        + "\n"
        f"  scaling    : grpc {control}  (kvmesh.api.scaling.v1.ScalingService/Scale)\n\n"
        f"  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{body}'\n\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )
