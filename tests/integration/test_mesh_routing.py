"""The gateway's backend over real workers: discovery, routing, the router service, tracing.

Workers are real gRPC servers on loopback ports (in this process); discovery is the file
registry `kvmesh up` uses.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.api.router.v1 import router_service_pb2 as rpb
from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.backend import MeshBackend
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import Router, RouterMode, SimpleRouter
from kvmesh.router.service import (
    ROUTER_SERVICE,
    RemoteRouter,
    RouterServicer,
    serve_when_routable,
)
from kvmesh.runtime import errors, wire
from kvmesh.runtime.discovery import FileDiscovery, StaticDiscovery
from kvmesh.runtime.grpcutil import GrpcServer, insecure_channel
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineRequest, FinishReason, SamplingParams, StopParams
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import WORKER_SERVICE, Worker

from .test_worker_contract import make_engine

pytestmark = pytest.mark.integration


@pytest.fixture
async def workers(tiny_model: Path, tmp_path: Path) -> AsyncIterator[list[Worker]]:
    url = f"file://{tmp_path / 'registry'}"
    ws = [
        Worker(WorkerConfig(discovery=url, worker_id=f"w{i}"), make_engine(tiny_model))
        for i in range(2)
    ]
    for w in ws:
        await w.start()
    yield ws
    for w in ws:
        if w.servicer.draining is False:
            await w.stop()


def request(rid: str, prompt: list[int] | None = None) -> EngineRequest:
    return EngineRequest(
        rid,
        prompt or list(range(10, 30)),
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=3),
    )


async def run(backend: MeshBackend, req: EngineRequest) -> list[int]:
    tokens: list[int] = []
    async for out in backend.generate("tiny", req, None):
        tokens += out.token_ids
        if out.finish_reason is not None:
            assert out.finish_reason is FinishReason.LENGTH
    return tokens


async def finished(w: Worker) -> int:
    return w.engine.load().requests_finished_total


async def test_round_robin_spreads_and_a_stopped_worker_leaves(
    workers: list[Worker], tmp_path: Path
) -> None:
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", ttl_s=3.0, poll_s=0.05))
    await pool.start()
    await pool.wait_for(2, timeout_s=10)
    backend = MeshBackend(pool, SimpleRouter(pool, RouterMode.ROUND_ROBIN))
    assert backend.ready() and backend.model_info("tiny") is not None
    outputs = [await run(backend, request(f"r{i}")) for i in range(6)]
    assert all(o == outputs[0] and len(o) == 3 for o in outputs)
    assert [await finished(w) for w in workers] == [3, 3]

    await workers[0].stop()  # deregisters first, then drains
    for _ in range(100):
        if len(pool.workers()) == 1:
            break
        await asyncio.sleep(0.05)
    assert [w.worker_id for w in pool.workers()] == ["w1"]
    for i in range(3):
        await run(backend, request(f"s{i}"))
    assert await finished(workers[1]) == 6

    with pytest.raises(errors.NotFound):
        await SimpleRouter(pool).route("other-model", [1], "x")
    await pool.stop()


async def test_no_workers_is_unavailable(tmp_path: Path) -> None:
    pool = WorkerPool(FileDiscovery(tmp_path / "empty"))
    await pool.start()
    backend = MeshBackend(pool, SimpleRouter(pool))
    assert not backend.ready()
    with pytest.raises(errors.Unavailable):
        await run(backend, request("r"))
    await pool.stop()


async def router_service(pool: WorkerPool, router: Router | None = None) -> GrpcServer:
    """A started RouterService over `pool` (routing round-robin unless `router` is given)."""
    server = GrpcServer()
    servicer = RouterServicer(pool, router if router is not None else SimpleRouter(pool))
    server.add(rpb_grpc.add_RouterServiceServicer_to_server, servicer, ROUTER_SERVICE)
    await server.start()
    return server


async def test_router_service_route_list_and_proxy(workers: list[Worker], tmp_path: Path) -> None:
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    await pool.start()
    await pool.wait_for(2, timeout_s=10)
    router = _EndsRecorded(pool)
    server = await router_service(pool, router)
    channel = insecure_channel(server.address)
    stub = rpb_grpc.RouterServiceStub(channel)
    try:
        listing = await stub.ListWorkers(rpb.ListWorkersRequest())
        assert sorted(w.worker_id for w in listing.workers) == ["w0", "w1"]
        picks = [
            (await stub.Route(rpb.RouteRequest(token_ids=[1, 2, 3], dry_run=True))).worker_id
            for _ in range(4)
        ]
        assert sorted(picks) == ["w0", "w0", "w1", "w1"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Route(rpb.RouteRequest(token_ids=[]))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        proxied = [
            m
            async for m in stub.Generate(
                rpb.GenerateRequest(request=wire.request_to_pb(request("p")))
            )
        ]
        assert sum(len(m.response.token_ids) for m in proxied) == 3

        # A frontend using the service instead of its in-process router.
        front_pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
        await front_pool.start()
        await front_pool.wait_for(2, timeout_s=10)
        remote = RemoteRouter(server.address, front_pool)
        backend = MeshBackend(front_pool, remote)
        await poll_until(backend.ready)  # the service is SERVING: its pool has both workers
        assert len(await run(backend, request("q"))) == 3
        # The service hears how many tokens the request generated (a KV router's realized ITL).
        await poll_until(lambda: ("q", 3) in router.ended)
        await remote.close()
        await front_pool.stop()
    finally:
        await channel.close()
        await server.stop(0)
        await pool.stop()


async def test_a_gateway_waits_for_its_pool_to_join_the_worker_its_router_chose(
    workers: list[Worker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after start-up a router service may choose a worker the gateway's own pool has
    not joined yet (each joins new workers on its own discovery poll; `kvmesh up
    --router-process` failed its first request with a 404 this way). The gateway waits for its
    pool to join it; a worker it does not find within JOIN_WAIT_S is a 503, not a 404."""
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    await pool.start()
    await pool.wait_for(2, timeout_s=10)
    server = await router_service(pool)
    regs = sorted((tmp_path / "registry").glob("worker.*.json"))
    assert len(regs) == 2
    fronts: list[tuple[WorkerPool, RemoteRouter]] = []

    async def gateway(name: str) -> RemoteRouter:
        """A gateway whose discovery shows only the first worker so far."""
        directory = tmp_path / name
        directory.mkdir()
        shutil.copy(regs[0], directory)
        front = WorkerPool(FileDiscovery(directory, ttl_s=600, poll_s=0.05))
        await front.start()
        await front.wait_for(1, timeout_s=10)
        remote = RemoteRouter(server.address, front)
        fronts.append((front, remote))
        return remote

    try:
        late = await gateway("late")
        asyncio.get_running_loop().call_later(0.3, shutil.copy, regs[1], tmp_path / "late")
        # round-robin on the service: the two routes choose both workers, one the gateway has
        # not joined when it is chosen
        chosen = {(await late.route("", [1, 2, 3], f"r{i}")).worker.worker_id for i in range(2)}
        assert chosen == {"w0", "w1"}

        monkeypatch.setattr("kvmesh.router.service.JOIN_WAIT_S", 0.3)
        never = await gateway("never")
        with pytest.raises(errors.Unavailable, match="has not found"):
            for i in range(2):
                await never.route("", [1, 2, 3], f"n{i}")
    finally:
        for front, remote in fronts:
            await remote.close()
            await front.stop()
        await server.stop(0)
        await pool.stop()


class _EndsRecorded(SimpleRouter):
    """A round-robin router that records every end it is told of, with its output tokens."""

    def __init__(self, pool: WorkerPool) -> None:
        super().__init__(pool)
        self.ended: list[tuple[str, int]] = []

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self.ended.append((request_id, output_tokens))
        super().finished(request_id, output_tokens)


class RecordingWorker(wpb_grpc.WorkerServiceServicer):
    """A fake worker implementing the real WorkerService; records the trace context it gets."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.traceparents: list[str] = []

    async def GetModelCard(self, request: Any, context: Any) -> wpb.GetModelCardResponse:
        from kvmesh.runtime.types import ModelInfo

        info = ModelInfo("tiny", "fake", 16, 10, 1024)
        return wpb.GetModelCardResponse(card=wire.card_to_pb(info), worker_id="fake")

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[wpb.GenerateResponse]:
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        yield wpb.GenerateResponse(token_ids=[1])
        yield wpb.GenerateResponse(token_ids=[2], finish_reason=2)

    async def GenerateStream(
        self, request_iterator: Any, context: Any
    ) -> AsyncIterator[wpb.GenerateStreamResponse]:
        async for msg in request_iterator:
            for start in msg.start:
                self.traceparents.append(start.traceparent)
                rid = start.request.request_id
                for resp in [
                    wpb.GenerateResponse(token_ids=[1]),
                    wpb.GenerateResponse(token_ids=[2], finish_reason=2),
                ]:
                    out = wpb.StreamedGenerateOutput(request_id=rid, response=resp)
                    yield wpb.GenerateStreamResponse(outputs=[out])


async def test_trace_context_travels_to_the_worker() -> None:
    fake = RecordingWorker()
    server = GrpcServer()
    server.add(wpb_grpc.add_WorkerServiceServicer_to_server, fake, WORKER_SERVICE)
    await server.start()
    pool = WorkerPool(StaticDiscovery([server.address]))
    await pool.start()
    await pool.wait_for(1, timeout_s=10)
    backend = MeshBackend(pool, SimpleRouter(pool))
    trace = TraceContext.new()
    try:
        outs = [o async for o in backend.generate("tiny", request("t"), trace)]
        assert [t for o in outs for t in o.token_ids] == [1, 2]
        sent = TraceContext.from_headers(fake.traceparents[0], None)
        assert sent is not None
        # The caller's span is the parent of the worker's spans (it is the one exported).
        assert (sent.trace_id, sent.span_id) == (trace.trace_id, trace.span_id)
    finally:
        await pool.stop()
        await server.stop(0)


async def test_a_dead_worker_is_retried_elsewhere_and_avoided(
    workers: list[Worker], tmp_path: Path
) -> None:
    """A worker that dies without leaving discovery: the request that hits it is retried on
    another worker (nothing was streamed yet), and the dead one is avoided afterwards."""
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", ttl_s=30.0, poll_s=0.05))
    await pool.start()
    await pool.wait_for(2, timeout_s=10)
    backend = MeshBackend(pool, SimpleRouter(pool, RouterMode.ROUND_ROBIN))
    # Kill w0's gRPC server but keep its registration alive (as a SIGKILLed process would
    # until its lease expires).
    await workers[0].server.stop(0)
    for i in range(4):
        assert len(await run(backend, request(f"d{i}"))) == 3
    assert await finished(workers[1]) == 4
    dead = next(w for w in pool.workers() if w.worker_id == "w0")
    assert dead.down_until > 0
    await pool.stop()


async def poll_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 (the checks read state other tasks update)
            await asyncio.sleep(0.02)


async def test_a_router_service_is_ready_only_with_a_worker(
    workers: list[Worker], tmp_path: Path
) -> None:
    """A gateway using a router service is not ready (/health 503) while that service has not
    joined a worker: otherwise it would answer 503 "no workers" to requests it took."""
    registry = tmp_path / "registry"
    empty = tmp_path / "empty"
    empty.mkdir()
    router_pool = WorkerPool(FileDiscovery(empty, poll_s=0.05))
    await router_pool.start()
    server = await router_service(router_pool)
    routable = asyncio.create_task(serve_when_routable(server, router_pool))
    front_pool = WorkerPool(FileDiscovery(registry, poll_s=0.05))
    await front_pool.start()
    await front_pool.wait_for(2, timeout_s=10)
    remote = RemoteRouter(server.address, front_pool)
    backend = MeshBackend(front_pool, remote)
    try:
        await asyncio.sleep(0.5)  # the health watch has answered by now
        assert not remote.ready() and not backend.ready()
        # The router's pool joins the workers (their registry entries appear where it looks).
        for entry in registry.glob("worker.*.json"):
            shutil.copy(entry, empty / entry.name)
        await poll_until(backend.ready)
        assert len(await run(backend, request("q"))) == 3
        # The router service goes away: the gateway is no longer ready.
        await server.stop(0)
        await poll_until(lambda: not backend.ready())
    finally:
        routable.cancel()
        await remote.close()
        await front_pool.stop()
        await router_pool.stop()
        await server.stop(0)
