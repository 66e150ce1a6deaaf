"""MockerEngine specifics: virtual time, speedup, batching of deltas, idling, cache clearing."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kvmesh.runtime.clock import ManualClock
from kvmesh.runtime.errors import InvalidRequest, ResourceExhausted, Unavailable
from kvmesh.runtime.kv_events import AllCleared, BlocksRemoved
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.mocker import MockerConfig, MockerEngine, PolynomialTiming

pytestmark = pytest.mark.unit


def engine(
    clock: ManualClock | None = None, context_length: int = 4096, **cfg: object
) -> MockerEngine:
    config = MockerConfig(**{"speedup_ratio": 1e6, "block_size": 16, "num_gpu_blocks": 256, **cfg})  # type: ignore[arg-type]
    return MockerEngine(
        config,
        served_model_name="mock",
        vocab_size=500,
        special_token_ids=(0,),
        eos_token_ids=(1,),
        context_length=context_length,
        clock=clock,
    )


def req(
    rid: str, prompt: int | list[int] = 20, max_tokens: int | None = 4, **kw: object
) -> EngineRequest:
    if isinstance(prompt, int):
        prompt = [10 + (i * 31) % 400 for i in range(prompt)]
    return EngineRequest(
        rid, prompt, SamplingParams(temperature=0.0, **kw), StopParams(max_tokens=max_tokens)
    )  # type: ignore[arg-type]


async def collect(eng: MockerEngine, request: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(request)]


async def test_info_and_capabilities() -> None:
    eng = engine(max_model_len=2048)
    info = eng.info
    assert (info.engine, info.kv_block_size, info.kv_total_blocks) == ("mocker", 16, 256)
    assert info.context_length == 2048 and info.eos_token_ids == (1,)
    assert set(info.capabilities) == {"KV_EVENTS", "LOGPROBS", "LORA", "RESUME"}
    assert eng.kv_events is not None
    plain = engine(
        enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=512
    )
    assert plain.kv_events is None and "KV_EVENTS" not in plain.info.capabilities
    assert plain.info.context_length == 512  # without chunked prefill a prompt must fit a step


@pytest.mark.parametrize("speedup", [1.0, 10.0])
async def test_virtual_time_follows_the_timing_model(speedup: float) -> None:
    clock = ManualClock()
    eng = engine(clock, num_gpu_blocks=100, speedup_ratio=speedup)
    await eng.start()
    outs = await collect(eng, req("a", 1000, max_tokens=3))
    await eng.stop()
    assert sum(len(o.token_ids) for o in outs) == 3
    poly = PolynomialTiming()
    # step 1 prefills 1000 tokens (first token, no decode time); steps 2-3 decode 1001 and 1002
    # context tokens in 100 blocks x 16 token slots
    expected_ms = poly.prefill_ms(1000) + poly.decode_ms(1001 / 1600) + poly.decode_ms(1002 / 1600)
    assert clock.now() == pytest.approx(expected_ms / 1000 / speedup)


async def test_timing_profile_is_used(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "prefill_tokens": [0, 100],
                "prefill_ms": [0, 50],
                "decode_kv_usage": [0, 1],
                "decode_ms": [10, 10],
            }
        )
    )
    clock = ManualClock()
    eng = engine(clock, timing_profile=str(path), speedup_ratio=1.0)
    await eng.start()
    await collect(eng, req("a", 100, max_tokens=2))
    await eng.stop()
    assert clock.now() == pytest.approx(0.050 + 0.010)


async def test_slow_consumer_gets_several_tokens_per_output() -> None:
    eng = engine()
    await eng.start()
    gen = eng.generate(req("a", 20, max_tokens=40))
    first = await anext(gen)
    await asyncio.sleep(0.05)  # the engine keeps stepping meanwhile
    rest = [o async for o in gen]
    await eng.stop()
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 40
    assert any(len(o.token_ids) > 1 for o in rest)
    assert rest[-1].finish_reason is FinishReason.LENGTH


async def test_loop_idles_without_work() -> None:
    eng = engine()
    await eng.start()
    await collect(eng, req("a"))
    steps = eng.scheduler.num_steps
    await asyncio.sleep(0.05)
    assert eng.scheduler.num_steps == steps
    await collect(eng, req("b"))  # and wakes up again
    assert eng.scheduler.num_steps > steps
    await eng.stop()


async def test_yields_to_the_event_loop_every_step() -> None:
    eng = engine(speedup_ratio=1e12)
    await eng.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await collect(eng, req("a", max_tokens=200))
    t.cancel()
    await eng.stop()
    assert ticks >= 100


async def test_requests_that_cannot_fit() -> None:
    eng = engine(num_gpu_blocks=4)
    await eng.start()
    with pytest.raises(ResourceExhausted):
        await anext(eng.generate(req("a", 100)))  # 7 blocks > 4
    await collect(eng, req("ok", 60, max_tokens=2))
    await eng.stop()


async def test_duplicate_request_id_and_not_started() -> None:
    eng = engine()
    with pytest.raises(Unavailable):
        await anext(eng.generate(req("a")))
    await eng.start()
    gen = eng.generate(req("a", max_tokens=None))
    await anext(gen)
    with pytest.raises(InvalidRequest):
        await anext(eng.generate(req("a")))
    await gen.aclose()
    await collect(eng, req("a"))  # the id is free again
    await eng.stop()


async def test_stop_finishes_streams_with_cancelled_and_usage() -> None:
    eng = engine()
    await eng.start()
    gen = eng.generate(req("a", 30, max_tokens=None))
    await anext(gen)
    waiting = asyncio.create_task(collect(eng, req("b", 30, max_tokens=None)))
    await asyncio.sleep(0.01)
    await eng.stop()
    rest = [o async for o in gen]
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert rest[-1].usage is not None and rest[-1].usage.prompt_tokens == 30
    outs = await waiting
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert eng.load().kv_active_blocks == 0


async def test_prefix_hits_show_in_usage_and_load() -> None:
    eng = engine()
    await eng.start()
    first = await collect(eng, req("a", 100, max_tokens=2))
    again = await collect(eng, req("b", 100, max_tokens=2))
    await eng.stop()
    assert first[-1].usage is not None and first[-1].usage.cached_tokens == 0
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == 96
    assert eng.load().prefix_cache_hit_rate == pytest.approx(96 / 200)
    assert [t for o in first for t in o.token_ids] == [t for o in again for t in o.token_ids]


async def test_clear_kv_cache_keeps_events_consistent() -> None:
    eng = engine()
    log = eng.kv_events
    assert log is not None
    await eng.start()
    await collect(eng, req("done", 64, max_tokens=2))
    held = eng.generate(req("held", [7] * 64, max_tokens=None))
    await anext(held)
    before = log.last_event_id
    dropped = await eng.clear_kv_cache()
    assert dropped == 4  # the finished request's blocks; the held ones stay
    (ev,) = log.events_since(before) or []
    assert isinstance(ev.kind, BlocksRemoved)
    assert log.cached() == eng.cached_blocks() and len(log.cached()) >= 4
    await held.aclose()
    assert await eng.clear_kv_cache() > 0
    assert isinstance((log.events_since(log.last_event_id - 1) or [])[0].kind, AllCleared)
    assert log.cached() == eng.cached_blocks() == {}
    last = log.last_event_id
    assert await eng.clear_kv_cache() == 0 and log.last_event_id == last
    await eng.stop()


async def test_without_prefix_caching_nothing_is_reused() -> None:
    eng = engine(enable_prefix_caching=False)
    await eng.start()
    await collect(eng, req("a", 100, max_tokens=2))
    outs = await collect(eng, req("b", 100, max_tokens=2))
    await eng.stop()
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 0
    assert eng.cached_blocks() == {}


async def test_many_concurrent_requests_are_fast() -> None:
    eng = engine(num_gpu_blocks=4096)
    await eng.start()
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(collect(eng, req(f"r{i}", 64 + i, max_tokens=8)) for i in range(200))
    )
    elapsed = time.perf_counter() - t0
    await eng.stop()
    assert all(sum(len(o.token_ids) for o in outs) == 8 for outs in results)
    assert elapsed < 2.0, elapsed


class GateClock:
    """A clock whose sleep waits until the test opens the gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sleeping = asyncio.Event()

    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        self.sleeping.set()
        await self.gate.wait()


async def test_stop_while_a_finished_step_is_undelivered() -> None:
    clock = GateClock()
    eng = MockerEngine(
        MockerConfig(block_size=16, num_gpu_blocks=64),
        served_model_name="m",
        vocab_size=100,
        clock=clock,
    )
    await eng.start()
    task = asyncio.create_task(collect(eng, req("a", 10, max_tokens=1)))
    await asyncio.wait_for(clock.sleeping.wait(), 5)  # finished in the scheduler, not delivered
    assert eng.load().requests_finished_total == 1
    await eng.stop()
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 0


class BrokenClock:
    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        raise RuntimeError("boom")


async def test_a_failing_loop_fails_requests_instead_of_hanging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = MockerEngine(
        MockerConfig(block_size=16, num_gpu_blocks=64),
        served_model_name="m",
        vocab_size=100,
        clock=BrokenClock(),
    )
    await eng.start()
    with pytest.raises(Unavailable, match="boom"):
        await asyncio.wait_for(collect(eng, req("a", 10, max_tokens=3)), 5)
    assert "mocker engine loop failed" in caplog.text
    with pytest.raises(Unavailable):
        await anext(eng.generate(req("b")))
    await eng.stop()
