"""MockerScheduler: budget, seats, chunked prefill, watermark, preemption, tokens, stops."""

from __future__ import annotations

import dataclasses
import zlib

import pytest

from kvmesh.runtime.errors import InvalidRequest, RequestTooLarge, ResourceExhausted
from kvmesh.runtime.kv_events import KvEventLog
from kvmesh.runtime.types import EngineRequest, FinishReason, SamplingParams, StopParams
from kvmesh.workers.mocker import MockerConfig, MockerScheduler, PolynomialTiming, SeqStatus

pytestmark = pytest.mark.unit

VOCAB = 1000


def make(
    *,
    log: KvEventLog | None = None,
    max_model_len: int = 4096,
    vocab: int = VOCAB,
    excluded: tuple[int, ...] = (),
    **overrides: object,
) -> MockerScheduler:
    base = MockerConfig(num_gpu_blocks=64, block_size=16, watermark=0.0)
    config = dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
    return MockerScheduler(
        config,
        vocab_size=vocab,
        excluded_token_ids=excluded,
        max_model_len=max_model_len,
        events=log,
    )


def req(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int | None = 4,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: tuple[int, ...] = (),
    min_tokens: int = 0,
    priority: int = 0,
    top_logprobs: int | None = None,
) -> EngineRequest:
    if isinstance(prompt, int):
        salt = zlib.crc32(rid.encode())  # distinct ids: distinct prompts (no prefix hits)
        prompt = [(salt + 7919 * i) % 900 + 10 for i in range(prompt)]
    return EngineRequest(
        rid,
        prompt,
        SamplingParams(temperature=temperature, seed=seed, top_logprobs=top_logprobs),
        StopParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop),
        priority=priority,
    )


def run(sched: MockerScheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; returns the tokens each request produced (checking invariants)."""
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            return out
        for o in sched.step(0.0).outputs:
            out.setdefault(o.request_id, []).append(o.token_id)
        sched.check_invariants()
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill() -> None:
    sched = make(max_num_batched_tokens=100)
    sched.add(req("a", 60), 0.0)
    sched.add(req("b", 60), 0.0)
    r = sched.step(0.0)
    assert r.prefill_tokens == 100 and r.decode_tokens == 0
    assert [o.request_id for o in r.outputs] == ["a"]  # b got only 40 of its 60 tokens
    assert sched.num_running == 2
    r = sched.step(0.0)
    assert r.decode_tokens == 1 and r.prefill_tokens == 20  # a decodes, b finishes its prompt
    assert sorted(o.request_id for o in r.outputs) == ["a", "b"]


def test_long_prompt_prefills_over_several_steps() -> None:
    sched = make(max_num_batched_tokens=100)
    sched.add(req("a", 250, max_tokens=2), 0.0)
    chunks = []
    for _ in range(3):
        r = sched.step(0.0)
        chunks.append(r.prefill_tokens)
        assert (len(r.outputs) == 1) == (len(chunks) == 3)
    assert chunks == [100, 100, 50]


def test_without_chunked_prefill_prompts_must_fit_whole() -> None:
    sched = make(max_num_batched_tokens=100, enable_chunked_prefill=False)
    with pytest.raises(ResourceExhausted):
        sched.add(req("big", 150), 0.0)
    sched.add(req("a", 60), 0.0)
    sched.add(req("b", 60), 0.0)
    r = sched.step(0.0)
    assert r.prefill_tokens == 60 and sched.num_running == 1 and sched.num_waiting == 1
    r = sched.step(0.0)
    assert r.prefill_tokens == 60 and r.decode_tokens == 1


def test_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for i in range(5):
        sched.add(req(f"r{i}", 10, max_tokens=3), 0.0)
    first = sched.step(0.0)
    assert sched.num_running == 2 and sched.num_waiting == 3 and len(first.outputs) == 2
    out = run(sched)
    for o in first.outputs:
        out[o.request_id].insert(0, o.token_id)
    assert all(len(v) == 3 for v in out.values()) and len(out) == 5


def test_priority_then_arrival() -> None:
    sched = make(max_num_seqs=1)
    sched.add(req("late-low", 10, max_tokens=1, priority=5), 0.0)
    sched.add(req("urgent", 10, max_tokens=1, priority=-1), 0.0)
    sched.add(req("normal", 10, max_tokens=1), 0.0)
    order = [sched.step(0.0).outputs[0].request_id for _ in range(3)]
    assert order == ["urgent", "normal", "late-low"]


def test_watermark_keeps_blocks_free_at_admission() -> None:
    sched = make(num_gpu_blocks=20, watermark=0.1)  # 2 blocks kept free
    with pytest.raises(ResourceExhausted):
        sched.add(req("too-big", 18 * 16 + 1), 0.0)  # 19 blocks > 18 usable
    sched.add(req("a", 10 * 16, max_tokens=50), 0.0)
    sched.add(req("b", 8 * 16, max_tokens=50), 0.0)  # 10 + 8 = 18 <= 18: fits
    sched.add(req("c", 1, max_tokens=1), 0.0)  # would leave only 1 free block
    sched.step(0.0)
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert sched.pool.num_free == 2


def test_prefix_hits_and_last_token_recomputed() -> None:
    log = KvEventLog()
    sched = make(log=log)
    prompt = list(range(100, 230))  # 130 tokens = 8 full blocks + 2
    sched.add(req("a", prompt, max_tokens=1), 0.0)
    run(sched)
    assert sched.prefix_cache_hit_rate == 0.0
    sched.add(req("b", prompt, max_tokens=1), 0.0)
    r = sched.step(0.0)
    assert r.prefill_tokens == 2  # 8 cached blocks reused
    assert r.outputs[0].usage is not None and r.outputs[0].usage.cached_tokens == 128
    exact = prompt[:128]  # fully cached prompt: the last block is recomputed
    sched.add(req("c", exact, max_tokens=1), 0.0)
    r = sched.step(0.0)
    assert r.prefill_tokens == 16
    assert r.outputs[0].usage is not None and r.outputs[0].usage.cached_tokens == 112
    assert sched.prefix_cache_hit_rate == pytest.approx((128 + 112) / (130 + 130 + 128))
    assert log.cached() == sched.cached_blocks()


def test_generated_blocks_are_cached_too() -> None:
    log = KvEventLog()
    sched = make(log=log)
    sched.add(req("a", 16, max_tokens=40), 0.0)
    out = run(sched)
    # 16 prompt + 39 computed output tokens = 55 -> 3 full blocks cached
    assert len(out["a"]) == 40 and sched.pool.num_cached == 3
    assert log.cached() == sched.cached_blocks()
    tokens = [
        t for blk in sorted(log.cached().values(), key=lambda v: v[0] is not None) for t in blk[1]
    ]
    assert len(tokens) == 48


def test_preemption_and_resume_without_duplicates() -> None:
    prompts = {f"r{i}": 40 + i for i in range(4)}
    reference = make(num_gpu_blocks=256)
    for rid, n in prompts.items():
        reference.add(req(rid, n, max_tokens=60), 0.0)
    expected = run(reference)
    assert reference.num_preemptions == 0

    log = KvEventLog()
    small = make(log=log, num_gpu_blocks=16)  # 4 x (40 + 60) tokens need ~28 blocks
    for rid, n in prompts.items():
        small.add(req(rid, n, max_tokens=60), 0.0)
    got = run(small)
    assert small.num_preemptions > 0
    assert got == expected  # same tokens, none repeated or lost
    assert small.pool.num_used == 0
    assert log.cached() == small.cached_blocks()
    assert small.load().preemptions_total == small.num_preemptions


def test_preempted_request_goes_back_to_the_front() -> None:
    sched = make(num_gpu_blocks=6, max_num_batched_tokens=64)
    sched.add(req("old", 32, max_tokens=100), 0.0)
    sched.add(req("new", 32, max_tokens=100), 0.0)
    sched.step(0.0)  # both admitted: 4 blocks used
    for _ in range(40):
        r = sched.step(0.0)
        if r.num_preempted:
            break
    assert sched.status("new") is SeqStatus.WAITING  # the most recently admitted one
    assert sched.status("old") is SeqStatus.RUNNING


def test_tokens_are_deterministic() -> None:
    def tokens(**kw: object) -> list[int]:
        sched = make()
        sched.add(req("x", [5, 6, 7, 8], max_tokens=20, **kw), 0.0)  # type: ignore[arg-type]
        return run(sched)["x"]

    greedy = tokens()
    assert greedy == tokens()
    assert greedy == tokens(seed=123)  # greedy ignores the seed
    seeded = tokens(temperature=1.0, seed=7)
    assert seeded == tokens(temperature=1.0, seed=7) != greedy
    assert seeded != tokens(temperature=1.0, seed=8)
    # unseeded sampled requests draw a fresh seed each
    sched = make()
    sched.add(req("u1", [5, 6, 7, 8], max_tokens=20, temperature=1.0), 0.0)
    sched.add(req("u2", [5, 6, 7, 8], max_tokens=20, temperature=1.0), 0.0)
    out = run(sched)
    assert out["u1"] != out["u2"]


def test_special_tokens_never_generated() -> None:
    sched = make(vocab=10, excluded=tuple(range(8)))
    sched.add(req("x", [1, 2, 3], max_tokens=200), 0.0)
    assert set(run(sched)["x"]) <= {8, 9}


def test_stop_token_and_min_tokens() -> None:
    sched = make()
    sched.add(req("ref", 8, max_tokens=30), 0.0)
    ref = run(sched)["ref"]
    k = next(i for i in range(2, 30) if ref[i] not in ref[:i])
    stop = ref[k]

    sched.add(req("ref", 8, max_tokens=30, stop=(stop,)), 0.0)
    outs = []
    while sched.has_work:
        outs.extend(sched.step(0.0).outputs)
    assert [o.token_id for o in outs] == ref[: k + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == stop
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == k + 1

    sched.add(req("ref", 8, max_tokens=30, stop=(stop,), min_tokens=k + 2), 0.0)
    assert len(run(sched)["ref"]) > k + 1  # not stopped before min_tokens


def test_length_limits() -> None:
    sched = make(max_model_len=40)
    sched.add(req("a", 30, max_tokens=None), 0.0)
    outs = []
    while sched.has_work:
        outs.extend(sched.step(0.0).outputs)
    assert len(outs) == 10 and outs[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(RequestTooLarge):
        sched.add(req("b", 40), 0.0)


def test_add_rejects_duplicates_and_empty() -> None:
    sched = make()
    sched.add(req("a", 4), 0.0)
    with pytest.raises(InvalidRequest):
        sched.add(req("a", 4), 0.0)
    with pytest.raises(InvalidRequest):
        sched.add(req("e", []), 0.0)


def test_abort_waiting_and_running() -> None:
    sched = make(max_num_seqs=1)
    sched.add(req("a", 40, max_tokens=100), 0.0)
    sched.add(req("b", 40, max_tokens=100), 0.0)
    sched.step(0.0)
    assert sched.pool.num_used == 3
    assert sched.abort("b") and sched.num_waiting == 0
    assert sched.abort("a") and sched.pool.num_used == 0 and sched.num_running == 0
    assert not sched.abort("a")
    assert not sched.has_work
    assert sched.step(0.0).num_scheduled == 0
    sched.check_invariants()
    assert sched.load().requests_finished_total == 2


def test_step_timing_numbers() -> None:
    poly = PolynomialTiming()
    sched = make(num_gpu_blocks=100, max_num_batched_tokens=8192)
    sched.add(req("a", 1000, max_tokens=3), 0.0)
    r = sched.step(0.0)
    assert r.duration_s == pytest.approx(poly.prefill_ms(1000) / 1000)  # no decode time
    r = sched.step(0.0)
    # decode usage in token slots: prompt + first token over 100 blocks x 16 tokens
    assert r.prefill_tokens == 0 and r.kv_usage == pytest.approx(1001 / 1600)
    assert r.duration_s == pytest.approx(poly.decode_ms(1001 / 1600) / 1000)
    sched.add(req("b", 100, max_tokens=3), 0.0)
    r = sched.step(0.0)  # mixed step: b's prefill adds prefill time only; a decodes at 1002
    assert r.kv_usage == pytest.approx(1002 / 1600)
    expected_ms = poly.prefill_ms(100) + poly.decode_ms(1002 / 1600)
    assert r.duration_s == pytest.approx(expected_ms / 1000)


def test_load_reports_pending_prefill() -> None:
    sched = make(max_num_batched_tokens=50)
    sched.add(req("a", 120), 0.0)
    sched.add(req("b", 30), 0.0)
    assert sched.load().pending_prefill_tokens == 150
    sched.step(0.0)
    load = sched.load()
    assert load.pending_prefill_tokens == 100 and load.num_running == 1 and load.num_waiting == 1
    assert load.kv_active_blocks == 4 and load.kv_total_blocks == 64


def test_pending_prefill_of_a_waiting_request_leaves_out_its_cached_prefix() -> None:
    # a waiting request reuses the prefix the pool holds when it is admitted: that is no work
    sched = make(max_num_batched_tokens=64, max_num_seqs=1)
    prompt = [(7 * i) % 900 + 10 for i in range(80)]
    sched.add(req("a", prompt, max_tokens=50), 0.0)
    sched.step(0.0)
    sched.step(0.0)  # a's 80 tokens computed: its 5 full blocks are cached, it decodes
    sched.add(req("b", [*prompt[:64], *range(500, 540)], max_tokens=2), 0.0)  # waits: 1 slot
    load = sched.load()
    assert load.num_waiting == 1
    assert load.pending_prefill_tokens == 104 - 64  # 4 cached blocks of 16 tokens
    sched.add(req("c", 30), 0.0)  # nothing cached: all of it
    assert sched.load().pending_prefill_tokens == 40 + 30
    # d shares b's uncached blocks after the cached prefix (b computes them first): only its
    # own last 8 tokens are work; e shares c's first block (16 tokens)
    sched.add(req("d", [*prompt[:64], *range(500, 532), 7, 7, 7, 7, 7, 7, 7, 7]), 0.0)
    sched.add(req("e", [*req("c", 30).prompt[:16], *range(900, 910)]), 0.0)
    assert sched.load().pending_prefill_tokens == 40 + 30 + 8 + 10


def test_logprobs_are_synthetic_but_well_formed() -> None:
    sched = make()
    sched.add(req("a", 8, max_tokens=10, top_logprobs=5, temperature=0.7, seed=1), 0.0)
    sched.add(req("g", 8, max_tokens=10, top_logprobs=3), 0.0)
    sched.add(req("z", 8, max_tokens=10, top_logprobs=0), 0.0)
    seen = 0
    while sched.has_work:
        for o in sched.step(0.0).outputs:
            lp = o.logprob
            assert lp is not None and lp.token_id == o.token_id and lp.logprob < 0
            k = {"a": 5, "g": 3, "z": 0}[o.request_id]
            assert len(lp.top) == k
            if k:
                values = [v for _, v in lp.top]
                assert values == sorted(values, reverse=True)
                assert (o.token_id, lp.logprob) in lp.top
                assert len({t for t, _ in lp.top}) == k
            if o.request_id == "g":
                assert lp.top[0][0] == o.token_id  # greedy: the chosen token is the top one
            seen += 1
    assert seen == 30


def test_sequence_cannot_outgrow_the_pool() -> None:
    # 8 blocks x 16 = 128 tokens of KV; one request alone must end rather than livelock.
    sched = make(num_gpu_blocks=8, max_model_len=10_000)
    sched.add(req("a", 100, max_tokens=None), 0.0)
    outs = []
    while sched.has_work:
        outs.extend(sched.step(0.0).outputs)
        sched.check_invariants()
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert 100 + len(outs) == 129
