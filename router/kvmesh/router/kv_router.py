"""`KvRouter` implements kvmesh.router.routing.Router over a WorkerPool: it registers the pool's
workers with the scheduler, subscribes to their KV event and load streams
(kvmesh.router.kv_subscriber), optionally shares its bookings with peer router replicas, and
records the routing overhead (tokens in hand -> worker chosen) in `stats`.

The scheduling policy itself (index, predicted load, cost) is kvmesh.router.kv_scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Collection, Sequence

from kvmesh.router.kv_scheduler import (
    KvRouterConfig,
    KvScheduler,
    LoadEvent,
    LoadEventKind,
    LoadSample,
    Selection,
    WorkerLoad,
)
from kvmesh.router.kv_subscriber import KvSubscriber, PeerLoadSync
from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.router.routing import RouteDecision, RouterMode, RoutingStats, pick_candidates
from kvmesh.runtime.clock import Clock, RealClock
from kvmesh.runtime.discovery import ROUTER, Instance, Registration, register_in_background
from kvmesh.runtime.types import Role

__all__ = [
    "KvRouter",
    "KvRouterConfig",
    "KvScheduler",
    "LoadEvent",
    "LoadEventKind",
    "LoadSample",
    "Selection",
    "WorkerLoad",
]

log = logging.getLogger(__name__)

LOAD_EVENT_BATCH = 1024
"""Most booking changes sent to a peer replica in one message."""


class KvRouter:
    """The Router (kvmesh.router.routing) for RouterMode.KV over a WorkerPool.

    Construction registers a pool listener: every worker that joins is added to the scheduler
    (exact mode when its model card lists the KV_EVENTS capability, approximate mode
    otherwise) and its KV event and load streams are followed (KvSubscriber); a worker that
    leaves is removed from the index at once. `peers`: addresses of other router replicas whose
    bookings this one applies (RouterService.SubscribeLoadEventBatches); `peer_discovery`: also
    every replica registered in the pool's discovery (PeerLoadSync). Call `close()` when done
    (pool.stop() also ends the per-worker streams).
    """

    def __init__(
        self,
        pool: WorkerPool,
        config: KvRouterConfig | None = None,
        *,
        clock: Clock | None = None,
        peers: Sequence[str] = (),
        peer_discovery: bool = False,
        router_id: str = "",
        load_interval_ms: int = 100,
    ) -> None:
        self.pool = pool
        self.clock: Clock = clock if clock is not None else RealClock()
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.scheduler = KvScheduler(config, router_id=self.router_id)
        self.stats = RoutingStats(policy=RouterMode.KV.value)
        self.subscriber = KvSubscriber(
            self.scheduler, clock=self.clock, load_interval_ms=load_interval_ms
        )
        self.peer_sync = (
            PeerLoadSync(
                self.scheduler,
                peers,
                clock=self.clock,
                security=pool.security,
                discovery=pool.discovery if peer_discovery else None,
            )
            if peers or peer_discovery
            else None
        )
        self._booked: dict[str, WorkerHandle] = {}
        pool.add_listener(self._on_pool_change)

    def _on_pool_change(self, handle: WorkerHandle, joined: bool) -> None:
        if joined:
            self.subscriber.add(handle)
            if self.peer_sync is not None:
                self.peer_sync.start()
        else:
            self.subscriber.remove(handle)

    def register(self, address: str) -> Registration:
        """Announce, in the pool's discovery, that this router serves its bookings at `address`
        (RouterService), for replicas with peer discovery; close the registration to leave.
        Made in the background while discovery cannot take it (etcd down): the router serves
        meanwhile, its peers find it once it is registered."""
        instance = Instance(instance_id=self.router_id, address=address, component=ROUTER)
        return register_in_background(self.pool.discovery, instance)

    async def start(self) -> None:
        """Start peer load sharing now (otherwise it starts with the first worker)."""
        if self.peer_sync is not None:
            self.peer_sync.start()

    async def close(self) -> None:
        """Stop following workers and peers."""
        await self.subscriber.close()
        if self.peer_sync is not None:
            await self.peer_sync.close()

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        request_id: str,
        *,
        lora_name: str = "",
        exclude: Collection[str] = (),
        role: Role | None = None,
        expected_output_tokens: int = 0,
        dry_run: bool = False,
    ) -> RouteDecision:
        t0 = time.perf_counter()
        handles = pick_candidates(self.pool, model, exclude, role, lora_name)
        by_id = {h.worker_id: h for h in handles}
        sched = self.scheduler
        now = self.clock.now()
        selection = sched.select(
            token_ids,
            now,
            candidates=by_id,
            lora_name=lora_name,
            expected_output_tokens=expected_output_tokens,
        )
        if dry_run:
            return RouteDecision(
                by_id[selection.worker_id],
                selection.overlap_blocks,
                selection.prompt_blocks,
                cost=selection.cost,
                policy=RouterMode.KV.value,
            )
        sched.book(request_id, selection, now, expected_output_tokens=expected_output_tokens)
        chosen = by_id[selection.worker_id]
        previous = self._booked.pop(request_id, None)
        if previous is not None:
            previous.inflight -= 1
        chosen.inflight += 1
        self._booked[request_id] = chosen
        overhead = time.perf_counter() - t0
        self.stats.observe(overhead, selection.overlap_blocks, selection.prompt_blocks)
        return RouteDecision(
            chosen,
            selection.overlap_blocks,
            selection.prompt_blocks,
            routing_overhead_s=overhead,
            cost=selection.cost,
            policy=RouterMode.KV.value,
        )

    def first_token(self, request_id: str) -> None:
        self.scheduler.first_token(request_id, now=self.clock.now())

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self.scheduler.free(request_id, now=self.clock.now(), output_tokens=output_tokens)
        handle = self._booked.pop(request_id, None)
        if handle is not None:
            handle.inflight -= 1

    async def load_events(self, subscriber_id: str = "") -> AsyncIterator[LoadEvent]:
        """`load_event_batches`, one event at a time (RouterService.SubscribeLoadEvents)."""
        batches = self.load_event_batches(subscriber_id)
        try:
            async for batch in batches:
                for event in batch:
                    yield event
        finally:
            await batches.aclose()  # type: ignore[attr-defined]

    async def load_event_batches(
        self, subscriber_id: str = "", max_batch: int = LOAD_EVENT_BATCH
    ) -> AsyncIterator[list[LoadEvent]]:
        """This replica's own bookings active now, then every change, in batches of what
        happened since the consumer took the last one (at most `max_batch`), until the consumer
        stops (RouterService.SubscribeLoadEventBatches). A consumer more than 65,536 changes
        behind is cut off (the iterator ends): it reconnects and starts again from the active
        bookings."""
        queue: deque[LoadEvent | None] = deque()
        ready = asyncio.Event()
        limit = 65536

        def push(event: LoadEvent) -> None:
            queue.append(event if len(queue) < limit else None)
            ready.set()

        self.scheduler.add_listener(push)
        try:
            active = self.scheduler.own_bookings()
            for start in range(0, len(active), max_batch):
                yield active[start : start + max_batch]
            while True:
                await ready.wait()
                batch: list[LoadEvent] = []
                while queue and len(batch) < max_batch:
                    event = queue.popleft()
                    if event is None:
                        log.warning(
                            "load event subscriber %s fell behind; cutting it off", subscriber_id
                        )
                        return
                    batch.append(event)
                if not queue:
                    ready.clear()
                if batch:
                    yield batch
        finally:
            self.scheduler.remove_listener(push)
