"""Request migration: a worker dies mid-stream under load and every request still completes.

Workers are real gRPC servers in this process (mocker engines at a realistic pace, so streams are
long-lived), found through the file registry, routed by the KV router. Killing a worker stops its
gRPC server with no grace and no deregistration (as a SIGKILL looks until its lease expires). The
backend resumes each broken request on another worker after the tokens it already delivered, so
the consumer gets one stream with exactly the tokens an unmigrated run gives (the mocker resumes
exactly: GenerateRequest.resumed_output_tokens), usage counted once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.router.backend import (
    BackendConfig,
    MeshBackend,
    MigrationReason,
    resume_request,
)
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import RouterMode, SimpleRouter
from kvmesh.runtime import errors
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.runtime.telemetry import Protocol, TracingConfig, setup_tracing, shutdown_tracing
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    ModelInfo,
    SamplingParams,
    StopParams,
    TokenLogprob,
)
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker

from ..integration.test_worker_contract import make_engine
from ..otlp_receiver import OtlpReceiver
from .mesh import start_pool

pytestmark = pytest.mark.integration

OUTPUT = 200
"""Tokens per request: long enough that the kill lands mid-stream."""


def request(i: int, **sampling: object) -> EngineRequest:
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        f"r{i}",
        [(7 + i * 131 + j * 37) % 3000 + 10 for j in range(40 + i % 7)],
        SamplingParams(top_logprobs=1, **sampling),  # type: ignore[arg-type]
        StopParams(max_tokens=OUTPUT),
    )


class Mesh:
    def __init__(self, tiny_model: Path, registry: Path) -> None:
        self.tiny_model = tiny_model
        self.url = f"file://{registry}"
        self.registry = registry
        self.workers: list[Worker] = []

    async def add(self, wid: str, speedup: float) -> Worker:
        w = Worker(
            WorkerConfig(discovery=self.url, worker_id=wid),
            make_engine(self.tiny_model, speedup_ratio=speedup, block_size=16),
        )
        await w.start()
        self.workers.append(w)
        return w

    async def close(self) -> None:
        for w in self.workers:
            if not w.servicer.draining:
                await w.stop()


@pytest.fixture
async def mesh(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    m = Mesh(tiny_model, tmp_path / "registry")
    yield m
    await m.close()


async def crash(w: Worker) -> None:
    """A crash as peers see it: every call dropped at once, the registration left behind."""
    w.servicer.draining = True
    await w.server.stop(0)
    await w.engine.stop()


async def collect(
    backend: MeshBackend, req: EngineRequest, trace: TraceContext | None = None
) -> tuple[list[int], list[TokenLogprob], EngineOutput]:
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    final: EngineOutput | None = None
    async for out in backend.generate("tiny", req, trace):
        tokens += out.token_ids
        logprobs += out.logprobs or []
        if out.finish_reason is not None:
            final = out
    assert final is not None
    return tokens, logprobs, final


async def pool_of(mesh: Mesh, n: int) -> WorkerPool:
    pool = WorkerPool(FileDiscovery(mesh.registry, ttl_s=60.0, poll_s=0.05))
    await pool.start()
    await pool.wait_for(n, timeout_s=20)
    return pool


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"]
)
async def test_killing_a_worker_mid_stream_loses_no_request(
    mesh: Mesh, sampling: dict[str, object]
) -> None:
    """c = 30 streams of 200 tokens over 3 workers; one worker crashes mid-stream: 100 % of the
    requests complete with all their tokens, token for token (logprobs too) what an unmigrated
    run gives, usage counted once, and the migrations are counted."""
    for i in range(3):
        await mesh.add(f"w{i}", speedup=2.0)  # ~15-40 ms per step: each stream lasts seconds
    pool = await pool_of(mesh, 3)
    backend = MeshBackend(pool, KvRouter(pool))
    requests = [request(i, **sampling) for i in range(30)]
    try:
        tasks = [asyncio.create_task(collect(backend, r)) for r in requests]
        victim = mesh.workers[0]
        async with asyncio.timeout(30):
            while victim.engine.load().num_running < 5:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # mid-stream: tokens already delivered
        assert victim.engine.load().num_running > 0
        await crash(victim)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        migrated = backend.stats.migrations[MigrationReason.STREAM_LOST]
        assert migrated >= 1

        # The same requests on the survivors, no fault: the reference output.
        refs = await asyncio.gather(
            *(collect(backend, dataclasses.replace(r, request_id=f"{r.request_id}-ref"))
              for r in requests)
        )  # fmt: skip
        for r, (tokens, logprobs, final), (ref_tokens, ref_logprobs, _) in zip(
            requests, results, refs, strict=True
        ):
            assert len(tokens) == OUTPUT and tokens == ref_tokens, r.request_id
            assert logprobs == ref_logprobs
            assert final.finish_reason is FinishReason.LENGTH
            assert final.usage is not None
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
                len(r.prompt),
                OUTPUT,
            )
        assert backend.admission.running == 0
    finally:
        await pool.stop()


async def test_the_migration_limit_bounds_moves(mesh: Mesh) -> None:
    """--migration-limit 0: a broken stream ends the request with Unavailable (the old behaviour,
    an in-band error), never a silent truncation."""
    for i in range(2):
        await mesh.add(f"w{i}", speedup=2.0)
    pool = await pool_of(mesh, 2)
    backend = MeshBackend(
        pool, SimpleRouter(pool, RouterMode.ROUND_ROBIN), disagg=BackendConfig(migration_limit=0)
    )
    try:
        task = asyncio.create_task(collect(backend, request(1)))
        victim = None
        async with asyncio.timeout(30):
            while victim is None:
                victim = next((w for w in mesh.workers if w.engine.load().num_running), None)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await crash(victim)
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(task, 30)
        assert sum(backend.stats.migrations.values()) == 0
    finally:
        await pool.stop()


async def test_a_migration_shows_on_the_trace(mesh: Mesh) -> None:
    """The attempt after a migration routes again: its `route` span (a child of the caller's,
    as the first one) says why the request moved, from which worker and after how many tokens."""
    receiver = OtlpReceiver().start()
    config = TracingConfig(otel_endpoint=receiver.endpoint, otel_protocol=Protocol.GRPC)
    t = setup_tracing(config, "frontend")
    parent = TraceContext.parse_traceparent(
        "00-5af7183fb1d4cf5f21b34b2b1c9e4a01-00f067aa0ba902b7-01"
    )
    assert parent is not None
    pool = None
    try:
        for i in range(2):
            await mesh.add(f"w{i}", speedup=2.0)
        pool = await pool_of(mesh, 2)
        backend = MeshBackend(pool, SimpleRouter(pool, RouterMode.ROUND_ROBIN))
        task = asyncio.create_task(collect(backend, request(3), parent))
        victim = None
        async with asyncio.timeout(30):
            while victim is None:
                victim = next((w for w in mesh.workers if w.engine.load().num_running), None)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # mid-stream
        await crash(victim)
        tokens, _, _ = await asyncio.wait_for(task, 60)
        assert len(tokens) == OUTPUT
        assert t.flush()
        routes = [s for s in receiver.spans(parent.trace_id) if s.name == "route"]
        assert len(routes) == 2, routes
        first, second = sorted(routes, key=lambda s: s.start_ns)
        assert {first.parent_span_id, second.parent_span_id} == {parent.span_id}
        assert "kvmesh.migration.reason" not in first.attributes
        assert first.attributes["kvmesh.route.worker_id"] == victim.config.worker_id
        moved = second.attributes
        assert moved["kvmesh.migration.reason"] == MigrationReason.STREAM_LOST.value
        assert moved["kvmesh.migration.from_worker_id"] == victim.config.worker_id
        assert moved["kvmesh.route.worker_id"] != victim.config.worker_id
        assert moved["kvmesh.migration.count"] == 1
        assert 0 < moved["kvmesh.migration.resumed_tokens"] < OUTPUT
    finally:
        if pool is not None:
            await pool.stop()
        shutdown_tracing()
        setup_tracing(TracingConfig(), "test")  # back to off
        receiver.stop()


def test_what_can_be_resumed() -> None:
    """resume_request: RESUME engines continue every sampling mode (resumed tokens marked);
    others only greedy requests without output penalties (a longer prompt, nothing marked);
    guided decoding never; max_tokens and min_tokens shrink by what was delivered."""
    resume = ModelInfo("m", "mocker", 16, 100, 1000, capabilities=("RESUME",))
    plain = ModelInfo("m", "vllm", 16, 100, 1000)
    base = EngineRequest("r", [1, 2, 3], SamplingParams(temperature=0.0), StopParams(10, 4))
    assert resume_request(base, [], plain) is base
    r = resume_request(base, [7, 8], resume)
    assert r is not None and r.prompt == [1, 2, 3, 7, 8] and r.resumed_output_tokens == 2
    assert (r.stop.max_tokens, r.stop.min_tokens) == (8, 2)
    again = resume_request(r, [9], resume)  # a second migration keeps counting
    assert again is not None and again.resumed_output_tokens == 3
    p = resume_request(base, [7, 8], plain)
    assert p is not None and p.prompt == [1, 2, 3, 7, 8] and p.resumed_output_tokens == 0
    sampled = dataclasses.replace(base, sampling=SamplingParams(temperature=0.7, seed=1))
    assert resume_request(sampled, [7], plain) is None
    assert resume_request(sampled, [7], resume) is not None
    penalty = dataclasses.replace(base, sampling=SamplingParams(0.0, presence_penalty=1.0))
    assert resume_request(penalty, [7], plain) is None
    guided = dataclasses.replace(
        base, sampling=SamplingParams(0.0, guided=GuidedDecoding(GuidedKind.JSON_OBJECT))
    )
    assert resume_request(guided, [7], resume) is None


async def test_a_migrated_torch_request_gives_the_unmigrated_greedy_text(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two torch workers (the tiny model with its deterministic weights); the worker serving a
    greedy request crashes after 25 of its tokens reached the consumer: the rest comes from the
    other worker, and the text equals the unmigrated request's, and transformers' generate()."""
    pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
    import shutil

    import torch
    from tokenizers import Tokenizer

    from kvmesh.runtime.modeldir import ModelDirInfo
    from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
    from kvmesh.workers.pytorch.engine import TorchEngine
    from kvmesh.workers.pytorch.model_runner import load_model
    from kvmesh.workers.pytorch.weights import create_tiny_weights

    model_dir = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model, model_dir)
    create_tiny_weights(model_dir)
    loaded = load_model(model_dir, "cpu", TorchDType.FLOAT32)
    info = ModelDirInfo.load(model_dir)
    url = f"file://{tmp_path / 'registry'}"
    workers = [
        Worker(
            WorkerConfig(discovery=url, worker_id=f"t{i}"),
            TorchEngine(
                TorchConfig(device="cpu", num_gpu_blocks=64),
                model_dir=model_dir,
                served_model_name="tiny",
                eos_token_ids=info.eos_token_ids,
                loaded=loaded,
            ),
        )
        for i in range(2)
    ]
    pool = await start_pool(workers, tmp_path / "registry")
    backend = MeshBackend(pool, KvRouter(pool))
    prompt = [(11 + i * 53) % 3900 + 20 for i in range(40)]
    n = 120
    req = EngineRequest(
        "t", prompt, SamplingParams(temperature=0.0), StopParams(max_tokens=n, ignore_eos=True)
    )
    try:
        unmigrated, _, _ = await collect(backend, dataclasses.replace(req, request_id="ref"))
        migrated: list[int] = []
        victim = None
        async for out in backend.generate("tiny", req, None):
            migrated += out.token_ids
            if victim is None and len(migrated) >= 25:
                victim = next(w for w in workers if w.engine.load().num_running)
                await crash(victim)
        assert victim is not None
        assert backend.stats.migrations[MigrationReason.STREAM_LOST] == 1
        assert len(migrated) == n and migrated == unmigrated
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        assert tok.decode(migrated) == tok.decode(unmigrated)
        ids = torch.tensor([prompt])
        expected = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=info.eos_token_ids[0],
        )[0, len(prompt) :].tolist()
        assert migrated == expected
    finally:
        await pool.stop()
        for w in workers:
            if not w.servicer.draining:
                await w.stop()
