"""Contract tests of WorkerService over real gRPC (in-process server on a loopback port).

Every RPC is reachable and answers with the documented status; cancelling Generate frees the
request's KV blocks; the KV event stream (snapshot + deltas, and resume by event id)
reproduces the worker's block pool exactly.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.session import WorkerSession
from kvmesh.runtime import kv_events as kv
from kvmesh.runtime import wire
from kvmesh.runtime.errors import KvmeshError, RequestTooLarge
from kvmesh.runtime.grpcutil import error_from_rpc, insecure_channel, status_for
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.mocker import MockerConfig, MockerEngine
from kvmesh.workers.server import Worker

pytestmark = pytest.mark.integration


def make_engine(model: Path, **overrides: object) -> MockerEngine:
    info = ModelDirInfo.load(model)
    cfg = MockerConfig(**{"speedup_ratio": 1e6, **overrides})  # type: ignore[arg-type]
    return MockerEngine(
        cfg,
        served_model_name="tiny",
        vocab_size=info.vocab_size,
        special_token_ids=info.special_token_ids,
        eos_token_ids=info.eos_token_ids,
        context_length=info.context_length,
    )


@pytest.fixture
async def worker(tiny_model: Path) -> AsyncIterator[Worker]:
    w = Worker(WorkerConfig(), make_engine(tiny_model, num_gpu_blocks=64, block_size=4))
    await w.start()
    yield w
    await w.stop()


@pytest.fixture
async def stub(worker: Worker) -> AsyncIterator[wpb_grpc.WorkerServiceStub]:
    channel = insecure_channel(worker.address)
    yield wpb_grpc.WorkerServiceStub(channel)
    await channel.close()


def gen_request(prompt: list[int], max_tokens: int = 4, **sampling: float) -> wpb.GenerateRequest:
    return wpb.GenerateRequest(
        token_ids=prompt,
        sampling=cpb.SamplingOptions(temperature=0.0, **sampling),  # type: ignore[arg-type]
        stop=cpb.StopConditions(max_tokens=max_tokens),
    )


async def collect(
    stub: wpb_grpc.WorkerServiceStub, req: wpb.GenerateRequest
) -> list[wpb.GenerateResponse]:
    return [msg async for msg in stub.Generate(req)]


async def test_generate_streams_tokens_then_finish_and_usage(
    stub: wpb_grpc.WorkerServiceStub, tiny_model: Path
) -> None:
    msgs = await collect(stub, gen_request(list(range(100, 110)), max_tokens=6))
    tokens = [t for m in msgs for t in m.token_ids]
    assert len(tokens) == 6
    assert all(m.finish_reason == cpb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == cpb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (10, 6)
    again = await collect(stub, gen_request(list(range(100, 110)), max_tokens=6))
    assert again[-1].usage.cached_tokens > 0, "second identical prompt hits the prefix cache"
    # Greedy output depends on the prompt only: not on this worker's cache, nor on anything of
    # this process. Another worker (its own engine, cold cache) must give the same tokens, and
    # so must seeded sampling; another seed must not.
    other = Worker(WorkerConfig(), make_engine(tiny_model, num_gpu_blocks=64, block_size=4))
    await other.start()
    channel = insecure_channel(other.address)
    try:
        cold = await collect(
            wpb_grpc.WorkerServiceStub(channel), gen_request(list(range(100, 110)), max_tokens=6)
        )
        assert cold[-1].usage.cached_tokens == 0
        assert [t for m in again for t in m.token_ids] == tokens
        assert [t for m in cold for t in m.token_ids] == tokens

        async def sample(s: wpb_grpc.WorkerServiceStub, seed: int) -> list[int]:
            req = gen_request(list(range(100, 110)), max_tokens=6, seed=seed)
            req.sampling.temperature = 1.0
            return [t for m in await collect(s, req) for t in m.token_ids]

        seeded = await sample(stub, 42)
        assert seeded == await sample(wpb_grpc.WorkerServiceStub(channel), 42)
        assert seeded != await sample(wpb_grpc.WorkerServiceStub(channel), 43)
    finally:
        await channel.close()
        await other.stop()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
    ],
)
async def test_bad_sampling_is_invalid_argument(
    stub: wpb_grpc.WorkerServiceStub, field: str, value: float
) -> None:
    req = gen_request([1, 2, 3])
    setattr(req.sampling, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, req)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")


def _error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo of a failed call's grpc-status-details-bin trailer (there must be one)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]  # an AioRpcError is a Call
    assert status is not None, "no google.rpc.Status in the trailers"
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info


async def test_empty_and_too_long_prompts(stub: wpb_grpc.WorkerServiceStub, worker: Worker) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, gen_request([]))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _error_info(info.value).reason == "INVALID_REQUEST"
    too_long = [5] * (worker.engine.info.context_length + 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, gen_request(too_long))
    # Old clients read a plain INVALID_ARGUMENT with a plain message (no tag in it) ...
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("prompt has")
    # ... and the kind travels as structured details, decoded in one place.
    detail = _error_info(info.value)
    assert (detail.reason, detail.domain) == ("CONTEXT_LENGTH_EXCEEDED", "kvmesh.api")
    assert dict(detail.metadata) == {"param": "prompt"}
    err = error_from_rpc(info.value)
    assert isinstance(err, RequestTooLarge) and err.param == "prompt"


async def test_too_long_prompt_on_a_generate_stream_is_request_too_large(
    stub: wpb_grpc.WorkerServiceStub, worker: Worker
) -> None:
    """The in-band error of a multiplexed stream (what routers and gateways use) keeps the kind
    too: the router's WorkerSession raises RequestTooLarge, not a bare InvalidRequest."""
    session = WorkerSession(stub, worker.address)
    try:
        req = gen_request([5] * worker.engine.info.context_length, max_tokens=1)
        req.request_id = "too-long"
        with pytest.raises(RequestTooLarge) as info:
            async for _ in session.generate(req):
                pass
        assert info.value.param == "prompt" and "context length" in info.value.message
        ok = gen_request([5, 6, 7], max_tokens=2)
        ok.request_id = "fine"
        assert [m.finish_reason async for m in session.generate(ok)][-1] == cpb.FINISH_REASON_LENGTH
    finally:
        await session.close()


async def test_fields_the_engine_cannot_honour_are_refused(
    stub: wpb_grpc.WorkerServiceStub, worker: Worker
) -> None:
    """media (no MULTIMODAL), engine_params_json (no engine reads it), a LoRA adapter that is
    not loaded (NOT_FOUND, as a real engine) and guided decoding (no GUIDED_DECODING) are
    refused, on Generate and on GenerateStream alike, instead of being served as if they were
    not there."""
    assert {"MULTIMODAL", "GUIDED_DECODING"}.isdisjoint(worker.engine.info.capabilities)
    media = gen_request([1, 2, 3])
    media.media.add(mime_type="image/png", data=b"\x89PNG")
    params = gen_request([1, 2, 3])
    params.engine_params_json = '{"best_of": 2}'
    lora = gen_request([1, 2, 3])
    lora.lora_name = "sql"
    guided = gen_request([1, 2, 3])
    guided.sampling.guided.json_object = True
    cases = [
        (media, grpc.StatusCode.INVALID_ARGUMENT, "media", "MULTIMODAL"),
        (params, grpc.StatusCode.UNIMPLEMENTED, "engine_params_json", "engine_params_json"),
        (lora, grpc.StatusCode.NOT_FOUND, "model", "'sql' is not loaded"),
        (guided, grpc.StatusCode.INVALID_ARGUMENT, "response_format", "GUIDED_DECODING"),
    ]
    session = WorkerSession(stub, worker.address)
    try:
        for i, (req, code, param, words) in enumerate(cases):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, req)
            assert info.value.code() is code
            assert words in (info.value.details() or "")
            assert error_from_rpc(info.value).param == param
            req.request_id = f"stream-{i}"
            with pytest.raises(KvmeshError) as err:
                async for _ in session.generate(req):
                    pass
            assert (status_for(err.value)[0], err.value.param) == (code, param)
    finally:
        await session.close()
    assert worker.engine.load().num_running == 0


async def test_lora_adapters_load_and_unload(
    stub: wpb_grpc.WorkerServiceStub, worker: Worker
) -> None:
    """The mocker keeps adapters by name (no weights): loaded ones serve, the card lists them,
    unloaded or unknown ones are NOT_FOUND; a duplicate load is INVALID_ARGUMENT."""
    loaded = await stub.LoadLoraAdapter(
        wpb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/adapters/sql")
    )
    assert list(loaded.card.lora_adapters) == ["sql"]
    assert cpb.ENGINE_CAPABILITY_LORA in loaded.card.capabilities
    req = gen_request([1, 2, 3], max_tokens=2)
    req.lora_name = "sql"
    await collect(stub, req)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadLoraAdapter(wpb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/x"))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    card = await stub.GetModelCard(wpb.GetModelCardRequest())
    assert list(card.card.lora_adapters) == ["sql"]
    unloaded = await stub.UnloadLoraAdapter(wpb.UnloadLoraAdapterRequest(lora_name="sql"))
    assert list(unloaded.card.lora_adapters) == []
    for call in (
        stub.UnloadLoraAdapter(wpb.UnloadLoraAdapterRequest(lora_name="sql")),
        collect(stub, req),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() is grpc.StatusCode.NOT_FOUND


async def test_zero_max_tokens_rejected(stub: wpb_grpc.WorkerServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, gen_request([1, 2, 3], max_tokens=0))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_every_rpc_is_reachable(stub: wpb_grpc.WorkerServiceStub, worker: Worker) -> None:
    card = await stub.GetModelCard(wpb.GetModelCardRequest())
    assert card.worker_id == worker.worker_id
    assert card.card.served_model_name == "tiny"
    assert card.card.kv_block_size_tokens == 4
    assert cpb.ENGINE_CAPABILITY_KV_EVENTS in card.card.capabilities

    load = await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())
    assert load.metrics.kv_total_blocks == 64
    stream = stub.StreamLoadMetrics(wpb.StreamLoadMetricsRequest(interval_ms=10))
    got = [await stream.read() for _ in range(3)]
    stream.cancel()
    assert len(got) == 3

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.PrefillRemote(wpb.PrefillRemoteRequest(token_ids=[1, 2]))
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED

    released = await stub.ReleaseKvBlocks(wpb.ReleaseKvBlocksRequest(transfer_id="nope"))
    assert released.released is False

    events = stub.SubscribeKvEvents(wpb.SubscribeKvEventsRequest())
    first = await events.read()
    assert first.HasField("snapshot") and first.snapshot.first and first.snapshot.log_id
    events.cancel()
    # Resuming with another process's log id starts over with a snapshot.
    other = stub.SubscribeKvEvents(
        wpb.SubscribeKvEventsRequest(resume_after_event_id=0, resume_log_id="stale")
    )
    assert (await other.read()).HasField("snapshot")
    other.cancel()

    await collect(stub, gen_request(list(range(1, 20))))
    cleared = await stub.ClearKvCache(wpb.ClearKvCacheRequest())
    assert cleared.blocks_cleared > 0

    channel = insecure_channel(worker.address)
    health = health_pb2_grpc.HealthStub(channel)
    status = await health.Check(
        health_pb2.HealthCheckRequest(service="kvmesh.api.worker.v1.WorkerService")
    )
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = refl.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listing = await call.read()
    names = {s.name for s in listing.list_services_response.service}
    assert "kvmesh.api.worker.v1.WorkerService" in names
    await call.done_writing()
    await channel.close()

    drained = await stub.Drain(wpb.DrainRequest(timeout_ms=1000))
    assert drained.cancelled_requests == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, gen_request([1, 2, 3]))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_cancel_generate_frees_blocks(tiny_model: Path) -> None:
    # A slow mocker (real-time / 50) so the request is still running when we cancel.
    w = Worker(WorkerConfig(), make_engine(tiny_model, speedup_ratio=50.0, block_size=4))
    await w.start()
    channel = insecure_channel(w.address)
    stub = wpb_grpc.WorkerServiceStub(channel)
    try:
        call = stub.Generate(gen_request(list(range(1, 40)), max_tokens=2000))
        await call.read()
        busy = await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())
        assert busy.metrics.num_running_requests == 1 and busy.metrics.kv_active_blocks > 0
        call.cancel()
        for _ in range(200):
            load = (await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())).metrics
            if load.kv_active_blocks == 0 and load.num_running_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert load.kv_active_blocks == 0 and load.num_running_requests == 0
        assert load.num_waiting_requests == 0
    finally:
        await channel.close()
        await w.stop()


class Mirror:
    """A subscriber's reconstruction of one worker's cache from the event stream."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.last_id = 0
        self.synced = False

    def apply(self, item: kv.SnapshotChunk | kv.KvEventRecord) -> None:
        if isinstance(item, kv.SnapshotChunk):
            if item.first:
                self.blocks.clear()
                self.synced = False
            for chain in item.chains:
                self._store(chain)
            self.last_id = item.as_of_event_id
            self.synced = item.last
            return
        assert item.event_id > self.last_id, "event ids strictly increase"
        assert item.event_id == self.last_id + 1, "no event is lost"
        self.last_id = item.event_id
        if isinstance(item.kind, kv.BlocksStored):
            self._store(item.kind)
        elif isinstance(item.kind, kv.BlocksRemoved):
            for h in item.kind.block_hashes:
                self.blocks.pop(h, None)
        else:
            self.blocks.clear()

    def _store(self, chain: kv.BlocksStored) -> None:
        parent = chain.parent_hash
        for b in chain.blocks:
            self.blocks[b.block_hash] = (parent, b.token_ids)
            parent = b.block_hash


async def follow(
    stub: wpb_grpc.WorkerServiceStub, mirror: Mirror, resume: int | None, limit: int | None
) -> None:
    req = wpb.SubscribeKvEventsRequest()
    if resume is not None:
        req.resume_after_event_id = resume
    call = stub.SubscribeKvEvents(req)
    seen = 0
    try:
        async for msg in call:
            mirror.apply(wire.kv_item_from_pb(msg))
            seen += 1
            if limit is not None and seen >= limit:
                return
    finally:
        call.cancel()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_kv_event_stream_reproduces_block_pool(tiny_model: Path, seed: int) -> None:
    """Random workloads with shared prefixes on a small pool (evictions happen): a subscriber
    from the start, one that joins late (snapshot), and one that disconnects and resumes by
    event id all end with exactly the worker's cached blocks."""
    rng = random.Random(seed)
    engine = make_engine(tiny_model, num_gpu_blocks=48, block_size=4)
    w = Worker(WorkerConfig(), engine)
    await w.start()
    channel = insecure_channel(w.address)
    stub = wpb_grpc.WorkerServiceStub(channel)
    try:
        early, resumed, late = Mirror(), Mirror(), Mirror()
        early_task = asyncio.create_task(follow(stub, early, None, None))
        await follow(stub, resumed, None, 1)  # snapshot only, then disconnect
        prefixes = [
            [rng.randrange(10, 2000) for _ in range(rng.randrange(4, 24))] for _ in range(4)
        ]

        async def one() -> None:
            prompt = rng.choice(prefixes) + [
                rng.randrange(10, 2000) for _ in range(rng.randrange(1, 12))
            ]
            await collect(stub, gen_request(prompt, max_tokens=rng.randrange(1, 12)))

        for _ in range(6):
            await asyncio.gather(*(one() for _ in range(rng.randrange(1, 6))))
        # Resume from where the second subscriber left off; a late joiner gets a snapshot.
        target = engine.kv_events.last_event_id if engine.kv_events else 0
        resume_task = asyncio.create_task(follow(stub, resumed, resumed.last_id, None))
        late_task = asyncio.create_task(follow(stub, late, None, None))
        for _ in range(500):
            if early.last_id >= target and resumed.last_id >= target and late.synced:
                break
            await asyncio.sleep(0.01)
        for t in (early_task, resume_task, late_task):
            t.cancel()
        truth = {h: (p, toks) for h, (p, toks, _lora) in engine.kv_events.cached().items()}  # type: ignore[union-attr]
        assert set(truth) == engine.cached_block_hashes()
        assert early.blocks == truth
        assert resumed.blocks == truth
        assert late.blocks == truth
    finally:
        await channel.close()
        await w.stop()


async def test_generate_stream_multiplexes_requests(stub: wpb_grpc.WorkerServiceStub) -> None:
    """GenerateStream: same outputs as Generate, errors in-band, per-request cancel."""
    expected = [
        t
        for m in await collect(stub, gen_request(list(range(50, 60)), max_tokens=5))
        for t in m.token_ids
    ]
    call = stub.GenerateStream()
    starts = []
    for i in range(3):
        req = gen_request(list(range(50, 60)), max_tokens=5)
        req.request_id = f"r{i}"
        starts.append(wpb.StreamedGenerate(request=req))
    bad = gen_request([1, 2], max_tokens=0)
    bad.request_id = "bad"
    starts.append(wpb.StreamedGenerate(request=bad))
    await call.write(wpb.GenerateStreamRequest(start=starts))
    tokens: dict[str, list[int]] = {}
    errors_seen: dict[str, int] = {}
    done: set[str] = set()
    while len(done) + len(errors_seen) < 4:
        msg = await call.read()
        for out in msg.outputs:
            if out.error_code:
                errors_seen[out.request_id] = out.error_code
                continue
            tokens.setdefault(out.request_id, []).extend(out.response.token_ids)
            if out.response.finish_reason:
                done.add(out.request_id)
    assert errors_seen == {"bad": grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    assert all(tokens[f"r{i}"] == expected for i in range(3))
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_generate_stream_cancel_and_close_free_blocks(tiny_model: Path) -> None:
    w = Worker(WorkerConfig(), make_engine(tiny_model, speedup_ratio=50.0, block_size=4))
    await w.start()
    channel = insecure_channel(w.address)
    stub = wpb_grpc.WorkerServiceStub(channel)

    async def idle() -> cpb.LoadMetrics:
        for _ in range(200):
            load = (await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())).metrics
            if load.kv_active_blocks == 0 and load.num_running_requests == 0:
                break
            await asyncio.sleep(0.01)
        return load

    try:
        call = stub.GenerateStream()
        starts = []
        for i in range(2):
            req = gen_request(list(range(1, 40)), max_tokens=2000)
            req.request_id = f"long{i}"
            starts.append(wpb.StreamedGenerate(request=req))
        await call.write(wpb.GenerateStreamRequest(start=starts))
        await call.read()
        await call.write(wpb.GenerateStreamRequest(cancel_request_ids=["long0"]))
        for _ in range(200):
            load = (await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())).metrics
            if load.num_running_requests == 1:
                break
            await asyncio.sleep(0.01)
        assert load.num_running_requests == 1, "cancelling one request leaves the other running"
        call.cancel()  # ending the stream cancels the rest
        load = await idle()
        assert load.kv_active_blocks == 0 and load.num_running_requests == 0
    finally:
        await channel.close()
        await w.stop()


async def test_generate_stream_duplicate_id_ends_stream(stub: wpb_grpc.WorkerServiceStub) -> None:
    call = stub.GenerateStream()
    req = gen_request(list(range(1, 40)), max_tokens=100)
    req.request_id = "same"
    await call.write(wpb.GenerateStreamRequest(start=[wpb.StreamedGenerate(request=req)] * 2))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            if await call.read() is grpc.aio.EOF:
                break
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
