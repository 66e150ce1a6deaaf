"""KV-aware routing over real mocker workers on loopback gRPC (file discovery).

Prompts that share a prefix go to the worker holding it (checked with the workers' own
counters), a restarted router rebuilds its index from the workers' snapshots, two router
replicas share predicted load and make the same decisions, a worker that leaves leaves the
index, and engines without KV events are routed approximately.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.api.router.v1 import router_service_pb2 as rpb
from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.router.backend import MeshBackend
from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.kv_scheduler import KvRouterConfig, LoadEvent
from kvmesh.router.pool import WorkerPool
from kvmesh.router.service import ROUTER_SERVICE, RouterServicer
from kvmesh.router.stack import MeshConfig, build_router
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.runtime.errors import Unimplemented
from kvmesh.runtime.grpcutil import GrpcServer, insecure_channel
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker

from .test_worker_contract import make_engine

pytestmark = pytest.mark.integration

BS = 16


@pytest.fixture
async def workers(tiny_model: Path, tmp_path: Path) -> AsyncIterator[list[Worker]]:
    url = f"file://{tmp_path / 'registry'}"
    ws = [
        Worker(
            WorkerConfig(discovery=url, worker_id=f"w{i}"),
            make_engine(tiny_model, block_size=BS, num_gpu_blocks=512),
        )
        for i in range(4)
    ]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        if not w.servicer.draining:
            await w.stop()


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110 - polling state that has no event to wait on
            await asyncio.sleep(0.01)


def prompt(group: int, variant: int, blocks: int = 6) -> list[int]:
    """`blocks` full blocks shared by the group, then one block of its own."""
    shared = [100 + 37 * group + (i % 29) for i in range(blocks * BS)]
    return shared + [2000 + 50 * group + variant] * BS


async def run(backend: MeshBackend, rid: str, tokens: list[int]) -> int:
    """Generate 2 tokens; returns the prompt tokens the worker served from its cache."""
    req = EngineRequest(rid, tokens, SamplingParams(temperature=0.0), StopParams(max_tokens=2))
    cached = -1
    async for out in backend.generate("tiny", req, None):
        if out.usage is not None:
            cached = out.usage.cached_tokens
    return cached


def finished(ws: list[Worker]) -> list[int]:
    return [w.engine.load().requests_finished_total for w in ws]


async def kv_router(tmp_path: Path, **kw: object) -> tuple[WorkerPool, KvRouter]:
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    router = KvRouter(pool, KvRouterConfig(seed=1), **kw)  # type: ignore[arg-type]
    await pool.start()
    await pool.wait_for(4, timeout_s=10)
    return pool, router


def holders(router: KvRouter, tokens: list[int]) -> dict[str, int]:
    return router.scheduler.indexer.find_matches(block_hashes(tokens, BS))


async def test_shared_prefixes_go_to_the_worker_holding_them(
    workers: list[Worker], tmp_path: Path
) -> None:
    pool, router = await kv_router(tmp_path)
    backend = MeshBackend(pool, router)
    try:
        await until(lambda: len(router.subscriber.followed()) == 4)
        owner: dict[int, str] = {}
        for g in range(4):  # the first prompt of each group seeds one worker's cache
            before = finished(workers)
            assert await run(backend, f"seed{g}", prompt(g, 0)) == 0
            after = finished(workers)
            (idx,) = [i for i in range(4) if after[i] > before[i]]
            owner[g] = workers[idx].worker_id
            await until(lambda g=g: holders(router, prompt(g, 0)).get(owner[g]) == 7)
        assert len(set(owner.values())) == 4  # misses go to the emptiest caches: spread
        for v in range(1, 4):
            for g in range(4):
                before = finished(workers)
                cached = await run(backend, f"g{g}v{v}", prompt(g, v))
                after = finished(workers)
                served = [workers[i].worker_id for i in range(4) if after[i] > before[i]]
                assert served == [owner[g]]
                assert cached == 6 * BS  # the shared blocks came from the worker's cache
        assert router.stats.decisions == 16
        assert router.stats.overlap_blocks == 12 * 6
        assert 0 < router.stats.quantile(0.99) < 0.05  # routing overhead, seconds
        assert router.scheduler.num_bookings() == 0  # all freed
    finally:
        await router.close()
        await pool.stop()


async def test_a_restarted_router_rebuilds_its_index_from_snapshots(
    workers: list[Worker], tmp_path: Path
) -> None:
    pool, router = await kv_router(tmp_path)
    backend = MeshBackend(pool, router)
    await until(lambda: len(router.subscriber.followed()) == 4)
    await run(backend, "seed", prompt(7, 0))
    await until(lambda: bool(holders(router, prompt(7, 0))))
    (owner,) = holders(router, prompt(7, 0))
    await router.close()
    await pool.stop()

    pool2, router2 = await kv_router(tmp_path)
    try:
        await until(lambda: holders(router2, prompt(7, 0)) == {owner: 7})
        # every worker's snapshot, not only the owner's (they arrive in any order)
        indexer = router2.scheduler.indexer
        await until(lambda: all(indexer.stats(w.worker_id).snapshots for w in workers))
        for w in workers:
            stats = router2.scheduler.indexer.stats(w.worker_id)
            assert stats.snapshots >= 1 and stats.log_id
        again = await router2.route("tiny", prompt(7, 1), "again")
        assert again.worker.worker_id == owner and again.overlap_blocks == 6
        router2.finished("again")
    finally:
        await router2.close()
        await pool2.stop()


async def close_all(
    routers: list[KvRouter], servers: list[GrpcServer], pools: list[WorkerPool]
) -> None:
    """Stop the replicas of a test: routers, then their servers, then their pools."""
    for router in routers:
        await router.close()
    for server in servers:
        await server.stop(0)
    for pool in pools:
        await pool.stop()


async def test_two_router_replicas_share_load_and_agree(
    workers: list[Worker], tmp_path: Path
) -> None:
    pools: list[WorkerPool] = []
    routers: list[KvRouter] = []
    servers: list[GrpcServer] = []
    for _ in range(2):
        pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
        server = GrpcServer()
        pools.append(pool)
        servers.append(server)
    for i, pool in enumerate(pools):  # addresses are bound already: peers can be named
        # Load metrics once at subscription (idle), then stale: decisions here depend on the
        # bookings only, which is what this test compares across replicas.
        router = KvRouter(
            pool,
            KvRouterConfig(seed=i),
            peers=[servers[1 - i].address],
            router_id=f"r{i}",
            load_interval_ms=600_000,
        )
        servers[i].add(
            rpb_grpc.add_RouterServiceServicer_to_server,
            RouterServicer(pool, router),
            ROUTER_SERVICE,
        )
        routers.append(router)
    try:
        for server in servers:
            await server.start()
        for pool in pools:
            await pool.start()
            await pool.wait_for(4, timeout_s=10)
        for router in routers:
            await router.start()
        await until(
            lambda: (
                all(len(r.subscriber.followed()) == 4 for r in routers)
                and all(r.peer_sync is not None and r.peer_sync.connected for r in routers)
            )
        )
        a, b = routers
        backend = MeshBackend(pools[0], a)
        for g in range(3):
            await run(backend, f"seed{g}", prompt(g, 0))
        for g in range(3):
            await until(lambda g=g: holders(a, prompt(g, 0)) == holders(b, prompt(g, 0)) != {})
        peer_a, peer_b = f"peer:{servers[0].address}", f"peer:{servers[1].address}"
        await until(lambda: b.scheduler.num_bookings(peer_a) == 0)  # the seeds' frees arrived
        # Same index and, once bookings have travelled, the same load: the same decisions,
        # whichever replica is asked.
        for g in range(3):
            da = await a.route("tiny", prompt(g, 1), f"a{g}")
            await until(lambda g=g: b.scheduler.num_bookings(peer_a) == g + 1)
            db = await b.route("tiny", prompt(g, 2), f"b{g}")
            await until(lambda g=g: a.scheduler.num_bookings(peer_b) == g + 1)
            assert da.worker.worker_id == db.worker.worker_id
            assert da.overlap_blocks == db.overlap_blocks == 6
        for w in a.scheduler.workers():
            la, lb = a.scheduler.worker(w), b.scheduler.worker(w)
            assert la is not None and lb is not None
            assert (la.booked_prefill, la.booked_decode) == (lb.booked_prefill, lb.booked_decode)
        # A fresh prompt on an idle fleet: replica b avoids the worker a just loaded.
        big = [3000 + i for i in range(30 * BS)]
        heavy = await a.route("tiny", big, "heavy")
        await until(lambda: b.scheduler.num_bookings(peer_a) == 4)
        light = await b.route("tiny", [4000 + i for i in range(2 * BS)], "light")
        assert light.worker.worker_id != heavy.worker.worker_id
        for g in range(3):
            a.finished(f"a{g}")
            b.finished(f"b{g}")
        a.finished("heavy")
        b.finished("light")
        await until(lambda: b.scheduler.num_bookings() == 0 and a.scheduler.num_bookings() == 0)
        # The service streams bookings starting with the active ones.
        channel = insecure_channel(servers[0].address)
        stub = rpb_grpc.RouterServiceStub(channel)
        # A dry run answers like a route but books nothing: no load, no event for the peers.
        events: list[LoadEvent] = []
        a.scheduler.add_listener(events.append)
        dry = await stub.Route(rpb.RouteRequest(token_ids=prompt(1, 4), dry_run=True))
        a.scheduler.remove_listener(events.append)
        assert dry.overlap_blocks == 6 and dry.worker_id in a.scheduler.workers()
        assert events == [] and a.scheduler.num_bookings() == 0
        await a.route("tiny", prompt(0, 3), "open")
        call = stub.SubscribeLoadEvents(rpb.SubscribeLoadEventsRequest(subscriber_id="test"))
        first = await asyncio.wait_for(anext(aiter(call)), 5)
        assert (first.router_id, first.request_id, first.state) == (
            "r0",
            "open",
            rpb.REQUEST_STATE_UNSPECIFIED,
        )
        a.finished("open")
        freed = await asyncio.wait_for(anext(aiter(call)), 5)
        assert freed.state == rpb.REQUEST_STATE_FINISHED
        call.cancel()
        # In batches (what peers use): the active bookings in one message, then the changes
        # made since the last message in the next.
        for i in range(3):
            await a.route("tiny", prompt(i, 5), f"batch{i}")
        batches = stub.SubscribeLoadEventBatches(
            rpb.SubscribeLoadEventBatchesRequest(subscriber_id="test")
        )
        active = await asyncio.wait_for(anext(aiter(batches)), 5)
        assert sorted(e.request_id for e in active.events) == ["batch0", "batch1", "batch2"]
        for i in range(3):  # no await between them: one batch
            a.finished(f"batch{i}")
        changes = await asyncio.wait_for(anext(aiter(batches)), 5)
        assert [(e.request_id, e.state) for e in changes.events] == [
            (f"batch{i}", rpb.REQUEST_STATE_FINISHED) for i in range(3)
        ]
        batches.cancel()
        listing = await stub.ListWorkers(rpb.ListWorkersRequest())
        assert sum(w.indexed_blocks for w in listing.workers) >= 3 * 7
        assert all(w.HasField("load") for w in listing.workers)
        await channel.close()
    finally:
        await close_all(routers, servers, pools)


class _OneEventServicer(RouterServicer):
    """A router service from before SubscribeLoadEventBatches."""

    async def SubscribeLoadEventBatches(
        self,
        request: rpb.SubscribeLoadEventBatchesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[rpb.SubscribeLoadEventBatchesResponse]:
        raise Unimplemented("not in this version")
        yield  # an async generator, as the method it overrides


async def test_peers_fall_back_to_one_event_messages(workers: list[Worker], tmp_path: Path) -> None:
    old_pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    old = KvRouter(old_pool, KvRouterConfig(), router_id="old")
    server = GrpcServer()
    server.add(
        rpb_grpc.add_RouterServiceServicer_to_server,
        _OneEventServicer(old_pool, old),
        ROUTER_SERVICE,
    )
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    new = KvRouter(pool, KvRouterConfig(), peers=[server.address], router_id="new")
    try:
        await server.start()
        for p in (old_pool, pool):
            await p.start()
            await p.wait_for(4, timeout_s=10)
        for r in (old, new):
            await r.start()
        assert new.peer_sync is not None
        await until(lambda: bool(new.peer_sync and new.peer_sync.connected))
        await old.route("tiny", prompt(2, 0), "r")
        source = f"peer:{server.address}"
        await until(lambda: new.scheduler.num_bookings(source) == 1)
        old.finished("r")
        await until(lambda: new.scheduler.num_bookings(source) == 0)
    finally:
        await close_all([new, old], [server], [pool, old_pool])


async def test_replicas_find_each_other_in_discovery(workers: list[Worker], tmp_path: Path) -> None:
    """--router-peers-discovery: each replica follows the others registered as routers, and
    stops (dropping their bookings) when one leaves."""
    pools: list[WorkerPool] = []
    routers: list[KvRouter] = []
    servers: list[GrpcServer] = []
    for i in range(2):
        pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
        router = KvRouter(pool, KvRouterConfig(), peer_discovery=True, router_id=f"d{i}")
        server = GrpcServer()
        server.add(
            rpb_grpc.add_RouterServiceServicer_to_server,
            RouterServicer(pool, router),
            ROUTER_SERVICE,
        )
        pools.append(pool)
        routers.append(router)
        servers.append(server)
    a, b = routers
    try:
        registrations = []
        for pool, router, server in zip(pools, routers, servers, strict=True):
            await server.start()
            await pool.start()
            await pool.wait_for(4, timeout_s=10)
            await router.start()
            registrations.append(router.register(server.address))
        sync_a, sync_b = a.peer_sync, b.peer_sync
        assert sync_a is not None and sync_b is not None
        await until(lambda: sync_a.connected == {servers[1].address})
        await until(lambda: sync_b.connected == {servers[0].address})
        assert set(sync_a.following) == {servers[1].address}  # never itself
        await a.route("tiny", prompt(3, 0), "shared")
        await until(lambda: sync_b.bookings() == 1)
        await registrations[0].close()  # a leaves discovery: b stops following it
        await until(lambda: not sync_b.following)
        assert sync_b.bookings() == 0 and b.scheduler.num_bookings() == 0
        a.finished("shared")
        await registrations[1].close()
    finally:
        await close_all(routers, servers, pools)


async def test_a_worker_that_leaves_leaves_the_index(workers: list[Worker], tmp_path: Path) -> None:
    pool, router = await kv_router(tmp_path)
    backend = MeshBackend(pool, router)
    try:
        await until(lambda: len(router.subscriber.followed()) == 4)
        await run(backend, "seed", prompt(5, 0))
        await until(lambda: bool(holders(router, prompt(5, 0))))
        (owner,) = holders(router, prompt(5, 0))
        worker = next(w for w in workers if w.worker_id == owner)
        await worker.stop()
        await until(lambda: holders(router, prompt(5, 0)) == {})
        assert owner not in router.scheduler.workers()
        d = await router.route("tiny", prompt(5, 1), "after")
        assert d.worker.worker_id != owner and d.overlap_blocks == 0
        router.finished("after")
    finally:
        await router.close()
        await pool.stop()


async def test_engines_without_kv_events_are_routed_approximately(
    tiny_model: Path, tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'plain'}"
    ws = [
        Worker(
            WorkerConfig(discovery=url, worker_id=f"p{i}"),
            make_engine(tiny_model, block_size=BS, enable_prefix_caching=False),
        )
        for i in range(2)
    ]
    for w in ws:
        await w.start()
    pool, router = build_router(MeshConfig(discovery=url, router_seed=3))
    assert isinstance(router, KvRouter)
    await pool.start()
    try:
        await pool.wait_for(2, timeout_s=10)
        await until(lambda: len(router.subscriber.followed()) == 2)
        assert not any(router.scheduler.worker(w.worker_id).kv_events for w in ws)  # type: ignore[union-attr]
        first = await router.route("tiny", prompt(1, 0), "x")
        router.finished("x")
        for v in range(1, 4):
            d = await router.route("tiny", prompt(1, v), f"x{v}")
            assert d.worker.worker_id == first.worker.worker_id and d.overlap_blocks == 6
            router.finished(f"x{v}")
    finally:
        await router.close()
        await pool.stop()
        for w in ws:
            await w.stop()


async def test_with_an_itl_target_the_router_learns_what_its_workers_realize(
    workers: list[Worker], tmp_path: Path
) -> None:
    """The live path of the router's SLO rule (kv_policy, SLO): the gateway tells the router
    each request's output tokens with its end, and the scheduler learns the realized /
    predicted ITL of the worker the request ran on (and the fleet's)."""
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    router = KvRouter(pool, KvRouterConfig(seed=1, itl_slo_ms=50.0))
    await pool.start()
    await pool.wait_for(4, timeout_s=10)
    backend = MeshBackend(pool, router)
    try:
        await run(backend, "a", prompt(0, 0))
        sched = router.scheduler
        served = [w for w in sched.workers() if (load := sched.worker(w)) and load.itl_ratio]
        assert len(served) == 1 and sched.fleet_itl_ratio > 0
        assert sched.num_bookings() == 0
    finally:
        await router.close()
        await pool.stop()
