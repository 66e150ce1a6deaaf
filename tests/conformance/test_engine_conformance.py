"""Engine conformance suite: every Engine adapter must pass these, in-process, without gRPC.

Add an adapter by appending an EngineCase to CASES (e.g. the torch engine on the tiny model, or
vLLM where a GPU is present, marked accordingly). A case builds a fresh, unstarted engine; the
suite starts and stops it. Checks that need engine internals use optional hooks and are skipped
for adapters without them: `cached_blocks(tier)` (the engine's own view of its prefix cache on
each KV tier, in the shape of KvEventLog.cached(tier)) and `cached_block_hashes()` (just the
device tier's hashes). The mocker and the torch engine run twice: as they are, and with KV tiers
(a device pool too small for the suite's prompts, a host tier and a disk tier) below them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import importlib.util
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvmesh.runtime.errors import InvalidRequest, RequestTooLarge, Unavailable
from kvmesh.runtime.kv_events import KvStateMirror, KvTier
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.tinymodel import create_tiny_model
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.mocker import MockerConfig, MockerEngine
from tests.devices import DEVICE

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class EngineCase:
    """How to build one adapter for the suite."""

    name: str
    build: Callable[[], Engine]
    never_generated: frozenset[int] = field(default_factory=frozenset)
    """Token ids the engine must never emit (special/EOS ids it was given)."""
    marks: tuple[pytest.MarkDecorator, ...] = ()


def _tier_dir() -> str:
    root = tempfile.mkdtemp(prefix="kvmesh-conformance-disk-")
    atexit.register(shutil.rmtree, root, True)
    return root


TIERED_BLOCKS = 72
"""Device blocks of the tiered cases: room for the longest prompt (64 blocks), no more."""


def _mocker(tiers: KvTierConfig | None = None) -> Engine:
    return MockerEngine(
        MockerConfig(
            num_gpu_blocks=TIERED_BLOCKS if tiers else 256,
            block_size=16,
            speedup_ratio=1e6,
            # moves this fast pay off even for the mocker's cheap prefills of 16-token blocks
            kv_host_gbps=200.0,
            kv_disk_gbps=100.0,
        ),
        served_model_name="conformance",
        vocab_size=1000,
        special_token_ids=(0, 1),
        eos_token_ids=(2,),
        context_length=1024,
        tiers=tiers,
    )


def _mocker_tiers() -> Engine:
    return _mocker(KvTierConfig(kv_host_blocks=24, kv_disk_blocks=256))


_HAS_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


@functools.cache
def _torch_model() -> tuple[Path, Any]:
    """The tiny model with random weights, loaded once per process (engines share it)."""
    from kvmesh.workers.pytorch.config import TorchDType
    from kvmesh.workers.pytorch.model_runner import load_model
    from kvmesh.workers.pytorch.weights import create_tiny_weights

    root = Path(tempfile.mkdtemp(prefix="kvmesh-conformance-"))
    atexit.register(shutil.rmtree, root, True)
    path = create_tiny_model(root / "tiny-llama")
    create_tiny_weights(path)
    return path, load_model(path, DEVICE, TorchDType.FLOAT32)


def _torch(tiers: KvTierConfig | None = None) -> Engine:
    from kvmesh.workers.pytorch.config import TorchConfig
    from kvmesh.workers.pytorch.engine import TorchEngine

    path, loaded = _torch_model()
    info = ModelDirInfo.load(path)
    blocks = TIERED_BLOCKS if tiers else 256
    return TorchEngine(
        TorchConfig(device=DEVICE, num_gpu_blocks=blocks, max_model_len=1024),
        model_dir=path,
        served_model_name="conformance",
        eos_token_ids=info.eos_token_ids,
        loaded=loaded,
        tiers=tiers,
    )


def _torch_tiers() -> Engine:
    return _torch(KvTierConfig(kv_host_blocks=24, kv_disk_blocks=256, kv_disk_dir=_tier_dir()))


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _adapter(engine: str) -> Callable[[], Engine]:
    """The vLLM / SGLang / TensorRT-LLM adapter over a fake of the engine's own async API (the
    engines need a GPU; see tests/adapter_fakes)."""

    def build() -> Engine:
        from tests.adapter_fakes import build_adapter

        return build_adapter(engine)

    return build


_NEEDS_TORCH = pytest.mark.skipif(
    not _HAS_TORCH, reason="torch/transformers not installed (pip install kvmesh[torch])"
)

CASES = [
    EngineCase("mocker", _mocker, frozenset({0, 1, 2})),
    EngineCase("mocker-tiers", _mocker_tiers, frozenset({0, 1, 2})),
    EngineCase(
        "vllm-adapter",
        _adapter("vllm"),
        frozenset({0, 1, 2}),
        marks=(pytest.mark.skipif(not _has("vllm"), reason="vLLM is not installed"),),
    ),
    EngineCase("sglang-adapter", _adapter("sglang"), frozenset({0, 1, 2})),
    EngineCase("trtllm-adapter", _adapter("trtllm"), frozenset({0, 1, 2})),
    EngineCase("torch", _torch, marks=(_NEEDS_TORCH,)),
    EngineCase("torch-tiers", _torch_tiers, marks=(_NEEDS_TORCH,)),
]


@pytest.fixture(params=[pytest.param(c, id=c.name, marks=c.marks) for c in CASES])
def case(request: pytest.FixtureRequest) -> EngineCase:
    param: EngineCase = request.param
    return param


@contextlib.asynccontextmanager
async def started(case: EngineCase) -> AsyncIterator[Engine]:
    """A fresh engine of `case`, started, stopped on exit."""
    eng = case.build()
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture
async def engine(case: EngineCase) -> AsyncIterator[Engine]:
    async with started(case) as eng:
        yield eng


_ids = iter(range(1 << 30))


def make(
    prompt: list[int] | int = 24,
    max_tokens: int | None = 8,
    *,
    base: int = 10,
    stop_ids: tuple[int, ...] = (),
    min_tokens: int = 0,
    **sampling: object,
) -> EngineRequest:
    if isinstance(prompt, int):
        prompt = [base + (i * 37) % 800 for i in range(prompt)]
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        f"conf-{next(_ids)}",
        prompt,
        SamplingParams(**sampling),  # type: ignore[arg-type]
        StopParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_ids),
    )


async def collect(engine: Engine, request: EngineRequest) -> tuple[list[int], list[EngineOutput]]:
    outs = [o async for o in engine.generate(request)]
    return [t for o in outs for t in o.token_ids], outs


def assert_idle(engine: Engine) -> None:
    load = engine.load()
    assert (load.num_running, load.num_waiting, load.kv_active_blocks) == (0, 0, 0)


async def test_info(engine: Engine) -> None:
    info = engine.info
    assert info.engine and info.served_model_name
    assert info.kv_block_size > 0 and info.kv_total_blocks > 0 and info.context_length > 1
    if engine.kv_events is not None:
        assert "KV_EVENTS" in info.capabilities
    assert engine.load().kv_total_blocks == info.kv_total_blocks


async def test_start_and_stop_are_idempotent(case: EngineCase) -> None:
    eng = case.build()
    await eng.start()
    await eng.start()
    tokens, _ = await collect(eng, make(max_tokens=2))
    assert len(tokens) == 2
    await eng.stop()
    await eng.stop()


async def test_generate_returns_tokens_finish_and_usage(engine: Engine, case: EngineCase) -> None:
    request = make(prompt=30, max_tokens=12)
    tokens, outs = await collect(engine, request)
    final = outs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert final.usage is not None
    assert final.usage.prompt_tokens == 30
    assert final.usage.completion_tokens == len(tokens) == 12
    assert 0 <= final.usage.cached_tokens <= 30
    assert all(o.finish_reason is None and o.usage is None for o in outs[:-1])
    assert not set(tokens) & case.never_generated
    assert_idle(engine)


async def test_streaming_yields_deltas(engine: Engine) -> None:
    request = make(prompt=16, max_tokens=32)
    _, outs = await collect(engine, request)
    assert len(outs) > 1  # streamed, not one final blob
    assert all(o.token_ids for o in outs[:-1])
    assert sum(len(o.token_ids) for o in outs) == 32


async def test_max_tokens_respected(engine: Engine) -> None:
    for n in (1, 3, 17):
        tokens, outs = await collect(engine, make(max_tokens=n))
        assert len(tokens) == n and outs[-1].finish_reason is FinishReason.LENGTH


async def test_until_context_is_full(engine: Engine) -> None:
    ctx = engine.info.context_length
    prompt = ctx - 5
    tokens, outs = await collect(engine, make(prompt=prompt, max_tokens=None))
    assert len(tokens) == 5 and outs[-1].finish_reason is FinishReason.LENGTH


async def test_stop_token_ids(engine: Engine) -> None:
    ref, _ = await collect(engine, make(max_tokens=40, base=50))
    k = next((i for i in range(1, len(ref)) if ref[i] not in ref[:i]), None)
    assert k is not None
    stop = ref[k]
    tokens, outs = await collect(engine, make(max_tokens=40, base=50, stop_ids=(stop,)))
    assert tokens == ref[: k + 1]  # the stop token is included in token_ids
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == stop
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == k + 1
    # min_tokens defers stopping
    tokens, outs = await collect(
        engine, make(max_tokens=40, base=50, stop_ids=(stop,), min_tokens=k + 2)
    )
    assert len(tokens) > k + 1


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"temperature": 0.9, "seed": 11},
        {"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    ],
    ids=["greedy", "seeded", "penalties"],
)
async def test_a_resumed_request_continues_its_output(
    engine: Engine, sampling: dict[str, object]
) -> None:
    """Request migration: the prompt plus the first k output tokens, `resumed_output_tokens=k`
    and the remaining max_tokens give exactly the rest of the unresumed output (penalties and the
    sampling stream count the resumed tokens as output). Engines without RESUME refuse it."""
    request = make(prompt=20, max_tokens=16, **sampling)
    k = 6
    resumed = EngineRequest(
        f"conf-{next(_ids)}",
        list(request.prompt),
        request.sampling,
        StopParams(max_tokens=10),
        resumed_output_tokens=k,
    )
    if "RESUME" not in engine.info.capabilities:
        with pytest.raises(InvalidRequest) as e:
            await collect(engine, resumed)
        assert e.value.param == "resumed_output_tokens"
        return
    full, _ = await collect(engine, request)
    resumed.prompt += full[:k]
    rest, outs = await collect(engine, resumed)
    assert rest == full[k:]
    usage = outs[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (20, 16)
    assert_idle(engine)


async def test_cancel_with_aclose_frees_blocks(engine: Engine) -> None:
    gen = engine.generate(make(prompt=100, max_tokens=None))
    first = await anext(gen)
    assert first.token_ids
    assert engine.load().kv_active_blocks > 0
    await gen.aclose()  # type: ignore[attr-defined]
    assert_idle(engine)


async def test_cancel_by_cancelling_the_task_frees_blocks(engine: Engine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(make(prompt=100, max_tokens=None)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_idle(engine)


async def test_cancel_before_first_token(engine: Engine) -> None:
    gen = engine.generate(make(prompt=200, max_tokens=None))
    task = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0)  # admitted, maybe not scheduled yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gen.aclose()  # type: ignore[attr-defined]
    assert_idle(engine)


async def test_concurrent_requests(engine: Engine) -> None:
    requests = [make(prompt=10 + i, max_tokens=1 + i % 9, base=10 + i) for i in range(40)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for request, (tokens, outs) in zip(requests, results, strict=True):
        assert request.stop.max_tokens is not None
        assert len(tokens) == request.stop.max_tokens
        assert outs[-1].usage is not None and outs[-1].usage.prompt_tokens == len(request.prompt)
    assert_idle(engine)
    assert engine.load().requests_finished_total >= 40


async def test_logprobs(engine: Engine) -> None:
    if "LOGPROBS" not in engine.info.capabilities:
        # Not served as if the field were absent: refused, naming it.
        with pytest.raises(InvalidRequest) as e:
            await anext(engine.generate(make(max_tokens=6, top_logprobs=3)))
        assert e.value.param == "logprobs"
        assert_idle(engine)
        return
    tokens, outs = await collect(engine, make(max_tokens=6, top_logprobs=3))
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    _, outs = await collect(engine, make(max_tokens=3))
    assert all(o.logprobs is None for o in outs)


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("temperature", {"temperature": -1.0}),
        ("top_p", {"top_p": 0.0}),
        ("top_k", {"top_k": -2}),
        ("min_p", {"min_p": 2.0}),
        ("presence_penalty", {"presence_penalty": 3.0}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("top_logprobs", {"top_logprobs": 21}),
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"max_tokens": 2, "min_tokens": 3}),
    ],
)
async def test_bad_options_raise_invalid_request(
    engine: Engine, param: str, kwargs: dict[str, object]
) -> None:
    kwargs = dict(kwargs)  # the parameter dict is shared by every engine case
    max_tokens = kwargs.pop("max_tokens", 4)
    min_tokens = kwargs.pop("min_tokens", 0)
    request = make(max_tokens=max_tokens, min_tokens=min_tokens, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as e:
        await anext(engine.generate(request))
    assert e.value.param == param
    assert_idle(engine)


async def test_empty_prompt_is_invalid(engine: Engine) -> None:
    with pytest.raises(InvalidRequest):
        await anext(engine.generate(make(prompt=[])))


async def test_prompt_too_long(engine: Engine) -> None:
    ctx = engine.info.context_length
    with pytest.raises(RequestTooLarge):
        await anext(engine.generate(make(prompt=ctx)))
    with pytest.raises(RequestTooLarge):
        await anext(engine.generate(make(prompt=ctx - 10, max_tokens=11)))
    assert_idle(engine)


async def test_kv_events_match_engine_cache(engine: Engine, case: EngineCase) -> None:
    log = engine.kv_events
    cached_blocks = getattr(engine, "cached_blocks", None)
    if log is None or cached_blocks is None:
        pytest.skip("engine publishes no KV events or cannot show its cache")
    sub = log.subscribe(None)
    mirror = KvStateMirror()
    mirror.apply(await anext(sub))
    shared = [100 + (i * 13) % 700 for i in range(64)]
    requests = [make(prompt=shared + [900 + i] * (5 + i), max_tokens=20) for i in range(6)]
    await asyncio.gather(*(collect(engine, r) for r in requests))
    assert log.cached() == cached_blocks()
    assert len(log.cached()) >= 4  # the shared prefix at least
    tiered = "tiers" in case.name
    if tiered:  # every tier's published state is the engine's own
        for tier in (KvTier.HOST, KvTier.DISK):
            assert log.cached(tier) == cached_blocks(tier)
        assert log.cached(KvTier.HOST)  # blocks were written through
    hashes = getattr(engine, "cached_block_hashes", None)
    if hashes is not None:
        assert hashes() == set(log.cached())
    # A repeat of a finished prompt hits the cache.
    _, outs = await collect(engine, make(prompt=shared + [900] * 5, max_tokens=2))
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens > 0
    while mirror.last_event_id != log.last_event_id:
        mirror.apply(await asyncio.wait_for(anext(sub), 5))
    assert mirror.state == cached_blocks()
    if tiered:
        for tier in (KvTier.HOST, KvTier.DISK):
            assert mirror.states[tier] == cached_blocks(tier)
    await sub.aclose()  # type: ignore[attr-defined]
    # Clearing with nothing in flight empties the cache (every tier), consistently.
    await engine.clear_kv_cache()
    assert await engine.clear_kv_cache() == 0
    assert log.cached() == cached_blocks() == {}
    if tiered:
        for tier in (KvTier.HOST, KvTier.DISK):
            assert log.cached(tier) == cached_blocks(tier) == {}


async def test_lower_tiers_serve_an_evicted_prefix(engine: Engine, case: EngineCase) -> None:
    if "tiers" not in case.name:
        pytest.skip("no KV tiers below the device pool")
    request = make(prompt=300, max_tokens=6, base=30)  # 18 blocks: fits the host tier
    first, _ = await collect(engine, request)
    for i in range(3):  # 3 x 44 blocks through a 72-block pool and a 24-block host tier
        await collect(engine, make(prompt=700, max_tokens=2, base=100 + i))
    before = {t.tier: t.hit_tokens for t in engine.load().kv_tiers}
    again = make(prompt=list(request.prompt), max_tokens=6)
    tokens, outs = await collect(engine, again)
    assert tokens == first
    usage = outs[-1].usage
    assert usage is not None and usage.cached_tokens == 16 * 18
    after = {t.tier: t.hit_tokens for t in engine.load().kv_tiers}
    lower = sum(after[t] - before[t] for t in (KvTier.HOST, KvTier.DISK))
    assert lower + after[KvTier.DEVICE] - before[KvTier.DEVICE] == usage.cached_tokens
    assert lower > 0  # served from below the device, not recomputed
    assert_idle(engine)


async def test_stop_cancels_in_flight_requests(case: EngineCase) -> None:
    eng = case.build()
    await eng.start()
    gen = eng.generate(make(prompt=50, max_tokens=None))
    await anext(gen)
    await eng.stop()
    rest: list[EngineOutput] = []
    raised = False
    try:
        async for out in gen:
            rest.append(out)
    except asyncio.CancelledError:
        # The contract allows the stream to end with CancelledError: it must be the engine's
        # doing, not a cancellation of this task that the test would be swallowing.
        raised = True
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
    # Either way the request ended as cancelled (never as a normal finish) and the stream is over.
    assert all(out.finish_reason in (None, FinishReason.CANCELLED) for out in rest)
    assert raised or (rest and rest[-1].finish_reason is FinishReason.CANCELLED)
    with pytest.raises(StopAsyncIteration):
        await anext(gen)
    with pytest.raises(Unavailable):
        await anext(eng.generate(make()))
