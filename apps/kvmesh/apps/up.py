"""`kvmesh up`: a whole mesh on one machine, as separate processes, with no etcd.

Starts N workers, optionally a standalone router, and the frontend, all pointed at an embedded
file registry (a temporary directory). Waits for the gateway to report healthy and prints how
to call it. While running it keeps each worker pool at its target size (a worker that dies is
replaced) and serves `ScalingService` on a control port, so a planner (or an operator with
grpcurl) can scale the pools: scale-up starts workers; scale-down drains the workers with the
least cached value (kvmesh.planner.drain: still starting first, then the fewest prefix-cache
blocks): each leaves discovery first, keeps serving `--leave-delay-s` while the routers notice,
finishes its in-flight requests within `--drain-timeout-s` (the grace period), then exits.
`Scale` is checked whole before anything changes: an unknown pool, a count over `--max-workers`
(a negative count sent by a client as a signed int arrives as a huge unsigned one) or over the
`--max-total-workers` budget is INVALID_ARGUMENT, and a Scale while the previous one is still
being applied is ABORTED; a pool whose new workers cannot be started is left as it was.
`--planner sla|queue` runs the planner (kvmesh.planner.main.PlannerLoop) in this process,
reading the frontend's /metrics and scaling through the control port. On Ctrl-C / SIGTERM it
shuts down in order: frontend first (drains), then router and workers (each drains), saying
what it waits for, killing whatever is still alive `--drain-timeout-s` + 10 s after it was asked
to stop; a second Ctrl-C forces it (the frontend ends its streams at once with an error event
and `[DONE]`, then everything left is killed). Whatever happens (stdout or stderr closed, an
exception), every child is terminated before `up` returns, and children started by `up` get
SIGTERM when `up` itself dies (`kill -9` included: kvmesh.runtime.process.die_with_parent). The
exit code is 0 only when every process stopped on its own.

Start-up: ports given on the command line that are already in use fail at once, with one line,
before anything starts; the banner is printed only once kvmesh's own frontend answers. A worker
that exits (at start-up or later), or stops answering health checks (hung: it is killed), is
replaced; one that keeps failing soon after it started is replaced after an exponential backoff
(1 s, 2 s, ... 60 s: crash-loop backoff), and at start-up `up` gives up after STARTUP_CRASHES
such failures in a row.

Flags: UpConfig's, plus every flag of the processes it starts (their entry points' `Flags`),
but the ones `up` sets itself (SET_BY_UP: where each process listens and registers, and a
worker's id and role). A flag several processes take (`--model`, `--drain-timeout-s`) goes to
each. Children are started with posix_spawn, never fork (see ChildProcess).

Security: `--tls` generates a throwaway CA and one certificate per identity (kvmesh-up,
kvmesh-frontend, kvmesh-router, kvmesh-worker, kvmesh-planner) in a temp dir, deleted on exit:
every mesh link is mTLS and mesh servers accept only those identities; the gateway serves HTTPS
and TLS KServe gRPC with the frontend's certificate. Without it, the TLS flags (--tls-cert,
--tls-key, --tls-ca, --mesh-identities, --mesh-token-file) go to every process unchanged, and
`up` uses them for its own ScalingService.

KV tiers (`--kv-host-blocks`, `--kv-disk-dir DIR`, `--kv-disk-blocks`) go to every worker; each
worker gets its own disk directory, `DIR/<pool>-<index>` (e.g. `DIR/worker-0`), stable across
restarts of `up`, so a restarted mesh finds its block files again.

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
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.frontend import main as frontend_main
from kvmesh.frontend.auth import API_KEY_ENV
from kvmesh.frontend.config import FrontendConfig
from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.connectors import GrpcConnector
from kvmesh.planner.drain import DrainCandidate, drain_order
from kvmesh.planner.main import PlannerLoop
from kvmesh.planner.metrics import MetricsScraper
from kvmesh.planner.profile import PerfProfile
from kvmesh.router import main as router_main
from kvmesh.router.main import RouterServerConfig
from kvmesh.router.stack import MeshConfig
from kvmesh.runtime.config import ConfigError, Flags, from_args, opt
from kvmesh.runtime.discovery import EventKind, open_discovery
from kvmesh.runtime.errors import Aborted, InvalidRequest, NotFound, Unavailable
from kvmesh.runtime.grpcutil import (
    GrpcServer,
    MeshSecurity,
    check_health,
    mesh_channel,
    mesh_server,
)
from kvmesh.runtime.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.process import (
    CORE_SLOT_ENV,
    ChildProcess,
    Entry,
    GlobalConfig,
    kvmesh_argv,
    run,
    usable_cpus,
)
from kvmesh.runtime.telemetry import TracingConfig
from kvmesh.runtime.tls import DevPki, TlsConfig, write_dev_pki
from kvmesh.runtime.types import Role
from kvmesh.runtime.wire import device_cached_blocks, role_from_pb, role_to_pb
from kvmesh.sim.profiler import profile_mocker
from kvmesh.workers import main as worker_main
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.config import EngineKind, WorkerConfig
from kvmesh.workers.pytorch.config import TorchConfig

SCALING_SERVICE = spb.DESCRIPTOR.services_by_name["ScalingService"].full_name

STOP_MARGIN_S = 10.0
"""How long past its --drain-timeout-s a child may take to exit before it is killed."""
LOAD_TIMEOUT_S = 1.0
"""How long a scale-down waits for each worker's load metrics (its cache size)."""

IDENTITIES = ("kvmesh-up", "kvmesh-frontend", "kvmesh-router", "kvmesh-worker", "kvmesh-planner")
"""The mesh identities `kvmesh up --tls` issues certificates for (subject CN = the name)."""

FORCE_GRACE_S = 3.0
"""After a second Ctrl-C: how long children get to end their streams before they are killed."""

CRASH_WINDOW_S = 30.0
"""A worker that exits within this long of its start counts as a crash loop (backoff)."""
BACKOFF_S = 1.0
BACKOFF_MAX_S = 60.0
STARTUP_CRASHES = 3
"""Crashes in a row of one pool's workers during start-up that make `up` give up."""

HUNG_CHECK_S = 2.0
HUNG_TIMEOUT_S = 3.0
HUNG_FAILURES = 3
"""A worker that misses this many health checks in a row is killed and replaced."""


def _say(message: str) -> None:
    """One line of `up`'s own on stderr. A closed stderr (a pipe whose reader left) is ignored:
    nothing `up` prints may stop it from stopping its children."""
    with contextlib.suppress(OSError, ValueError):
        print(f"kvmesh up: {message}", file=sys.stderr, flush=True)


@dataclass
class UpConfig:
    """Settings of `kvmesh up` itself. The flags after these are those of the processes it
    starts, passed to each process that takes them, but for the ones `up` sets itself
    (--host, --advertise-host, --port, --discovery, --worker-id, --role, --router-address,
    --metrics-port: `up` assigns the workers' and the router's metrics ports and prints them)."""

    workers: int = opt(
        -1,
        "number of aggregated worker processes; -1: 2, or 0 when --prefill-workers or "
        "--decode-workers is set",
    )
    prefill_workers: int = opt(
        0, "number of prefill worker processes (disaggregated serving, with --decode-workers)"
    )
    decode_workers: int = opt(0, "number of decode worker processes (disaggregated serving)")
    max_workers: int = opt(64, "most workers per pool (the largest size Scale accepts)")
    max_total_workers: int = opt(0, "budget: most workers over all pools (0: no budget)")
    planner: PlannerPolicy | None = opt(
        None,
        "run the planner in this process with this policy (sla: needs --profile unless the "
        "engine is the mocker; queue: the reactive baseline); its flags are PlannerConfig's",
    )
    control_port: int = opt(0, "port of the ScalingService (gRPC); 0 picks a free one")
    router_process: bool = opt(
        False, "run the router as its own process (kvmesh router) instead of inside the frontend"
    )
    discovery: str = opt("", "discovery URL; empty: an embedded file registry in a temp dir")
    startup_timeout_s: float = opt(60.0, "how long to wait for the mesh to become healthy")
    tls: bool = opt(
        False,
        "generate a throwaway CA and certificates for this machine (deleted on exit): mTLS on "
        "every mesh link, HTTPS and TLS KServe gRPC at the gateway",
    )
    metrics_targets: str = opt(
        "",
        "write every process's metrics endpoint to this file as a Prometheus file_sd target "
        "list (rewritten as workers come and go; see deploy/prometheus)",
    )

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 0 or self.workers < -1:
            raise ValueError("worker counts must be >= 0")
        if self.max_total_workers < 0:
            raise ValueError("--max-total-workers must be >= 0")
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


def cpu_share(workers: int) -> int:
    """Tensor threads per torch worker when `workers` of them share this machine's cores (the
    ones this process may run on): at least one each. Workers that Scale adds later get the
    same share."""
    return max(1, usable_cpus() // max(1, workers))


SET_BY_UP: dict[str, frozenset[str]] = {
    "frontend": frozenset({"discovery", "router_address"}),
    "router": frozenset({"host", "advertise_host", "port", "discovery", "metrics_port"}),
    "worker": frozenset(
        {"host", "advertise_host", "port", "discovery", "worker_id", "role", "metrics_port"}
    ),
}
"""Fields of each process that `kvmesh up` sets itself: they are not flags of `up`."""


def _flags() -> Flags:
    processes = (worker_main.ENTRY, frontend_main.ENTRY, router_main.ENTRY)
    # PlannerConfig's --max-workers and --max-total-workers are UpConfig's: one flag sets both.
    flags = Flags.of(UpConfig, PlannerConfig)
    for entry in processes:
        flags += entry.flags.without(*SET_BY_UP[entry.name])
    # The same meaning as for `kvmesh frontend` (0: a free port); `up` serves it by default.
    return flags.with_defaults(kserve_grpc_port=0)


@dataclass
class UpArgs:
    """What `kvmesh up` was given: its own settings and those of the processes it starts."""

    up: UpConfig
    log: GlobalConfig
    worker: WorkerConfig
    tiers: KvTierConfig
    engine: Any
    """The config dataclass of `worker.engine` (MockerConfig, TorchConfig, ...)."""
    frontend: FrontendConfig
    mesh: MeshConfig
    router: RouterServerConfig
    planning: PlannerConfig
    tls: TlsConfig
    tracing: TracingConfig

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> UpArgs:
        """Build every process's config from the flags of `kvmesh up` (ConfigError if bad)."""
        worker = from_args(WorkerConfig, ns)
        up = from_args(UpConfig, ns)
        engine = from_args(worker_main.ENGINES[worker.engine].config, ns)
        if isinstance(engine, TorchConfig) and not engine.num_threads:
            engine = replace(engine, num_threads=cpu_share(sum(up.pool_sizes().values())))
        return cls(
            up=up,
            log=from_args(GlobalConfig, ns),
            worker=worker,
            tiers=from_args(KvTierConfig, ns),
            engine=engine,
            frontend=from_args(FrontendConfig, ns),
            mesh=from_args(MeshConfig, ns),
            router=from_args(RouterServerConfig, ns),
            planning=from_args(PlannerConfig, ns),
            tls=from_args(TlsConfig, ns),
            tracing=from_args(TracingConfig, ns),
        )


@dataclass
class _Pool:
    """The workers of one role and their target count."""

    role: Role
    target: int
    children: list[Child] = field(default_factory=list)
    next_index: int = 0
    crashes: int = 0
    """Workers in a row that exited within CRASH_WINDOW_S of their start."""
    restart_at: float = 0.0
    """Monotonic time before which no replacement starts (crash-loop backoff)."""

    def active(self) -> list[Child]:
        """Workers alive and not draining."""
        return [w for w in self.children if w.alive() and not w.draining]


class Child:
    """A process `kvmesh up` started (in its own session, so Ctrl-C reaches only `up`)."""

    def __init__(
        self, name: str, argv: list[str], metrics: str = "", env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.metrics = metrics
        """host:port of its /metrics ("" if none)."""
        self.proc = ChildProcess(argv, env)
        self.started = time.monotonic()
        self.draining = False

    def alive(self) -> bool:
        return self.proc.alive()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)


def _reachable(host: str) -> str:
    """The address to reach a server bound to `host` on this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class Supervisor:
    """The processes of one `kvmesh up` and the worker pools' target sizes."""

    def __init__(self, args: UpArgs) -> None:
        self.args = args
        self.config = args.up
        model_dir = resolve_model_dir(args.worker.model)
        info = ModelDirInfo.load(model_dir)
        self.served = args.worker.served_model_name or info.name
        self.context_length = info.context_length
        self.registry: Path | None = None
        self.discovery = self.config.discovery
        if not self.discovery:
            self.registry = Path(tempfile.mkdtemp(prefix="kvmesh-registry-"))
            self.discovery = f"file://{self.registry}"
        model = str(model_dir)
        self.worker = replace(
            args.worker, model=model, served_model_name=self.served, discovery=self.discovery
        )
        # Ports 0 mean "a free one" for `up` as for the frontend; `up` picks them to print them.
        fe = args.frontend
        try:
            self.frontend = replace(
                fe,
                model=model,
                served_model_name=self.served,
                http_port=fe.http_port or free_port(fe.http_host),
                kserve_grpc_port=fe.kserve_grpc_port or free_port(fe.http_host),
            )
        except OSError as e:
            raise ConfigError(f"--http-host {fe.http_host}: {e}") from e
        self.mesh = replace(args.mesh, discovery=self.discovery)
        if self.config.planner is PlannerPolicy.SLA:
            ttft, itl = args.planning.router_targets(
                self.mesh.router_ttft_slo_ms, self.mesh.router_itl_slo_ms
            )
            self.mesh = replace(self.mesh, router_ttft_slo_ms=ttft, router_itl_slo_ms=itl)
        self.pki: DevPki | None = None
        if self.config.tls:
            if args.tls.enabled:
                raise ConfigError(
                    "--tls generates the certificates; with your own (--tls-cert, --tls-key, "
                    "--tls-ca) leave --tls out"
                )
            self.pki = write_dev_pki(Path(tempfile.mkdtemp(prefix="kvmesh-tls-")), IDENTITIES)
            self.frontend = replace(
                self.frontend,
                http_tls_cert=str(self.pki.cert("kvmesh-frontend")),
                http_tls_key=str(self.pki.key("kvmesh-frontend")),
            )
        self.frontend_env: dict[str, str] = {}
        if self.frontend.api_key:
            # Keys reach the frontend in its environment, never on a command line (ps shows it).
            given = os.environ.get(API_KEY_ENV, "")
            keys = ",".join([*self.frontend.api_key, *given.split(",")])
            self.frontend_env[API_KEY_ENV] = keys
            self.frontend = replace(self.frontend, api_key=[])
        self.security = MeshSecurity.load(self.tls("kvmesh-up"))
        self.pools = {role: _Pool(role, n) for role, n in self.config.pool_sizes().items()}
        self.core_slots = max(1, sum(self.config.pool_sizes().values()))
        """Workers that share this machine's cores (the initial ones; CORE_SLOT_ENV)."""
        self._slot_of: dict[str, int] = {}
        self.others: list[Child] = []  # frontend (first), router
        self.registered: set[str] = set()
        self.addresses: dict[str, str] = {}
        """Worker instance id (its Child's name) -> the gRPC address it registered, kept while
        the process lives (a hung worker's lease expires too: watch_health)."""
        self.loads: dict[str, cpb.LoadMetrics] = {}
        """Workers' load metrics as last read (for the drain choice)."""
        self._applying: Role | None = None
        """The pool a Scale call is changing right now."""
        self._pid = os.getpid()

    def tls(self, identity: str) -> TlsConfig:
        """The mesh TLS settings of the process with `identity` (--tls: its own certificate;
        else what `up` was given)."""
        if self.pki is None:
            return self.args.tls
        return self.pki.config(identity, IDENTITIES)

    def worker_argv(
        self, role: Role, worker_id: str, slot: str = "worker-0", metrics_port: int = -1
    ) -> list[str]:
        """The command line of one worker (`slot`: its pool and index, naming its disk KV
        tier's directory under --kv-disk-dir; `metrics_port`: its /metrics, -1: none)."""
        worker = replace(self.worker, role=role, worker_id=worker_id, metrics_port=metrics_port)
        tiers = self.args.tiers
        if tiers.kv_disk_dir:
            tiers = replace(tiers, kv_disk_dir=str(Path(tiers.kv_disk_dir) / slot))
        tls = self.tls("kvmesh-worker")
        return kvmesh_argv(
            "worker", self.args.log, worker, tiers, self.args.engine, tls, self.args.tracing
        )

    def router_argv(self, port: int, metrics_port: int = -1) -> list[str]:
        """The command line of the standalone router (--router-process)."""
        router = replace(self.args.router, host="127.0.0.1", port=port, metrics_port=metrics_port)
        tls = self.tls("kvmesh-router")
        return kvmesh_argv("router", self.args.log, router, self.mesh, tls, self.args.tracing)

    def frontend_argv(self, router_address: str = "") -> list[str]:
        """The command line of the frontend."""
        mesh = replace(self.mesh, router_address=router_address)
        tls = self.tls("kvmesh-frontend")
        return kvmesh_argv("frontend", self.args.log, self.frontend, mesh, tls, self.args.tracing)

    @property
    def workers(self) -> list[Child]:
        """Every worker process of every pool."""
        return [w for pool in self.pools.values() for w in pool.children]

    def start_worker(self, role: Role = Role.AGGREGATED) -> None:
        pool = self.pools[role]
        i, pool.next_index = pool.next_index, pool.next_index + 1
        prefix = "worker" if role is Role.AGGREGATED else role.value
        wid = f"{prefix}-{i}-{self._pid}"
        metrics = free_port(self.worker.host)
        argv = self.worker_argv(role, wid, f"{prefix}-{i}", metrics)
        env = None
        if self.core_slots > 1:
            live = {self._slot_of.get(w.name) for w in self.workers if w.alive()}
            slot = next((k for k in range(self.core_slots) if k not in live), None)
            if slot is None:  # more workers than slots (Scale added some): share round-robin
                slot = len(self._slot_of) % self.core_slots
            self._slot_of[wid] = slot
            env = {CORE_SLOT_ENV: f"{slot}/{self.core_slots}"}
        pool.children.append(Child(wid, argv, f"{_reachable(self.worker.host)}:{metrics}", env=env))
        self.write_targets()

    def start(self) -> Child:
        """Start workers, router and frontend; returns the frontend."""
        for pool in self.pools.values():
            for _ in range(pool.target):
                self.start_worker(pool.role)
        router_address = ""
        if self.config.router_process:
            port, metrics = free_port("127.0.0.1"), free_port("127.0.0.1")
            self.others.append(
                Child("router", self.router_argv(port, metrics), f"127.0.0.1:{metrics}")
            )
            router_address = f"127.0.0.1:{port}"
        fe = self.frontend
        frontend = Child(
            "frontend",
            self.frontend_argv(router_address),
            f"{_reachable(fe.http_host)}:{fe.http_port}",
            env=self.frontend_env,
        )
        self.others.insert(0, frontend)
        self.write_targets()
        return frontend

    def metrics_endpoints(self) -> list[tuple[Child, str]]:
        """(process, its component) of every live process with a /metrics endpoint."""
        out = [(c, c.name) for c in self.others if c.metrics]
        for pool in self.pools.values():
            out += [(w, "worker") for w in pool.children if w.alive() and not w.draining]
        return out

    def write_targets(self) -> None:
        """Write --metrics-targets (a Prometheus file_sd list), if asked for, atomically."""
        path = self.config.metrics_targets
        if not path:
            return
        groups = []
        for child, component in self.metrics_endpoints():
            labels = {"component": component, "kvmesh_process": child.name}
            groups.append({"targets": [child.metrics], "labels": labels})
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(groups, f, indent=1)
        os.replace(tmp, path)

    # -- pool ----------------------------------------------------------------------------------

    def active(self, role: Role = Role.AGGREGATED) -> list[Child]:
        """Workers of `role` alive and not draining."""
        pool = self.pools.get(role)
        return pool.active() if pool is not None else []

    def pool(self, role: Role) -> _Pool:
        """The pool of `role`; InvalidRequest naming the pools when the mesh runs none."""
        pool = self.pools.get(role)
        if pool is None:
            raise InvalidRequest(
                f"this mesh runs no {role.value} pool (pools: "
                + ", ".join(r.value for r in self.pools)
                + ")",
                param="role",
            )
        return pool

    def check_scale(self, replicas: int, role: Role) -> _Pool:
        """The pool of `role`, if `replicas` is within every limit (else InvalidRequest)."""
        pool = self.pool(role)
        if not 0 <= replicas <= self.config.max_workers:
            raise InvalidRequest(
                f"replicas {replicas} is outside 0..{self.config.max_workers} (--max-workers)",
                param="replicas",
            )
        budget = self.config.max_total_workers
        total = replicas + sum(p.target for r, p in self.pools.items() if r is not role)
        if budget and total > budget:
            raise InvalidRequest(
                f"{total} workers over all pools would exceed --max-total-workers {budget}",
                param="replicas",
            )
        return pool

    async def scale(self, replicas: int, role: Role = Role.AGGREGATED) -> int:
        """Set a pool's target and start or drain workers now, all or nothing (see the module
        doc). Returns the previous target."""
        pool = self.check_scale(replicas, role)
        if self._applying is not None:
            raise Aborted(
                f"a Scale of the {self._applying.value} pool is still being applied; "
                "retry once it has returned"
            )
        self._applying = role
        try:
            if replicas < len(pool.active()):
                await self.refresh_loads(pool)  # the drain choice reads fresh cache sizes
            previous, pool.target = pool.target, replicas
            before = len(pool.children)
            try:
                self._converge(pool)
            except OSError as exc:  # a worker could not be started: undo this call
                started = pool.children[before:]
                del pool.children[before:]
                for child in started:
                    child.terminate()
                pool.target = previous
                raise Unavailable(
                    f"could not start a {role.value} worker ({exc}); the pool is unchanged"
                ) from None
            return previous
        finally:
            self._applying = None

    async def refresh_loads(self, pool: _Pool) -> None:
        """Read the load metrics (cached blocks, requests in flight) of the pool's registered
        workers; one that does not answer within LOAD_TIMEOUT_S counts as holding nothing."""

        async def read(child: Child) -> None:
            self.loads.pop(child.name, None)
            address = self.addresses.get(child.name)
            if address is None:
                return
            channel = mesh_channel(address, self.security)
            try:
                reply = await wpb_grpc.WorkerServiceStub(channel).GetLoadMetrics(
                    wpb.GetLoadMetricsRequest(), timeout=LOAD_TIMEOUT_S
                )
                self.loads[child.name] = reply.metrics
            except grpc.aio.AioRpcError:
                pass
            finally:
                await channel.close()

        await asyncio.gather(*(read(c) for c in pool.active()))

    def reconcile(self) -> None:
        """Reap exited workers, replace dead ones, drain extra ones, in every pool."""
        reaped = False
        for pool in self.pools.values():
            for w in [w for w in pool.children if not w.alive()]:
                pool.children.remove(w)
                self.loads.pop(w.name, None)
                reaped = True
                if not w.draining:
                    _crashed(pool, w)
            self._converge(pool)
        if reaped:  # (a crashed worker may be replaced only after its backoff)
            self.write_targets()

    def _converge(self, pool: _Pool) -> None:
        """Start or drain workers of `pool` until its active workers match its target."""
        active = pool.active()
        if time.monotonic() >= pool.restart_at:  # (crash-loop backoff: _crashed)
            for _ in range(pool.target - len(active)):
                self.start_worker(pool.role)
        extra = len(active) - pool.target
        if extra <= 0:
            return
        candidates = []
        for w in active:
            load = self.loads.get(w.name)
            candidates.append(
                DrainCandidate(
                    worker_id=w.name,
                    started=w.started,
                    serving=w.name in self.registered,
                    cached_blocks=device_cached_blocks(load) if load is not None else 0,
                    inflight=load.num_running_requests + load.num_waiting_requests
                    if load is not None
                    else 0,
                )
            )
        by_name = {w.name: w for w in active}
        for cand in drain_order(candidates)[:extra]:
            w = by_name[cand.worker_id]
            w.draining = True
            w.terminate()  # it leaves discovery, finishes its requests, exits
        self.write_targets()

    def pool_status(self, role: Role = Role.AGGREGATED) -> spb.PoolStatus:
        pool = self.pools[role]
        active = pool.active()
        ready = sum(1 for w in active if w.name in self.registered)
        return spb.PoolStatus(
            model=self.served,
            role=role_to_pb(role),
            target_replicas=pool.target,
            ready_replicas=ready,
            starting_replicas=len(active) - ready,
            draining_replicas=sum(1 for w in pool.children if w.alive() and w.draining),
        )

    async def watch_registrations(self) -> None:
        async for event in open_discovery(self.discovery).watch("worker"):
            name = event.instance.instance_id
            if event.kind is EventKind.ADDED:
                self.registered.add(name)
                self.addresses[name] = event.instance.address
            else:
                self.registered.discard(name)
                # The address stays known: a hung worker's lease expires too (watch_health).

    async def watch_health(self) -> None:
        """Kill workers that stop answering health checks (hung: stopped, deadlocked) so that
        `reconcile` replaces them: HUNG_FAILURES checks in a row, each HUNG_CHECK_S apart, not
        answered within HUNG_TIMEOUT_S. (Gateways eject such a worker from routing sooner and
        migrate its requests: kvmesh.router.pool.)"""
        channels: dict[str, grpc.aio.Channel] = {}
        failures: dict[str, int] = {}

        async def check(w: Child) -> None:
            channel = channels.get(w.name)
            if channel is None:
                channel = channels[w.name] = self.security.channel(self.addresses[w.name])
            try:
                await check_health(channel, HUNG_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                failures[w.name] = failures.get(w.name, 0) + 1
                if failures[w.name] >= HUNG_FAILURES and w.alive():
                    _say(f"{w.name} stopped answering health checks; killing it to replace it")
                    w.kill()
            else:
                failures[w.name] = 0

        try:
            while True:
                await asyncio.sleep(HUNG_CHECK_S)
                live = {
                    w.name: w
                    for w in self.workers
                    if w.alive() and not w.draining and w.name in self.addresses
                }
                for name in [n for n in channels if n not in live]:
                    failures.pop(name, None)
                    await channels.pop(name).close()
                alive = {w.name for w in self.workers}
                for name in [n for n in self.addresses if n not in alive]:
                    del self.addresses[name]
                await asyncio.gather(*(check(w) for w in live.values()))
        finally:
            for channel in channels.values():
                await channel.close()

    async def shutdown(self, forced: asyncio.Event) -> bool:
        """Stop every process: frontend first so no new work arrives, then everything else, each
        group asked to drain and killed `drain + STOP_MARGIN_S` later, or FORCE_GRACE_S after
        `forced` is set (a second Ctrl-C). Returns whether every process stopped on its own."""
        clean = True
        groups = [
            (self.others[:1], self.frontend.drain_timeout_s),
            (self.others[1:] + self.workers, self.worker.drain_timeout_s),
        ]
        try:
            for group, drain_s in groups:
                clean = await _stop_group(group, drain_s, forced) and clean
        finally:
            self.kill_all()
            if self.registry is not None:
                shutil.rmtree(self.registry, ignore_errors=True)
            if self.pki is not None:
                shutil.rmtree(self.pki.directory, ignore_errors=True)
        return clean

    def kill_all(self) -> None:
        """SIGKILL every child still alive (the last resort of every exit path)."""
        for c in (*self.others, *self.workers):
            c.kill()


def _crashed(pool: _Pool, w: Child) -> None:
    """Worker `w` of `pool` exited unasked: replace it, after a backoff if it crash-loops."""
    now = time.monotonic()
    lived = now - w.started
    if lived >= CRASH_WINDOW_S:
        pool.crashes = 0
        _say(f"{w.name} exited with {w.proc.returncode}; replacing it")
        return
    pool.crashes += 1
    delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (pool.crashes - 1))
    pool.restart_at = now + delay
    _say(
        f"{w.name} exited with {w.proc.returncode} {lived:.1f} s after it started; replacing it "
        f"in {delay:g} s"
    )


async def _stop_group(group: list[Child], drain_s: float, forced: asyncio.Event) -> bool:
    """Ask `group` to stop and wait (see Supervisor.shutdown); whether every one exited on its
    own with code 0."""
    for c in group:
        c.terminate()
    alive = [c for c in group if c.alive()]
    if not alive:
        return True
    waits = asyncio.gather(*(c.proc.wait() for c in alive))
    if not forced.is_set():
        _say(
            f"stopping: waiting up to {drain_s:g} s for {', '.join(c.name for c in alive)} to "
            "finish their requests (Ctrl-C again to force)"
        )
        force = asyncio.ensure_future(forced.wait())
        try:
            both: set[asyncio.Future[Any]] = {waits, force}
            await asyncio.wait(
                both, timeout=drain_s + STOP_MARGIN_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            force.cancel()
        if waits.done():  # all exited; a non-zero code: a drain timed out, requests were cut
            # (-SIGTERM: one still starting, killed by the request to stop before it could drain)
            return all(c.proc.returncode in (0, -signal.SIGTERM) for c in alive)
        if forced.is_set():
            _say("forced: ending every request now")
    alive = [c for c in alive if c.alive()]
    for c in alive:
        c.terminate()  # a second SIGTERM: stop draining, end what runs now
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(waits), FORCE_GRACE_S)
    killed = [c for c in alive if c.alive()]
    if killed:
        _say(f"{', '.join(c.name for c in killed)} did not exit in time; killing")
        for c in killed:
            c.kill()
    await waits
    return False


class ScalingServicer(spb_grpc.ScalingServiceServicer):
    """ScalingService over the local supervisor (its aggregated, or prefill and decode, pools)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    def _check(self, model: str) -> None:
        if model and model != self.sup.served:
            raise NotFound(f"this mesh serves {self.sup.served!r}, not {model!r}")

    def _role(self, role: int) -> Role:
        found = role_from_pb(role)
        if found is None:
            pools = ", ".join(cpb.WorkerRole.Name(role_to_pb(r)) for r in self.sup.pools)
            raise InvalidRequest(f"role must be one of this mesh's pools: {pools}", param="role")
        self.sup.pool(found)  # an unknown pool: InvalidRequest naming the pools
        return found

    async def Scale(
        self, request: spb.ScaleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> spb.ScaleResponse:
        self._check(request.model)
        role = self._role(request.role)
        previous = await self.sup.scale(request.replicas, role)
        if request.reason:
            _say(f"scaling {role.value} to {request.replicas} ({request.reason})")
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


def _ports_in_use(args: UpArgs) -> list[str]:
    """The ports given on the command line that something already listens on."""
    fe, up = args.frontend, args.up
    wanted = [
        ("--http-port", fe.http_host, fe.http_port),
        ("--kserve-grpc-port", fe.http_host, fe.kserve_grpc_port),
        ("--control-port", "127.0.0.1", up.control_port),
    ]
    taken = []
    for flag, host, port in wanted:
        if port <= 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                s.bind((host, port))
            except OSError as exc:
                taken.append(f"{flag} {port} on {host}: {exc.strerror}")
    return taken


class _Signals:
    """SIGINT/SIGTERM: the first asks to stop (`stop`), the second forces (`forced`)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.forced = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.forced if self.stop.is_set() else self.stop).set()


def planner_profile(args: UpArgs, served: str, context_length: int) -> PerfProfile | None:
    """The profile `--planner sla` plans with: --profile, or the mocker's measured in virtual
    time (its flags, speedup included); None for the queue policy."""
    if args.up.planner is not PlannerPolicy.SLA:
        return None
    if args.planning.profile:
        return PerfProfile.load(args.planning.profile)
    if args.worker.engine is not EngineKind.MOCKER:
        raise InvalidRequest(
            f"--planner sla with --engine {args.worker.engine.value} needs --profile FILE "
            "(kvmesh profile --engine ... makes one)"
        )
    engine = args.engine
    return profile_mocker(
        engine, max_model_len=engine.max_model_len or context_length, model=served
    )


async def _up(args: UpArgs) -> int:
    taken = _ports_in_use(args)
    if taken:
        _say("port in use: " + "; ".join(taken))
        return 1
    sup = Supervisor(args)
    profile = planner_profile(args, sup.served, sup.context_length)
    signals = _Signals()
    control = mesh_server("127.0.0.1", args.up.control_port, sup.security)
    control.add(
        spb_grpc.add_ScalingServiceServicer_to_server, ScalingServicer(sup), SCALING_SERVICE
    )
    watchers = [
        asyncio.create_task(sup.watch_registrations()),
        asyncio.create_task(sup.watch_health()),
    ]
    planners: list[tuple[PlannerLoop, asyncio.Task[None]]] = []
    try:
        code = await _serve(sup, control, signals.stop, profile, planners)
    finally:
        try:
            signals.stop.set()  # (ends the planner; a signal from now on forces)
            for planner, task in planners:
                await task
                await planner.close()
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            await control.stop(0)
        finally:
            clean = await sup.shutdown(signals.forced)
    _say("stopped" if clean else "stopped (some processes had to be forced)")
    return code if clean else code or 1


async def _serve(
    sup: Supervisor,
    control: GrpcServer,
    stop: asyncio.Event,
    profile: PerfProfile | None,
    planners: list[tuple[PlannerLoop, asyncio.Task[None]]],
) -> int:
    """Start the mesh, print the banner once it is healthy, run the planner (`planners` gets
    it), keep the pools at their targets until `stop`; the exit code."""
    frontend = sup.start()
    await control.start()
    fe = sup.frontend
    host = "127.0.0.1" if fe.http_host in ("0.0.0.0", "::") else fe.http_host
    scheme = "https" if fe.http_tls_cert else "http"
    base = f"{scheme}://{host}:{fe.http_port}"
    ssl_context: ssl.SSLContext | bool = True
    if sup.pki is not None:
        ssl_context = ssl.create_default_context(cafile=str(sup.pki.ca))
    elif fe.http_tls_cert:
        ssl_context = False  # the operator's certificate: up only asks for /health
    why = await _wait_healthy(sup, base, stop, aiohttp.TCPConnector(ssl=ssl_context))
    if why:
        _say(f"mesh did not become healthy ({why})")
        return 1
    kserve = f"{host}:{fe.kserve_grpc_port}" if fe.kserve_grpc_port > 0 else ""
    _banner(base, sup, control.address, kserve)
    config = sup.config
    if config.planner is not None:
        planner = PlannerLoop(
            sup.args.planning,
            config.planner,
            MetricsScraper(frontend_urls=[base + "/metrics"], model=sup.served),
            GrpcConnector(control.address, sup.served, security=sup.security),
            profile,
        )
        planners.append((planner, asyncio.create_task(planner.run(stop))))
        _say(f"{config.planner.value} planner every {sup.args.planning.adjustment_interval_s:g} s")
    while not stop.is_set():
        if not frontend.alive():
            _say("the frontend exited; shutting down")
            return 1
        sup.reconcile()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return 0


async def _wait_healthy(
    sup: Supervisor, base: str, stop: asyncio.Event, connector: aiohttp.TCPConnector
) -> str:
    """Wait until the frontend answers /health; '' or why it did not (a frontend or router that
    exited, a pool crash-looping, Ctrl-C, --startup-timeout-s). Workers that exit meanwhile are
    replaced."""
    deadline = time.monotonic() + sup.config.startup_timeout_s
    async with aiohttp.ClientSession(connector=connector) as http:
        while True:
            dead = [c.name for c in sup.others if not c.alive()]
            if dead:
                return f"{', '.join(dead)} exited"
            if await _healthy(http, base + "/health") and sup.others[0].alive():
                return ""
            sup.reconcile()
            looping = [p.role.value for p in sup.pools.values() if p.crashes >= STARTUP_CRASHES]
            if looping:
                return f"{', '.join(looping)} workers keep exiting at start-up; see their log"
            if stop.is_set():
                return "interrupted"
            if time.monotonic() > deadline:
                return "timed out"
            await asyncio.sleep(0.2)


def main(ns: argparse.Namespace) -> int:
    """`kvmesh up`: run the mesh until interrupted; returns the process exit code."""
    code = run(_up(UpArgs.from_args(ns)))
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout is a pipe nobody reads any more: exit quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


ENTRY = Entry(
    "up", "frontend, optional router and N workers on this machine (no etcd)", _flags(), main
)


def _banner(base: str, sup: Supervisor, control: str, kserve: str) -> None:
    body = json.dumps(
        {
            "model": sup.served,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
            "stream": True,
        }
    )
    config = sup.config
    cacert = f"--cacert {sup.pki.ca} " if sup.pki is not None else ""
    keyed = sup.frontend_env or os.environ.get(API_KEY_ENV)
    auth = '-H "Authorization: Bearer $KVMESH_API_KEY" ' if keyed else ""
    metrics = "\n               ".join(
        f"http://{c.metrics}/metrics ({c.name})" for c, _ in sup.metrics_endpoints()
    )
    if config.metrics_targets:
        metrics += f"\n               Prometheus file_sd targets: {config.metrics_targets}"
    pools = ", ".join(f"{n} {role.value}" for role, n in config.pool_sizes().items())
    router = sup.mesh.router_mode.value + (" (own process)" if config.router_process else "")
    with contextlib.suppress(OSError, ValueError):  # stdout gone: keep serving
        print(
            f"\nkvmesh is up: {sup.worker.engine.value} workers ({pools}), router {router}\n"
            f"  OpenAI API : {base}/v1   (model {sup.served!r})\n"
            f"  health     : {base}/health\n"
            f"  metrics    : {metrics}\n"
            f"  KServe v2  : {base}/v2 (REST)"
            + (f"   grpc {kserve} (inference.GRPCInferenceService)" if kserve else "")
            + "\n"
            f"  scaling    : grpc {control}  (kvmesh.api.scaling.v1.ScalingService/Scale)\n"
            + (
                f"  CA         : {sup.pki.ca} (throwaway, deleted on exit; the planner's "
                f"certificate: {sup.pki.cert('kvmesh-planner')}, key "
                f"{sup.pki.key('kvmesh-planner')})\n"
                if sup.pki
                else ""
            )
            + f"\n  curl -N {cacert}{base}/v1/chat/completions {auth}\\\n"
            "       -H 'Content-Type: application/json' \\\n"
            f"       -d '{body}'\n\n"
            "Press Ctrl-C to stop.\n",
            flush=True,
        )
