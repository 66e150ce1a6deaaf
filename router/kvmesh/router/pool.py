"""The set of live workers, fed by discovery, with one gRPC channel per worker.

Routers pick from it; the gateway's backend calls the picked worker through it. Listeners
(e.g. the KV index, which subscribes to each worker's event stream) hear about joins and
leaves.

Health (`HealthConfig`): discovery only notices a worker that died when its lease ends, and
never one that hangs (a stopped process keeps its connections open). So each worker is also
checked here, as Envoy's active health checks and outlier detection do: every interval a worker
that has shown no sign of life (no output on a stream with requests in flight, or no traffic at
all) gets a canary, the standard `grpc.health.v1` Check with a deadline. After
`health_check_failures` consecutive failures it is ejected: routers skip it, readiness stops
counting it, and its stream is abandoned, so its requests fail with WorkerLost and the backend
migrates them. One answered check readmits it. A worker that answers NOT_SERVING is draining: no
new requests go to it, and its requests in flight finish there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.session import WorkerSession
from kvmesh.runtime import wire
from kvmesh.runtime.config import opt
from kvmesh.runtime.discovery import WORKER, Discovery, EventKind, Instance
from kvmesh.runtime.grpcutil import MeshSecurity, check_health, mesh_channel
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.types import ModelInfo

log = logging.getLogger(__name__)

# In-flight calls on a removed worker get this long to finish before the channel is closed
# (a draining worker deregisters first and then finishes its requests).
REMOVED_CHANNEL_GRACE_S = 120.0

# How long a worker that failed to answer is avoided (about one discovery lease: by then it
# has either answered again or left discovery).
DOWN_S = 5.0


@dataclass
class HealthConfig:
    """How a frontend or router checks its workers and how much it sends each."""

    health_check_interval_s: float = opt(
        1.0,
        "a worker that showed no sign of life for this long (no output while requests are in "
        "flight, or idle) gets a health check (grpc.health.v1 Check); 0: no health checks",
    )
    health_check_timeout_s: float = opt(2.0, "a health check not answered within this long fails")
    health_check_failures: int = opt(
        2,
        "consecutive failed health checks that eject a worker from routing (its requests in "
        "flight are migrated); one answered check readmits it",
    )
    max_inflight_per_worker: int = opt(
        -1,
        "requests this process keeps in flight on one worker (prefill workers excepted); more "
        "wait in the admission queue. -1: the worker's max_num_seqs (its batch size), 0: no limit",
    )
    gateway_replicas: int = opt(
        1,
        "gateways sharing each worker's in-flight limit (--max-inflight-per-worker, or "
        "max_num_seqs): each keeps its share, rounded up. --gateway-processes sets it for its "
        "processes; set it to the number of gateway replicas (times their processes) in front "
        "of one pool",
    )

    def __post_init__(self) -> None:
        if self.health_check_interval_s < 0 or not self.health_check_timeout_s > 0:
            raise ValueError("health_check_interval_s must be >= 0, health_check_timeout_s > 0")
        if self.health_check_failures < 1:
            raise ValueError("health_check_failures must be >= 1")
        if self.max_inflight_per_worker < -1:
            raise ValueError("max_inflight_per_worker must be >= -1")
        if self.gateway_replicas < 1:
            raise ValueError("gateway_replicas must be >= 1")

    def inflight_limit(self, info: ModelInfo) -> int:
        """This gateway's in-flight limit on a worker with card `info` (0: none): its share of
        the worker's, rounded up."""
        limit = self.max_inflight_per_worker
        if limit == -1:
            limit = info.max_num_seqs
        return -(-limit // self.gateway_replicas)


@dataclass(eq=False)
class WorkerHandle:
    """A live worker: identity, model card, client stub and the gateway's view of its load."""

    instance_id: str
    worker_id: str
    address: str
    info: ModelInfo
    channel: grpc.aio.Channel
    stub: wpb_grpc.WorkerServiceAsyncStub
    session: WorkerSession
    """The multiplexed Generate stream the gateway uses."""
    inflight: int = 0
    """Requests this process has in flight on the worker."""
    down_until: float = 0.0
    """Monotonic time until which routers avoid this worker: it failed to answer (it may
    have died; discovery removes it when its lease expires), or (inf) health checks ejected it
    or found it draining. 0: healthy."""
    max_inflight: int = 0
    """Most requests routers book on it from this process (HealthConfig.inflight_limit); 0: no
    limit."""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Neither ejected by health checks nor draining (it may have failed a request lately)."""
        return self.down_until != float("inf")


Listener = Callable[[WorkerHandle, bool], None]
"""Called with (worker, joined) when a worker joins (True) or leaves (False)."""


class WorkerPool:
    """Tracks workers announced by discovery; a worker joins once its model card is read.

    `security`: how this process's mesh clients authenticate (mTLS, the mesh token or none):
    the channels to workers, and those of routers built on this pool (a standalone router,
    router peers)."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        card_timeout_s: float = 5.0,
        health: HealthConfig | None = None,
        security: MeshSecurity | None = None,
    ) -> None:
        self.discovery = discovery
        """Where workers (and router replicas: kvmesh.router.kv_subscriber.PeerLoadSync) are
        found."""
        self.security = security
        self._card_timeout_s = card_timeout_s
        self.health = health if health is not None else HealthConfig()
        self._checks: dict[str, asyncio.Task[None]] = {}
        self.ejections = 0
        """Workers ejected by health checks so far."""
        self._workers: dict[str, WorkerHandle] = {}
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._retiring = TaskSet()

    def add_listener(self, listener: Listener) -> None:
        """Hear about joins and leaves (current workers are replayed as joins)."""
        self._listeners.append(listener)
        for w in self._workers.values():
            listener(w, True)

    async def start(self) -> None:
        """Start watching discovery."""
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="worker-pool-watch")

    async def stop(self) -> None:
        """Stop watching and close every channel."""
        tasks = [
            t
            for t in (self._task, *self._pending.values(), *self._checks.values())
            if t is not None
        ]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        for w in list(self._workers.values()):
            self._drop(w.instance_id)
        await self._retiring.cancel()

    def workers(self, model: str | None = None) -> list[WorkerHandle]:
        """Live workers, optionally only those serving `model`."""
        if model is None:
            return list(self._workers.values())
        return [w for w in self._workers.values() if w.info.served_model_name == model]

    @staticmethod
    def mark_down(handle: WorkerHandle, seconds: float = DOWN_S) -> None:
        """Avoid `handle` for `seconds` (it failed to answer); routers skip it meanwhile unless
        no other worker is left."""
        handle.down_until = max(handle.down_until, time.monotonic() + seconds)

    def models(self) -> dict[str, ModelInfo]:
        """Served model name -> the model card of one of its workers."""
        return {w.info.served_model_name: w.info for w in self._workers.values()}

    def adapters(self) -> dict[str, ModelInfo]:
        """LoRA adapter name -> the model card of one worker that has it loaded."""
        return {a: w.info for w in self._workers.values() for a in w.info.lora_adapters}

    def update_card(self, handle: WorkerHandle, info: ModelInfo) -> None:
        """A live worker's card changed (a LoRA adapter was loaded or unloaded through it)."""
        if self._workers.get(handle.instance_id) is handle:
            handle.info = info

    async def watch_workers(self) -> AsyncGenerator[list[WorkerHandle], None]:
        """The live workers now, then again after every join or leave."""
        while True:
            self._changed.clear()
            yield self.workers()
            await self._changed.wait()

    async def wait_for(self, count: int, timeout_s: float = 30.0) -> None:
        """Wait until at least `count` workers are live."""
        async with asyncio.timeout(timeout_s):
            while len(self._workers) < count:
                self._changed.clear()
                await self._changed.wait()

    async def _watch(self) -> None:
        async for event in self.discovery.watch(WORKER):
            iid = event.instance.instance_id
            if event.kind is EventKind.ADDED:
                self._drop(iid)
                self._pending[iid] = asyncio.create_task(self._join(event.instance))
            else:
                self._drop(iid)

    async def _join(self, inst: Instance) -> None:
        channel = mesh_channel(inst.address, self.security)
        stub = wpb_grpc.WorkerServiceStub(channel)
        delay = 0.05
        try:
            while True:
                try:
                    card = await stub.GetModelCard(
                        wpb.GetModelCardRequest(), timeout=self._card_timeout_s
                    )
                    break
                except grpc.aio.AioRpcError as exc:
                    log.debug("worker %s at %s not ready: %s", inst.instance_id, inst.address, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
        except asyncio.CancelledError:
            await channel.close()
            raise
        info = wire.card_from_pb(card.card)
        handle = WorkerHandle(
            instance_id=inst.instance_id,
            worker_id=card.worker_id or inst.instance_id,
            address=inst.address,
            info=info,
            channel=channel,
            stub=stub,
            session=WorkerSession(stub, inst.address),
            max_inflight=self.health.inflight_limit(info),
        )
        self._pending.pop(inst.instance_id, None)
        self._workers[inst.instance_id] = handle
        if self.health.health_check_interval_s > 0:
            self._checks[inst.instance_id] = asyncio.get_running_loop().create_task(
                self._check(handle), name=f"health-{handle.worker_id}"
            )
        log.info("worker %s joined (%s, %s)", handle.worker_id, handle.address, handle.info.engine)
        self._notify(handle, True)

    def _drop(self, instance_id: str) -> None:
        pending = self._pending.pop(instance_id, None)
        if pending is not None:
            pending.cancel()
        check = self._checks.pop(instance_id, None)
        if check is not None:
            check.cancel()
        handle = self._workers.pop(instance_id, None)
        if handle is None:
            return
        log.info("worker %s left", handle.worker_id)
        self._notify(handle, False)
        self._retiring.spawn(self._retire(handle))

    async def _check(self, handle: WorkerHandle) -> None:
        """Health-check `handle` until it leaves (see the module docstring)."""
        cfg = self.health
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            await asyncio.sleep(cfg.health_check_interval_s)
            session = handle.session
            if session.inflight and session.idle_for(loop.time()) < cfg.health_check_interval_s:
                failures = 0  # output is flowing: alive
                if handle.down_until == float("inf"):
                    self._readmit(handle)
                continue
            try:
                serving = await check_health(handle.channel, cfg.health_check_timeout_s)
            except grpc.aio.AioRpcError as exc:
                failures += 1
                if failures >= cfg.health_check_failures:
                    self._eject(handle, f"{failures} health checks failed ({exc.code().name})")
                continue
            failures = 0
            if serving:
                if handle.down_until == float("inf"):
                    self._readmit(handle)
            elif handle.down_until != float("inf"):
                log.info("worker %s is draining: no new requests go to it", handle.worker_id)
                handle.down_until = float("inf")

    def _eject(self, handle: WorkerHandle, why: str) -> None:
        """Take `handle` out of routing (if it is not out yet) and abandon its requests."""
        if handle.down_until != float("inf"):
            self.ejections += 1
            handle.down_until = float("inf")
            log.warning("worker %s ejected: %s; migrating its requests", handle.worker_id, why)
            self._changed.set()
        handle.session.abandon(f"ejected: {why}")

    def _readmit(self, handle: WorkerHandle) -> None:
        log.info("worker %s answers again: readmitted", handle.worker_id)
        handle.down_until = 0.0
        self._changed.set()

    @staticmethod
    async def _retire(handle: WorkerHandle) -> None:
        """Let in-flight requests on a departed worker finish, then close its channel."""
        deadline = asyncio.get_running_loop().time() + REMOVED_CHANNEL_GRACE_S
        while handle.session.inflight and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await handle.session.close()
        await handle.channel.close(None)

    def _notify(self, handle: WorkerHandle, joined: bool) -> None:
        self._changed.set()
        for listener in self._listeners:
            try:
                listener(handle, joined)
            except Exception:
                log.exception("worker pool listener failed")
