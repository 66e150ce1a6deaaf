"""Disaggregated serving through the gateway's backend over real gRPC workers (mocker engines,
file discovery, the KV router): prefill worker P -> PrefillRemote -> decode worker D pulls
(simulated transfer) -> ReleaseKvBlocks -> D decodes. Output equals aggregated serving;
conditional disaggregation picks local prefill for short or cached prompts, without prefill
workers and when the prefill pool is saturated; faults (client cancels mid-prefill, P dies
mid-transfer, D dies after pulling, nobody releases) end with a completed answer or a clean
error and every pool back at its baseline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Generator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.backend import DisaggConfig, LocalPrefill, MeshBackend
from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.kv_scheduler import KvRouterConfig
from kvmesh.router.metrics import DisaggCollector
from kvmesh.router.pool import WorkerPool
from kvmesh.runtime import errors, wire
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.runtime.grpcutil import insecure_channel
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    RemotePrefill,
    Role,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.mocker import MockerEngine
from kvmesh.workers.server import Worker

from .test_worker_contract import make_engine

pytestmark = pytest.mark.integration

BS = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(5 + salt * 131 + i * 37) % 3000 + 10 for i in range(n)]


def request(rid: str, ids: list[int], max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(
        rid, ids, SamplingParams(temperature=0.0), StopParams(max_tokens=max_tokens)
    )


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110 - polling state that has no event to wait on
            await asyncio.sleep(0.005)


class Mesh:
    """Prefill and decode workers, a pool, a KV router and the gateway backend."""

    def __init__(self, tiny_model: Path, registry: Path, ttl_s: float = 3.0) -> None:
        """`ttl_s`: how long a worker's registration outlives its last heartbeat (short, so a
        killed worker leaves quickly)."""
        self.tiny_model = tiny_model
        self.registry = registry
        self.workers: list[Worker] = []
        self.pool = WorkerPool(FileDiscovery(registry, ttl_s=ttl_s, poll_s=0.02))
        self.router = KvRouter(self.pool, KvRouterConfig(seed=1))

    async def add(
        self, wid: str, role: Role, *, pin_timeout_s: float = 30.0, **cfg: object
    ) -> Worker:
        settings: dict[str, object] = {"block_size": BS, "num_gpu_blocks": 256, **cfg}
        w = Worker(
            WorkerConfig(
                discovery=f"file://{self.registry}",
                worker_id=wid,
                role=role,
                kv_pin_timeout_s=pin_timeout_s,
            ),
            make_engine(self.tiny_model, **settings),
        )
        await w.start()
        self.workers.append(w)
        await self.pool.start()
        await until(lambda: any(h.worker_id == wid for h in self.pool.workers()))
        return w

    def backend(self, **cfg: object) -> MeshBackend:
        return MeshBackend(self.pool, self.router, disagg=DisaggConfig(**cfg))  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.router.close()
        await self.pool.stop()
        for w in self.workers:
            if not w.servicer.draining:
                await w.stop()


@pytest.fixture
async def mesh(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    m = Mesh(tiny_model, tmp_path / "registry")
    yield m
    await m.close()


@pytest.fixture
async def reference(tiny_model: Path) -> AsyncIterator[MockerEngine]:
    """An aggregated mocker with the same model: the expected tokens."""
    e = make_engine(tiny_model, block_size=BS, num_gpu_blocks=256)
    await e.start()
    yield e
    await e.stop()


async def expected(engine: MockerEngine, req: EngineRequest) -> list[int]:
    return [t async for out in engine.generate(req) for t in out.token_ids]


async def run(backend: MeshBackend, req: EngineRequest) -> tuple[list[int], EngineOutput]:
    tokens: list[int] = []
    last = None
    async for out in backend.generate("tiny", req, None):
        tokens += out.token_ids
        last = out
    assert last is not None and last.finish_reason is not None
    return tokens, last


def baseline(*workers: Worker) -> None:
    for w in workers:
        load = w.engine.load()
        assert (load.kv_active_blocks, load.kv_pinned_blocks, load.num_running) == (0, 0, 0), (
            w.worker_id,
            load,
        )


async def test_gateway_prefills_remotely_and_matches_aggregated(
    mesh: Mesh, reference: MockerEngine
) -> None:
    p = await mesh.add("p0", Role.PREFILL)
    d = await mesh.add("d0", Role.DECODE)
    backend = mesh.backend(disagg_local_prefill_tokens=0)
    assert backend.disaggregated("tiny")
    prompts = [prompt(n, salt=n) for n in (1, 15, 16, 17, 100, 300)]
    for i, ids in enumerate(prompts):
        req = request(f"r{i}", ids)
        tokens, last = await run(backend, req)
        assert tokens == await expected(reference, req)
        assert last.usage is not None and last.usage.completion_tokens == 8
        assert last.usage.prompt_tokens == len(ids)
    # Concurrent requests.
    reqs = [request(f"c{i}", prompt(40 + 9 * i, salt=50 + i)) for i in range(6)]
    results = await asyncio.gather(*(run(backend, r) for r in reqs))
    for r, (tokens, _) in zip(reqs, results, strict=True):
        assert tokens == await expected(reference, r)
    stats = backend.stats
    assert stats.remote_prefills == 12 and not any(stats.local_prefills.values())
    block_bytes = d.engine.config.kv_block_bytes  # type: ignore[attr-defined]
    want_blocks = sum(-(-len(i) // BS) for i in prompts) + sum(
        -(-len(r.prompt) // BS) for r in reqs
    )
    assert stats.kv_transfer_bytes == want_blocks * block_bytes
    baseline(p, d)

    # D's KV events carried the pulled blocks to the router: the prompt is cached on D, so a
    # follow-up turn with a short new part prefills there (conditional disaggregation).
    hashes = block_hashes(prompts[-1], BS)
    await until(lambda: mesh.router.scheduler.indexer.find_matches(hashes).get("d0") == len(hashes))
    follow = mesh.backend(disagg_local_prefill_tokens=32)
    req = request("turn2", [*prompts[-1], *prompt(20, salt=99)])
    tokens, _ = await run(follow, req)
    assert tokens == await expected(reference, req)
    assert follow.stats.local_prefills[LocalPrefill.SHORT_PROMPT] == 1
    assert follow.stats.remote_prefills == 0

    registry = CollectorRegistry()
    registry.register(DisaggCollector(stats))
    text = generate_latest(registry).decode()
    assert "kvmesh_remote_prefill_total 12.0" in text
    moved = [ln for ln in text.splitlines() if ln.startswith("kvmesh_kv_transfer_bytes_total ")]
    assert [float(ln.split()[1]) for ln in moved] == [stats.kv_transfer_bytes]
    assert 'kvmesh_local_prefill_total{reason="short_prompt"} 0.0' in text


async def test_conditional_disaggregation(mesh: Mesh, reference: MockerEngine) -> None:
    d = await mesh.add("d0", Role.DECODE)
    backend = mesh.backend(disagg_local_prefill_tokens=64, disagg_max_prefill_inflight=1)
    req = request("alone", prompt(200))
    assert (await run(backend, req))[0] == await expected(reference, req)
    assert backend.stats.local_prefills[LocalPrefill.NO_PREFILL_WORKER] == 1

    # A slow prefill worker (a 200-token prefill takes ~0.2 s).
    p = await mesh.add("p0", Role.PREFILL, speedup_ratio=0.1)
    req = request("short", prompt(40, salt=1))
    assert (await run(backend, req))[0] == await expected(reference, req)
    assert backend.stats.local_prefills[LocalPrefill.SHORT_PROMPT] == 1

    reqs = [request(f"sat{i}", prompt(200, salt=10 + i)) for i in range(3)]
    results = await asyncio.gather(*(run(backend, r) for r in reqs))
    for r, (tokens, _) in zip(reqs, results, strict=True):
        assert tokens == await expected(reference, r)
    # The first took the prefill worker; the others found it saturated and prefilled on D.
    assert backend.stats.remote_prefills == 1
    assert backend.stats.local_prefills[LocalPrefill.PREFILL_SATURATED] == 2
    baseline(p, d)


async def test_client_cancels_mid_prefill(mesh: Mesh) -> None:
    p = await mesh.add("p0", Role.PREFILL, speedup_ratio=0.02)  # a ~1 s prefill
    d = await mesh.add("d0", Role.DECODE)
    backend = mesh.backend(disagg_local_prefill_tokens=0)
    task = asyncio.create_task(run(backend, request("bye", prompt(200))))
    await until(lambda: p.engine.load().kv_active_blocks > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: p.engine.load().kv_active_blocks == 0)  # the prefill was aborted
    baseline(p, d)
    assert backend.stats.remote_prefills == 0


@pytest.mark.parametrize("answer", ["seen", "lost", "timed-out"])
async def test_client_leaves_as_the_prefill_worker_answers(
    mesh: Mesh, reference: MockerEngine, answer: str
) -> None:
    # The race the gateway cannot avoid: P answered (its blocks are pinned for the decode
    # worker), but the client's cancellation reached the gateway's request before the answer
    # did ("seen": the answer is in the call; "lost": the cancelled call never gives it, the
    # transfer id is never seen). Or the call's deadline overtook the answer ("timed-out": the
    # request goes on, prefilled on D). The gateway releases what P pinned, by the request's
    # id, at once, not at the pin timeout (30 s).
    p = await mesh.add("p0", Role.PREFILL)
    d = await mesh.add("d0", Role.DECODE)
    backend = mesh.backend(disagg_local_prefill_tokens=0)
    handle = next(h for h in mesh.pool.workers() if h.worker_id == "p0")
    real = handle.stub.PrefillRemote

    class AnsweredAsTheCallerLeft:
        """The call; its first awaiter is cancelled (or its deadline expires) once P has
        answered (with "lost", every awaiter)."""

        def __init__(self, call: Any) -> None:
            self.call = call
            self.awaited = False

        def __await__(self) -> Generator[Any, None, Any]:
            resp = yield from self.call.__await__()
            if answer == "timed-out":
                meta = grpc.aio.Metadata()
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, meta, meta)
            if not self.awaited or answer == "lost":
                self.awaited = True
                raise asyncio.CancelledError
            return resp

    handle.stub.PrefillRemote = lambda *a, **kw: AnsweredAsTheCallerLeft(real(*a, **kw))
    req = request("left", prompt(50))
    if answer == "timed-out":
        assert (await run(backend, req))[0] == await expected(reference, req)
        assert backend.stats.local_prefills[LocalPrefill.PREFILL_FAILED] == 1
    else:
        with pytest.raises(asyncio.CancelledError):
            async for _ in backend.generate("tiny", req, None):
                pass
    await until(lambda: p.engine.load().kv_pinned_blocks == 0, timeout_s=5)
    baseline(p, d)


async def test_prefill_worker_dies_mid_transfer(mesh: Mesh, reference: MockerEngine) -> None:
    p = await mesh.add("p0", Role.PREFILL)
    # D's simulated transfer takes 0.3 s: P dies while it runs.
    d = await mesh.add("d0", Role.DECODE, speedup_ratio=1.0, kv_transfer_latency_ms=300)
    backend = mesh.backend(disagg_local_prefill_tokens=0)
    req = request("orphan", prompt(120))
    task = asyncio.create_task(run(backend, req))
    await until(
        lambda: p.engine.load().kv_pinned_blocks > 0 and d.engine.load().kv_active_blocks > 0
    )
    await p.kill()
    tokens, last = await task  # D could not confirm the pull: it recomputed the prompt
    assert tokens == await expected(reference, req)
    assert last.remote_prefill_fallback
    assert backend.stats.local_prefills[LocalPrefill.TRANSFER_FAILED] == 1
    await until(lambda: d.engine.load().kv_active_blocks == 0)
    baseline(d)


async def test_decode_worker_dies_after_pulling(mesh: Mesh) -> None:
    p = await mesh.add("p0", Role.PREFILL)
    d = await mesh.add("d0", Role.DECODE, speedup_ratio=1.0)  # ~6 ms per decode step
    backend = mesh.backend(disagg_local_prefill_tokens=0)
    got: list[int] = []
    with pytest.raises(errors.Unavailable):
        async for out in backend.generate("tiny", request("dies", prompt(100), 500), None):
            got += out.token_ids
            if len(got) == 4:  # D pulled, released P's blocks and is decoding
                await d.kill()
    assert len(got) >= 4
    baseline(p)
    assert backend.stats.remote_prefills == 1


async def test_unreleased_blocks_expire(mesh: Mesh) -> None:
    p = await mesh.add("p0", Role.PREFILL, pin_timeout_s=0.2)
    channel = insecure_channel(p.address)
    stub = wpb_grpc.WorkerServiceStub(channel)
    try:
        resp = await stub.PrefillRemote(wire.prefill_request_to_pb(request("x", prompt(50))))
        handle = resp.result.handle
        assert handle.prefill_address == p.address and handle.prefill_worker_id == "p0"
        assert 0 < handle.expires_after_ms <= 200 and len(handle.blocks) == 4
        assert resp.finish_reason == cpb.FINISH_REASON_UNSPECIFIED
        assert resp.usage.completion_tokens == 1
        assert (
            await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())
        ).metrics.kv_pinned_blocks == 4
        await until(lambda: p.engine.load().kv_pinned_blocks == 0, timeout_s=2)
        baseline(p)
        released = await stub.ReleaseKvBlocks(
            wpb.ReleaseKvBlocksRequest(transfer_id=handle.transfer_id)
        )
        assert released.released is False
        # By the PrefillRemote request's id (a caller that left as P answered).
        await stub.PrefillRemote(wire.prefill_request_to_pb(request("z", prompt(50))))
        assert p.engine.load().kv_pinned_blocks == 4
        released = await stub.ReleaseKvBlocks(wpb.ReleaseKvBlocksRequest(request_id="z"))
        assert released.released is True
        baseline(p)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReleaseKvBlocks(wpb.ReleaseKvBlocksRequest())
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "transfer_id or a request_id" in (err.value.details() or "")
        # max_tokens 1: the first token ends the request on P; nothing is pinned.
        one = await stub.PrefillRemote(wire.prefill_request_to_pb(request("y", prompt(50), 1)))
        assert one.finish_reason == cpb.FINISH_REASON_LENGTH
        assert not one.result.HasField("handle")
        baseline(p)
    finally:
        await channel.close()


async def test_roles_on_the_wire(mesh: Mesh, tiny_model: Path) -> None:
    d = await mesh.add("d0", Role.DECODE)
    channel = insecure_channel(d.address)
    stub = wpb_grpc.WorkerServiceStub(channel)
    try:
        card = (await stub.GetModelCard(wpb.GetModelCardRequest())).card
        assert card.role == cpb.WORKER_ROLE_DECODE
        with pytest.raises(grpc.aio.AioRpcError) as info:  # decode workers do not prefill
            await stub.PrefillRemote(wire.prefill_request_to_pb(request("x", prompt(5))))
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
        # A remote_prefill without a handle: D recomputes the prompt and continues after the
        # given first token (the stream starts with the second token).
        agg = make_engine(tiny_model, block_size=BS)
        await agg.start()
        want = await expected(agg, request("w", prompt(30)))
        await agg.stop()
        req = request("h", prompt(30))
        req.remote_prefill = RemotePrefill(first_token_id=want[0])
        msgs = [m async for m in stub.Generate(wire.request_to_pb(req))]
        assert [t for m in msgs for t in m.token_ids] == want[1:]
        assert msgs[-1].finish_reason and msgs[-1].usage.completion_tokens == 8
    finally:
        await channel.close()
