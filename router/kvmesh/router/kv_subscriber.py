"""The router's live feeds: every worker's KV events and load metrics, and peer replicas' load.

`KvSubscriber` follows, for each worker the pool announces, its `SubscribeKvEvents` stream into
the scheduler's KvIndexer and its `StreamLoadMetrics` stream into the scheduler's load
correction:
  * a new subscription starts with a snapshot; a transient error resubscribes with the last
    event id and log id, so the worker replays its backlog (or sends a fresh snapshot when the
    backlog is gone or the worker restarted);
  * a gap (an event id that does not follow) resubscribes without a resume point: a full
    resync, whose snapshot replaces the worker's entries atomically;
  * when the stream fails twice in a row the worker's entries leave the index until a new
    snapshot arrives (a dead stream must not keep attracting requests);
  * an engine without KV events (UNIMPLEMENTED, or no KV_EVENTS capability in its model card)
    is routed in approximate mode;
  * events on every tier (device, host, disk) feed the index, which keeps presence per tier;
    events on tiers or of kinds this version does not know are left out: counted in `skipped`,
    logged once per worker and reason;
  * each worker's last load metrics are kept in `loads` (LoadInfo, with its per-tier KV
    counters) for whoever exports them (kvmesh.runtime.kv_metrics on a frontend's /metrics);
  * a worker that leaves the pool has its streams cancelled and leaves the index at once.

`PeerLoadSync` follows other router replicas' `SubscribeLoadEvents` streams and applies their
bookings to the scheduler, so every replica costs workers with the whole fleet's predicted load.
A peer whose stream ends has its bookings dropped; its next stream starts from its active ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.router.v1 import router_service_pb2 as rpb
from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.router.kv_scheduler import KvScheduler, LoadEvent, LoadEventKind, LoadSample
from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.runtime import wire
from kvmesh.runtime.clock import Clock, RealClock
from kvmesh.runtime.discovery import ROUTER, Discovery, EventKind
from kvmesh.runtime.grpcutil import MeshSecurity, mesh_channel
from kvmesh.runtime.kv_events import KvEventGap, SnapshotChunk
from kvmesh.runtime.types import LoadInfo

__all__ = [
    "KvSubscriber",
    "PeerLoadSync",
    "load_event_from_pb",
    "load_event_to_pb",
    "sample_from_pb",
]

log = logging.getLogger(__name__)

KV_EVENTS_CAPABILITY = "KV_EVENTS"

_KIND_TO_STATE = {
    LoadEventKind.BOOKED: rpb.REQUEST_STATE_UNSPECIFIED,
    LoadEventKind.FIRST_TOKEN: rpb.REQUEST_STATE_FIRST_TOKEN,
    LoadEventKind.FREED: rpb.REQUEST_STATE_FINISHED,
}


def sample_from_pb(m: cpb.LoadMetrics) -> LoadSample:
    """LoadMetrics -> LoadSample."""
    return LoadSample(
        kv_active_blocks=m.kv_active_blocks,
        kv_total_blocks=m.kv_total_blocks,
        num_running=m.num_running_requests,
        num_waiting=m.num_waiting_requests,
        pending_prefill_tokens=m.pending_prefill_tokens,
        draining=m.draining,
    )


def load_event_to_pb(event: LoadEvent) -> rpb.SubscribeLoadEventsResponse:
    """LoadEvent -> SubscribeLoadEventsResponse."""
    return rpb.SubscribeLoadEventsResponse(
        router_id=event.router_id,
        request_id=event.request_id,
        worker_id=event.worker_id,
        state=_KIND_TO_STATE[event.kind],
        prefill_blocks=event.prefill_blocks,
        decode_blocks=event.decode_blocks,
    )


def load_event_from_pb(msg: rpb.SubscribeLoadEventsResponse) -> LoadEvent:
    """SubscribeLoadEventsResponse -> LoadEvent (FINISHED and CANCELLED both free)."""
    if msg.state == rpb.REQUEST_STATE_UNSPECIFIED:
        kind = LoadEventKind.BOOKED
    elif msg.state == rpb.REQUEST_STATE_FIRST_TOKEN:
        kind = LoadEventKind.FIRST_TOKEN
    else:
        kind = LoadEventKind.FREED
    return LoadEvent(
        msg.router_id, msg.request_id, msg.worker_id, kind, msg.prefill_blocks, msg.decode_blocks
    )


class _Backoff:
    """Exponential retry delay, reset after progress."""

    __slots__ = ("delay", "initial_s", "max_s")

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.delay = initial_s

    def reset(self) -> None:
        self.delay = self.initial_s

    def next(self) -> float:
        delay = self.delay
        self.delay = min(self.delay * 2, self.max_s)
        return delay


class _Tasks:
    """Background tasks that are cancelled and awaited together; failures are logged."""

    def __init__(self) -> None:
        self._all: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._all.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._all.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._all)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


class KvSubscriber:
    """Follows the KV event and load streams of the pool's workers (see the module doc).

    `add(handle)` (a worker joined) and `remove(handle)` (it left) are synchronous and must run
    on the event loop (the WorkerPool calls its listeners there); `close()` ends everything.
    """

    def __init__(
        self,
        scheduler: KvScheduler,
        *,
        clock: Clock | None = None,
        load_interval_ms: int = 100,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
    ) -> None:
        self.scheduler = scheduler
        self.clock: Clock = clock if clock is not None else RealClock()
        self.load_interval_ms = load_interval_ms
        self._retry = (retry_initial_s, retry_max_s)
        self._followed: dict[str, tuple[WorkerHandle, list[asyncio.Task[None]]]] = {}
        self._tasks = _Tasks()
        self.skipped: Counter[tuple[str, str]] = Counter()
        """KV stream items left out of the index, by (worker id, reason): blocks stored in or
        removed from a tier this version does not know, unknown event kinds."""
        self.loads: dict[str, LoadInfo] = {}
        """Each followed worker's last load metrics."""

    def add(self, handle: WorkerHandle) -> None:
        """Register the worker with the scheduler and follow its streams."""
        wid = handle.worker_id
        old = self._followed.pop(wid, None)
        if old is not None:
            for t in old[1]:
                t.cancel()
        info = handle.info
        exact = KV_EVENTS_CAPABILITY in info.capabilities
        self.scheduler.add_worker(
            wid,
            block_size=max(1, info.kv_block_size),
            kv_total_blocks=info.kv_total_blocks,
            kv_events=exact,
            max_num_seqs=info.max_num_seqs,
        )
        tasks = [self._tasks.spawn(self._follow_load(handle), f"load-metrics-{wid}")]
        if exact:
            tasks.append(self._tasks.spawn(self._follow_kv(handle), f"kv-events-{wid}"))
        self._followed[wid] = (handle, tasks)

    def remove(self, handle: WorkerHandle) -> None:
        """Stop following the worker and drop it from the index and the load sums."""
        entry = self._followed.get(handle.worker_id)
        if entry is None or entry[0] is not handle:
            return  # a newer registration of the same worker id is being followed
        del self._followed[handle.worker_id]
        self.loads.pop(handle.worker_id, None)
        for t in entry[1]:
            t.cancel()
        self.scheduler.remove_worker(handle.worker_id)

    def followed(self) -> list[str]:
        """Ids of the workers being followed."""
        return list(self._followed)

    async def close(self) -> None:
        """Cancel every stream."""
        self._followed.clear()
        await self._tasks.close()

    async def _follow_kv(self, handle: WorkerHandle) -> None:
        wid = handle.worker_id
        indexer = self.scheduler.indexer
        backoff = _Backoff(*self._retry)
        failures = 0
        while True:
            request = wpb.SubscribeKvEventsRequest()
            resume = indexer.resume_point(wid)
            if resume is not None:
                request.resume_after_event_id, request.resume_log_id = resume
            call = handle.stub.SubscribeKvEvents(request)
            try:
                async for msg in call:
                    item = wire.kv_item_from_pb(msg)
                    if isinstance(item, wire.SkippedKvEvent):
                        self._skipped(wid, item.reason)
                    elif isinstance(item, SnapshotChunk):
                        for _ in range(len(msg.snapshot.chains) - len(item.chains)):
                            self._skipped(wid, "snapshot chain on an unknown tier")
                    indexer.apply(wid, item, msg.snapshot.log_id)
                    if failures:
                        failures = 0
                        backoff.reset()
                        handle.down_until = 0.0
                failures += 1  # the worker ended the stream: reconnect
            except KvEventGap as exc:
                log.warning("KV events of %s: %s; resyncing from a snapshot", wid, exc)
                indexer.reset_stream(wid)
                failures += 1
                if failures < 3:
                    continue  # at once: the snapshot comes with the new subscription
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s publishes no KV events: approximate routing", wid)
                    self.scheduler.set_kv_events(wid, False)
                    return
                failures += 1
                log.debug("KV event stream of %s failed: %s", wid, exc.code())
            finally:
                call.cancel()
            if failures >= 2:
                indexer.clear_worker(wid)  # the stream looks dead: stop trusting its blocks
                WorkerPool.mark_down(handle)  # and stop routing to it until it answers again
            await self.clock.sleep(backoff.next())

    def _skipped(self, worker_id: str, reason: str) -> None:
        """Count a KV event left out of the index; say so once per worker and reason."""
        key = (worker_id, reason)
        self.skipped[key] += 1
        if self.skipped[key] == 1:
            log.warning(
                "KV events of %s: leaving out events %s (the router indexes the device, host "
                "and disk tiers); counted in KvSubscriber.skipped",
                worker_id,
                reason,
            )
        else:
            log.debug("KV events of %s: left out an event %s", worker_id, reason)

    async def _follow_load(self, handle: WorkerHandle) -> None:
        wid = handle.worker_id
        backoff = _Backoff(*self._retry)
        request = wpb.StreamLoadMetricsRequest(interval_ms=self.load_interval_ms)
        while True:
            call = handle.stub.StreamLoadMetrics(request)
            try:
                async for msg in call:
                    self.scheduler.update_load(wid, sample_from_pb(msg.metrics), self.clock.now())
                    if wid in self._followed:
                        self.loads[wid] = wire.load_from_pb(msg.metrics)
                    backoff.reset()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
                log.debug("load metrics stream of %s failed: %s", wid, exc.code())
            finally:
                call.cancel()
            await self.clock.sleep(backoff.next())


class PeerLoadSync:
    """Applies the bookings of peer router replicas (their SubscribeLoadEventBatches streams):
    the `peers` given, and with `discovery` every KV router registered there (component
    ROUTER) but this one, followed while it stays registered."""

    def __init__(
        self,
        scheduler: KvScheduler,
        peers: Sequence[str],
        *,
        clock: Clock | None = None,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
        security: MeshSecurity | None = None,
        discovery: Discovery | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.security = security
        self.peers = list(peers)
        self.discovery = discovery
        self.clock: Clock = clock if clock is not None else RealClock()
        self._retry = (retry_initial_s, retry_max_s)
        self._tasks = _Tasks()
        self._started = False
        self.following: dict[str, asyncio.Task[None]] = {}
        """Peers followed now (given, or registered in discovery), by address."""
        self.connected: set[str] = set()
        """Peers whose stream is open now."""

    def start(self) -> None:
        """Start following every peer (idempotent; needs a running event loop)."""
        if self._started:
            return
        self._started = True
        for address in self.peers:
            self._add(address)
        if self.discovery is not None:
            self._tasks.spawn(self._watch(self.discovery), "peer-discovery")

    def _add(self, address: str) -> None:
        if address not in self.following:
            self.following[address] = self._tasks.spawn(
                self._follow(address), f"peer-load-{address}"
            )

    async def _watch(self, discovery: Discovery) -> None:
        """Follow the routers registered in discovery, each while it stays registered."""
        given = set(self.peers)
        async for event in discovery.watch(ROUTER):
            instance = event.instance
            address = instance.address
            if instance.instance_id == self.scheduler.router_id or address in given:
                continue
            if event.kind is EventKind.ADDED:
                self._add(address)
            else:
                task = self.following.pop(address, None)
                if task is not None:  # its stream's end drops the peer's bookings
                    task.cancel()

    async def close(self) -> None:
        """Stop following peers and forget their bookings."""
        await self._tasks.close()
        for address in self.following:
            self.scheduler.drop_peer(self._source(address))
        self.following.clear()
        self._started = False

    def bookings(self) -> int:
        """Bookings held for the peers now."""
        return sum(self.scheduler.num_bookings(self._source(a)) for a in self.following)

    @staticmethod
    def _source(address: str) -> str:
        return f"peer:{address}"

    async def _follow(self, address: str) -> None:
        source = self._source(address)
        backoff = _Backoff(*self._retry)
        own_id = self.scheduler.router_id
        channel = mesh_channel(address, self.security)
        stub = rpb_grpc.RouterServiceStub(channel)
        batched = True  # until the peer says it has only the one-event stream (an older one)
        try:
            while True:
                call: Any
                if batched:
                    call = stub.SubscribeLoadEventBatches(
                        rpb.SubscribeLoadEventBatchesRequest(subscriber_id=own_id)
                    )
                else:
                    call = stub.SubscribeLoadEvents(
                        rpb.SubscribeLoadEventsRequest(subscriber_id=own_id)
                    )
                try:
                    await call.wait_for_connection()
                    self.connected.add(address)
                    backoff.reset()
                    async for msg in call:
                        now = self.clock.now()
                        for pb in msg.events if batched else (msg,):
                            event = load_event_from_pb(pb)
                            if event.router_id != own_id:
                                self.scheduler.apply_peer(source, event, now)
                except grpc.aio.AioRpcError as exc:
                    if batched and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        batched = False
                        self.connected.discard(address)
                        continue
                    log.debug("load events of peer %s failed: %s", address, exc.code())
                finally:
                    call.cancel()
                    self.connected.discard(address)
                    self.scheduler.drop_peer(source)
                await self.clock.sleep(backoff.next())
        finally:
            await channel.close()
