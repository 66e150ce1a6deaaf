"""Disaggregated serving with the mocker, in-process: a prefill engine pins a prompt's blocks,
a decode engine "pulls" them (simulated transfer time, real block bookkeeping), releases them on
the prefill engine and decodes after the first token. Output equals aggregated serving; every
path (success, first token that ends the request, expiry, cancellation, released-before-pull,
engine stop) returns both pools to their baseline."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvmesh.runtime import wire
from kvmesh.runtime.errors import Unimplemented
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    KvTransferHandle,
    Role,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.engine import DisaggSettings, Engine
from kvmesh.workers.mocker import MockerConfig, MockerEngine
from kvmesh.workers.server import WorkerServicer

pytestmark = pytest.mark.unit


def mocker(**cfg: object) -> MockerEngine:
    settings: dict[str, object] = {
        "num_gpu_blocks": 64,
        "block_size": 4,
        "speedup_ratio": 1e6,
        **cfg,
    }
    config = MockerConfig(**settings)  # type: ignore[arg-type]
    return MockerEngine(
        config,
        served_model_name="m",
        vocab_size=1000,
        special_token_ids=(0, 1),
        eos_token_ids=(2,),
        context_length=512,
    )


class Pair:
    """A prefill and a decode mocker; the decode side releases through the prefill engine."""

    def __init__(self, prefill: MockerEngine, decode: MockerEngine, pin_timeout_s: float = 30):
        self.p, self.d = prefill, decode
        self.releases: list[tuple[str, bool]] = []

        async def release(handle: KvTransferHandle) -> bool:
            released = await self.p.release_kv(handle.transfer_id)
            self.releases.append((handle.transfer_id, released))
            return released

        prefill.configure_disaggregation(
            DisaggSettings(role=Role.PREFILL, pin_timeout_s=pin_timeout_s)
        )
        decode.configure_disaggregation(DisaggSettings(role=Role.DECODE, release_remote=release))

    async def run(self, req: EngineRequest) -> tuple[list[int], EngineOutput]:
        """Prefill on P, continue on D: all tokens and the last output."""
        result = await self.p.prefill_remote(req)
        first = result.remote.first_token_id
        if result.finish_reason is not None:
            return [first], EngineOutput([first], finish_reason=result.finish_reason)
        tokens, last = await collect(self.d, dataclasses.replace(req, remote_prefill=result.remote))
        return [first, *tokens], last


async def collect(engine: Engine, req: EngineRequest) -> tuple[list[int], EngineOutput]:
    tokens: list[int] = []
    last = None
    async for out in engine.generate(req):
        tokens += out.token_ids
        last = out
    assert last is not None and last.finish_reason is not None
    return tokens, last


def request(rid: str, prompt: list[int], max_tokens: int = 8, **sampling: object) -> EngineRequest:
    return EngineRequest(
        rid,
        prompt,
        SamplingParams(**{"temperature": 0.0, **sampling}),  # type: ignore[arg-type]
        StopParams(max_tokens=max_tokens),
    )


def baseline(*engines: MockerEngine) -> None:
    for e in engines:
        load = e.load()
        assert (load.kv_active_blocks, load.kv_pinned_blocks) == (0, 0), load
        assert (load.num_running, load.num_waiting) == (0, 0), load
        e.scheduler.check_invariants()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = Pair(mocker(), mocker())
    await p.p.start()
    await p.d.start()
    yield p
    await p.p.stop()
    await p.d.stop()


@pytest.fixture
async def agg() -> AsyncIterator[MockerEngine]:
    e = mocker()
    await e.start()
    yield e
    await e.stop()


PROMPTS = [[10 + (7 * i + 3 * n) % 900 for i in range(n)] for n in (1, 3, 4, 5, 17, 40)]
UNSHARED = [500 + i for i in range(40)]
"""A 40-token prompt sharing no prefix with PROMPTS[-1] (it needs blocks of its own)."""


async def test_output_equals_aggregated_and_pools_return_to_baseline(
    pair: Pair, agg: MockerEngine
) -> None:
    for i, prompt in enumerate(PROMPTS):
        for sampling in ({}, {"temperature": 0.8, "seed": 7}):
            req = request(f"r{i}", prompt, **sampling)
            want, want_last = await collect(agg, req)
            got, last = await pair.run(req)
            assert got == want
            assert last.finish_reason is FinishReason.LENGTH and last.usage is not None
            assert want_last.usage is not None
            assert last.usage.completion_tokens == want_last.usage.completion_tokens == 8
            assert last.usage.prompt_tokens == len(prompt)
            assert not last.remote_prefill_fallback
            baseline(pair.p, pair.d)
    assert all(released for _, released in pair.releases)
    # The decode engine's cache (and so its KV events) holds the transferred prompt blocks.
    cached = {toks for _, toks, _ in pair.d.cached_blocks().values()}
    assert tuple(PROMPTS[-1][:4]) in cached and tuple(PROMPTS[-1][36:40]) in cached
    events = pair.d.kv_events
    assert events is not None and set(events.cached()) == pair.d.cached_block_hashes()


async def test_concurrent_requests_and_a_prefix_cached_on_the_decode_side(
    pair: Pair, agg: MockerEngine
) -> None:
    reqs = [request(f"c{i}", p, max_tokens=5) for i, p in enumerate(PROMPTS)]
    want = await asyncio.gather(*(collect(agg, r) for r in reqs))
    got = await asyncio.gather(*(pair.run(r) for r in reqs))
    assert [g[0] for g in got] == [w[0] for w in want]
    # A longer prompt sharing the 40-token prompt's blocks: only the new blocks move.
    longer = [*PROMPTS[-1], 5, 6, 7, 8, 9]
    stats = pair.d.stats
    assert stats is not None
    before = stats.external_prefix_query_tokens, stats.external_prefix_hit_tokens
    _, last = await pair.run(request("l", longer))
    block_bytes = pair.d.config.kv_block_bytes
    assert last.kv_transfer_bytes == 2 * block_bytes  # blocks 11 (full) and 12 (partial)
    # The worker's metrics: the 5 tokens past the 10 cached blocks came from the prefill side.
    after = stats.external_prefix_query_tokens, stats.external_prefix_hit_tokens
    assert (after[0] - before[0], after[1] - before[1]) == (5, 5)
    assert stats.kv_transfer_failures == 0
    baseline(pair.p, pair.d)


async def test_first_token_that_ends_the_request_pins_nothing(
    pair: Pair, agg: MockerEngine
) -> None:
    result = await pair.p.prefill_remote(request("one", PROMPTS[3], max_tokens=1))
    assert result.finish_reason is FinishReason.LENGTH and result.remote.handle is None
    baseline(pair.p)
    first = (await collect(agg, request("x", PROMPTS[3])))[0][0]
    req = request("stop", PROMPTS[3])
    req.stop = StopParams(max_tokens=8, stop_token_ids=(first,))
    result = await pair.p.prefill_remote(req)
    assert result.finish_reason is FinishReason.STOP and result.stop_token_id == first
    assert result.usage.completion_tokens == 1
    baseline(pair.p)


async def test_release_is_idempotent_and_unreleased_blocks_expire() -> None:
    pair = Pair(mocker(), mocker(), pin_timeout_s=0.05)
    await pair.p.start()
    await pair.d.start()
    try:
        result = await pair.p.prefill_remote(request("a", PROMPTS[4]))
        handle = result.remote.handle
        assert handle is not None and pair.p.load().kv_pinned_blocks == 5
        assert 0 < handle.expires_after_ms <= 50
        assert await pair.p.release_kv(handle.transfer_id) is True
        assert await pair.p.release_kv(handle.transfer_id) is False
        baseline(pair.p)

        result = await pair.p.prefill_remote(request("b", PROMPTS[4]))
        assert pair.p.num_pinned_transfers == 1
        await asyncio.sleep(0.1)  # nobody releases: the blocks expire
        baseline(pair.p)
        # A decode worker arriving late cannot confirm the pull: it recomputes the prompt.
        req = dataclasses.replace(request("b", PROMPTS[4]), remote_prefill=result.remote)
        tokens, last = await collect(pair.d, req)
        assert last.remote_prefill_fallback and last.kv_transfer_bytes == 0
        assert [result.remote.first_token_id, *tokens] == (
            await pair.run(request("c", PROMPTS[4]))
        )[0]
        baseline(pair.p, pair.d)
    finally:
        await pair.p.stop()
        await pair.d.stop()


async def test_release_by_the_prefill_request_id() -> None:
    # A caller that left as PrefillRemote answered never saw the transfer id: it releases by
    # the id of its request. Every transfer pinned under that id goes; others stay.
    pair = Pair(mocker(), mocker())
    await pair.p.start()
    try:
        a1 = await pair.p.prefill_remote(request("a", PROMPTS[4]))
        a2 = await pair.p.prefill_remote(request("a", PROMPTS[3]))  # ids are the caller's
        b = await pair.p.prefill_remote(request("b", PROMPTS[5]))
        assert pair.p.num_pinned_transfers == 3
        assert await pair.p.release_kv(request_id="nobody") is False
        assert await pair.p.release_kv(request_id="a") is True
        assert pair.p.num_pinned_transfers == 1
        assert await pair.p.release_kv(request_id="a") is False
        for gone in (a1, a2):
            assert gone.remote.handle is not None
            assert await pair.p.release_kv(gone.remote.handle.transfer_id) is False
        assert b.remote.handle is not None
        # by transfer id first: the request id then finds nothing left, and the call says
        # it released (this call did)
        assert await pair.p.release_kv(b.remote.handle.transfer_id, "b") is True
        assert await pair.p.release_kv(request_id="b") is False
        baseline(pair.p)
    finally:
        await pair.p.stop()


class LeftAsItAnswered:
    """A gRPC servicer context whose caller cancelled as the handler returned."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], object]] = []

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def add_done_callback(self, callback: Callable[[Any], object]) -> None:
        self.callbacks.append(callback)

    def cancelled(self) -> bool:
        return True


async def test_the_worker_releases_what_a_cancelled_prefill_remote_pinned() -> None:
    # The other side of the race: the caller's cancellation reached the prefill worker's
    # server as the handler returned, so the answer (and the transfer id) was never sent.
    engine = mocker()
    engine.configure_disaggregation(DisaggSettings(role=Role.PREFILL))
    await engine.start()
    try:
        servicer = WorkerServicer(engine, "p0")
        context = LeftAsItAnswered()
        pb = wire.prefill_request_to_pb(request("left", PROMPTS[4]))
        resp = await servicer.PrefillRemote(pb, context)  # type: ignore[arg-type]
        assert resp.result.handle.transfer_id and engine.load().kv_pinned_blocks == 5
        assert len(context.callbacks) == 1
        context.callbacks[0](context)  # the RPC ended, cancelled
        for _ in range(10):
            await asyncio.sleep(0)
        baseline(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("freed_by", ["release", "expiry"])
async def test_a_prefill_waiting_for_pinned_blocks_runs_once_they_are_freed(freed_by: str) -> None:
    # 12 blocks: one 40-token prompt (10 blocks of 4) pins most of them, so a second one waits
    # for them. Freeing them (a decode worker's release, or their expiry) must start it with
    # no other event: at the end of a burst no new arrival wakes the engine up.
    pair = Pair(mocker(num_gpu_blocks=12), mocker(), pin_timeout_s=0.3)
    await pair.p.start()
    try:
        first = await pair.p.prefill_remote(request("a", PROMPTS[-1]))
        handle = first.remote.handle
        assert handle is not None and pair.p.load().kv_pinned_blocks == 10
        waiting = asyncio.create_task(pair.p.prefill_remote(request("b", UNSHARED)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and pair.p.load().num_waiting == 1
        if freed_by == "release":
            assert await pair.p.release_kv(handle.transfer_id) is True
        second = await asyncio.wait_for(waiting, 2.0)  # its 0.3 s expiry, or the release
        assert second.remote.handle is not None
        assert await pair.p.release_kv(second.remote.handle.transfer_id) is True
        baseline(pair.p)
    finally:
        await pair.p.stop()


async def test_a_failing_release_falls_back_to_recompute(agg: MockerEngine) -> None:
    p, d = mocker(), mocker()

    async def unreachable(handle: KvTransferHandle) -> bool:
        raise ConnectionError("the prefill worker is gone")

    p.configure_disaggregation(DisaggSettings(role=Role.PREFILL))
    d.configure_disaggregation(DisaggSettings(role=Role.DECODE, release_remote=unreachable))
    await p.start()
    await d.start()
    try:
        req = request("u", PROMPTS[4])
        result = await p.prefill_remote(req)
        handle = result.remote.handle
        assert handle is not None
        tokens, last = await collect(d, dataclasses.replace(req, remote_prefill=result.remote))
        # Unconfirmed KV is never used: the decode side recomputes and frees what it received.
        assert last.remote_prefill_fallback and last.kv_transfer_bytes == 0
        assert d.stats is not None and d.stats.kv_transfer_failures == 1
        assert d.stats.external_prefix_hit_tokens == 0
        assert d.stats.external_prefix_query_tokens == len(req.prompt)
        assert [result.remote.first_token_id, *tokens] == (await collect(agg, req))[0]
        baseline(d)
        assert await p.release_kv(handle.transfer_id) is True  # still pinned: never released
        baseline(p)
    finally:
        await p.stop()
        await d.stop()


async def test_cancelling_a_prefill_frees_its_blocks() -> None:
    pair = Pair(mocker(speedup_ratio=0.05), mocker())  # a 40-token prefill takes ~0.3 s
    await pair.p.start()
    try:
        task = asyncio.create_task(pair.p.prefill_remote(request("slow", PROMPTS[-1])))
        await asyncio.sleep(0.05)
        assert pair.p.load().kv_active_blocks > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        baseline(pair.p)
    finally:
        await pair.p.stop()


async def test_cancelling_during_the_transfer_releases_both_sides() -> None:
    # 0.5 s simulated transfer: the client goes away in the middle of it. D has 12 blocks, 10
    # of them reserved for the transfer, so a local 40-token prompt waits for them: it must
    # start once the transfer ends and D frees them, with no other event to wake D up.
    pair = Pair(mocker(), mocker(num_gpu_blocks=12, speedup_ratio=1.0, kv_transfer_latency_ms=500))
    await pair.p.start()
    await pair.d.start()
    try:
        result = await pair.p.prefill_remote(request("t", PROMPTS[-1]))
        req = dataclasses.replace(request("t", PROMPTS[-1]), remote_prefill=result.remote)
        stream = pair.d.generate(req)
        task = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.05)
        assert pair.d.load().kv_active_blocks == 10  # reserved for the incoming blocks
        local = asyncio.create_task(collect(pair.d, request("l", UNSHARED)))
        await asyncio.sleep(0.05)
        assert not local.done() and pair.d.load().num_waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        tokens, _ = await asyncio.wait_for(local, 3.0)  # the transfer ends at ~0.5 s
        assert len(tokens) == 8
        for _ in range(100):  # the transfer ends, D releases P's blocks and its own
            if not pair.d.load().kv_active_blocks and not pair.p.load().kv_pinned_blocks:
                break
            await asyncio.sleep(0.02)
        baseline(pair.p, pair.d)
        handle = result.remote.handle
        assert handle is not None and pair.releases == [(handle.transfer_id, True)]
    finally:
        await pair.p.stop()
        await pair.d.stop()


async def test_stopping_engines_mid_transfer_leaks_nothing() -> None:
    pair = Pair(mocker(), mocker(speedup_ratio=1.0, kv_transfer_latency_ms=500))
    await pair.p.start()
    await pair.d.start()
    result = await pair.p.prefill_remote(request("s", PROMPTS[-1]))
    req = dataclasses.replace(request("s", PROMPTS[-1]), remote_prefill=result.remote)
    stream = pair.d.generate(req)
    task = asyncio.create_task(anext(stream))
    await asyncio.sleep(0.05)
    await pair.d.stop()  # the pull is abandoned; its reserved blocks are freed
    out = await task
    assert out.finish_reason is FinishReason.CANCELLED
    baseline(pair.d)
    await pair.p.stop()  # pinned blocks are freed on stop as well
    baseline(pair.p)


async def test_roles_and_capabilities() -> None:
    e = mocker()
    assert "DISAGGREGATION" not in e.info.capabilities
    e.configure_disaggregation(DisaggSettings(role=Role.DECODE))
    assert e.info.role is Role.DECODE and "DISAGGREGATION" in e.info.capabilities

    class Plain(MockerEngine):
        configure_disaggregation = Engine.configure_disaggregation

    with pytest.raises(Unimplemented):
        Plain(MockerConfig(), served_model_name="m", vocab_size=10).configure_disaggregation(
            DisaggSettings(role=Role.PREFILL)
        )
