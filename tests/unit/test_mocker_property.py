"""Property test: random workloads on a small pool (eviction, preemption, aborts, clears).

After every operation the KV event log's implied state equals the pool's cached blocks, the pool's
reference counts match what requests hold, and subscribers (one from the start, one resuming from
an event id mid-way, one joining late) rebuild exactly the same state. Every request that runs to
the end produced exactly the tokens its position-wise function defines: none lost, none repeated,
however often it was preempted.

With KV tiers below the pool, the moves between tiers complete in any order across lanes (in
order within one), some of them failing part-way, interleaved with steps, aborts (also during
onboardings) and clears: every tier's published state equals the tier's own, references still
balance, and tokens are still exactly right.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.runtime.errors import RequestTooLarge, ResourceExhausted
from kvmesh.runtime.kv_events import (
    BlocksRemoved,
    KvEventLog,
    KvEventRecord,
    KvStateMirror,
    KvTier,
    SnapshotChunk,
    TieredState,
)
from kvmesh.runtime.types import EngineRequest, FinishReason, SamplingParams, StopParams
from kvmesh.workers.batching.tiers import KvTierConfig, Lane, TierJob
from kvmesh.workers.mocker import MockerConfig, MockerScheduler, TokenSampler

pytestmark = pytest.mark.unit

BS = 4
MAX_MODEL_LEN = 80


@dataclass(frozen=True)
class Add:
    family: int
    prefix_len: int
    suffix: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Step:
    n: int


@dataclass(frozen=True)
class Abort:
    index: int


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class MarkResume:
    pass


@dataclass(frozen=True)
class Move:
    """Complete the oldest tier move of a lane; `fail_at`: moved only that many leading blocks."""

    lane: int
    fail_at: int | None


Op = Add | Step | Abort | Clear | MarkResume | Move

adds = st.builds(
    Add,
    st.integers(0, 2),
    st.integers(0, 24),
    st.lists(st.integers(10, 40), max_size=10).map(tuple),
    st.integers(4, 40),
)
ops = st.one_of(
    adds,
    adds,
    adds,
    st.builds(Step, st.integers(1, 6)),
    st.builds(Abort, st.integers(0, 40)),
    st.just(Clear()),
    st.just(MarkResume()),
)

moves = st.builds(Move, st.integers(0, 3), st.one_of(st.none(), st.none(), st.integers(0, 3)))
tiered_ops = st.one_of(ops, moves, moves)
tier_configs = st.one_of(
    st.builds(KvTierConfig, kv_host_blocks=st.integers(2, 12)),
    st.builds(KvTierConfig, kv_host_blocks=st.integers(2, 12), kv_disk_blocks=st.integers(2, 24)),
)

configs = st.builds(
    MockerConfig,
    num_gpu_blocks=st.integers(6, 16),
    block_size=st.just(BS),
    max_num_seqs=st.integers(2, 6),
    max_num_batched_tokens=st.integers(8, 40),
    watermark=st.sampled_from([0.0, 0.1]),
    enable_chunked_prefill=st.booleans(),
    enable_prefix_caching=st.just(True),
)

families = st.lists(st.lists(st.integers(10, 40), min_size=24, max_size=24), min_size=3, max_size=3)


async def catch_up(
    mirror: KvStateMirror, it: AsyncIterator[SnapshotChunk | KvEventRecord], log: KvEventLog
) -> None:
    while mirror.last_event_id != log.last_event_id:
        mirror.apply(await asyncio.wait_for(anext(it), 1.0))


async def scenario(
    config: MockerConfig,
    prefixes: list[list[int]],
    program: list[Op],
    tiers: KvTierConfig | None = None,
) -> MockerScheduler:
    log = KvEventLog(subscriber_queue_limit=16)
    sched = MockerScheduler(
        config,
        vocab_size=50,
        excluded_token_ids=(0, 1),
        max_model_len=MAX_MODEL_LEN,
        events=log,
        tiers=tiers,
    )
    sampler = TokenSampler(50, (0, 1))
    live = log.subscribe(None)
    mirror = KvStateMirror()
    mirror.apply(await anext(live))
    resume_point: tuple[TieredState, int] | None = None
    lanes: dict[Lane, list[TierJob]] = {lane: [] for lane in Lane}

    def take() -> None:
        for job in sched.take_tier_jobs():
            lanes[job.lane].append(job)

    def move(lane: Lane, fail_at: int | None) -> None:
        take()
        if lanes[lane]:
            job = lanes[lane].pop(0)
            sched.complete_tier_job(job, len(job) if fail_at is None else fail_at)

    requests: dict[str, EngineRequest] = {}
    produced: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    aborted: set[str] = set()

    def step() -> None:
        for out in sched.step(0.0).outputs:
            produced[out.request_id].append(out.token_id)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason

    async def check() -> None:
        assert log.cached() == sched.cached_blocks()
        if sched.tiers is not None:
            for tier in (KvTier.HOST, KvTier.DISK):
                published, held = log.cached(tier), sched.tiers.cached_blocks(tier)
                assert published == held, (tier, set(published) ^ set(held))
        sched.check_invariants()
        await catch_up(mirror, live, log)
        assert mirror.states == {t: log.cached(t) for t in KvTier}

    for op in program:
        if isinstance(op, Add):
            prompt = prefixes[op.family][: op.prefix_len] + list(op.suffix)
            if not prompt:
                continue
            rid = f"r{len(requests)}"
            request = EngineRequest(
                rid, prompt, SamplingParams(temperature=0.0), StopParams(max_tokens=op.max_tokens)
            )
            try:
                sched.add(request, 0.0)
            except (ResourceExhausted, RequestTooLarge):
                continue
            requests[rid] = request
            produced[rid] = []
        elif isinstance(op, Step):
            for _ in range(op.n):
                step()
                await check()
        elif isinstance(op, Abort):
            if requests:
                rid = f"r{op.index % len(requests)}"
                if sched.abort(rid):
                    aborted.add(rid)
        elif isinstance(op, Clear):
            sched.clear_cache()
        elif isinstance(op, Move):
            move(list(Lane)[op.lane], op.fail_at)
        elif resume_point is None:
            resume_point = ({t: dict(b) for t, b in mirror.states.items()}, log.last_event_id)
        await check()

    for _ in range(5000):
        take()
        busy = [lane for lane in Lane if lanes[lane]]
        if busy:
            move(busy[0], None)
        elif sched.has_work:
            step()
        else:
            break
        await check()
    assert not sched.has_work
    assert sched.pool.num_used == 0

    # A subscriber that resumes from the event id it saw mid-way (replay, or a fresh snapshot if
    # it fell too far behind) and one that joins now both rebuild the same state.
    if resume_point is not None:
        resumed = KvStateMirror()
        resumed.resume_from(*resume_point)
        it = log.subscribe(resume_point[1])
        await catch_up(resumed, it, log)
        assert resumed.states == {t: log.cached(t) for t in KvTier}
        await it.aclose()  # type: ignore[attr-defined]
    late = KvStateMirror()
    it = log.subscribe(None)
    await catch_up(late, it, log)
    assert late.states == {t: log.cached(t) for t in KvTier}
    await it.aclose()  # type: ignore[attr-defined]
    await live.aclose()  # type: ignore[attr-defined]

    # Tokens: a pure function of (prompt, position); exact count; nothing duplicated.
    pool_tokens = (config.num_gpu_blocks - config.watermark_blocks) * BS
    cap = min(MAX_MODEL_LEN, pool_tokens + 1)
    if not config.enable_chunked_prefill:
        cap = min(cap, config.max_num_batched_tokens + 1)
    assert sched.max_seq_len == cap
    for rid, request in requests.items():
        if rid in aborted:
            continue
        n = len(request.prompt)
        assert request.stop.max_tokens is not None
        expected_len = min(request.stop.max_tokens, cap - n)
        key = sampler.stream_key(request.prompt, None)
        assert produced[rid] == [sampler.token(key, n + i) for i in range(expected_len)], rid
        assert finished[rid] is FinishReason.LENGTH
    return sched


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=configs, prefixes=families, program=st.lists(ops, min_size=8, max_size=40))
def test_events_match_pool_under_random_workloads(
    config: MockerConfig, prefixes: list[list[int]], program: list[Op]
) -> None:
    asyncio.run(scenario(config, prefixes, program))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    config=configs,
    tiers=tier_configs,
    prefixes=families,
    program=st.lists(tiered_ops, min_size=8, max_size=50),
)
def test_events_match_pool_and_tiers_under_random_workloads(
    config: MockerConfig, tiers: KvTierConfig, prefixes: list[list[int]], program: list[Op]
) -> None:
    fast = dataclasses.replace(config, kv_host_gbps=1e6, kv_disk_gbps=1e6, kv_tier_latency_ms=0.0)
    asyncio.run(scenario(fast, prefixes, program, tiers))


def test_tiers_onboard_in_this_property_space() -> None:
    """Guard: the tiered workloads really onboard blocks from the host and the disk tiers."""
    config = MockerConfig(
        num_gpu_blocks=8,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        watermark=0.0,
        kv_host_gbps=1e6,
        kv_disk_gbps=1e6,
        kv_tier_latency_ms=0.0,
    )
    prefixes = [[10 + f * 30 + i for i in range(24)] for f in range(3)]
    settle: list[Op] = [Move(lane, None) for _ in range(8) for lane in range(4)]
    program: list[Op] = [
        Add(0, 16, (), 4),
        Step(20),
        *settle,
        Add(1, 24, (), 4),
        Step(20),
        *settle,
        Add(2, 24, (), 4),
        Step(20),
        *settle,
        Add(0, 16, (), 4),
        Step(20),
    ]
    sched = asyncio.run(scenario(config, prefixes, program, KvTierConfig(4, "", 16)))
    tiers = sched.tiers
    assert tiers is not None
    assert tiers.counters[KvTier.HOST].offload_blocks > 0
    assert tiers.counters[KvTier.DISK].offload_blocks > 0
    onboarded = sum(tiers.counters[t].onboard_blocks for t in (KvTier.HOST, KvTier.DISK))
    assert onboarded > 0


def test_preemption_happens_in_this_property_space() -> None:
    """Guard: the generated workloads really exercise eviction and preemption."""
    config = MockerConfig(
        num_gpu_blocks=8, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0
    )
    prefixes = [[10 + i for i in range(24)] for _ in range(3)]
    program: list[Op] = [
        Add(0, 12, (), 20),
        Add(0, 12, (33,), 20),
        Add(1, 20, (), 20),
        MarkResume(),
        Step(200),
    ]
    sched = asyncio.run(scenario(config, prefixes, program))
    assert sched.num_preemptions > 0
    log = sched.pool.events
    assert log is not None
    assert any(isinstance(r.kind, BlocksRemoved) for r in log.events_since(0) or [])  # evictions
