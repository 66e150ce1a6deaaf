"""The ttft routing policy: TtftPredictor's arithmetic, and KvScheduler choosing by it (cache
against queue, request slots, the bounded ITL penalty, the slot hold a full worker waits by)."""

from __future__ import annotations

import math

import pytest

from kvmesh.router.kv_policy import (
    DEFAULT_DECODE_DELAY_WEIGHT,
    KvPolicyFlags,
    KvPolicyKind,
    TtftPredictor,
    cost_score,
)
from kvmesh.router.kv_scheduler import (
    SLOT_HOLD_SMOOTHING,
    KvRouterConfig,
    KvScheduler,
    LoadSample,
)
from kvmesh.runtime.kv_events import BlocksStored, StoredBlock
from kvmesh.runtime.timing import PolynomialTiming, TableTiming
from kvmesh.workers.mocker import block_hash as engine_hash

pytestmark = pytest.mark.unit

BS = 16
POLY = PolynomialTiming()


def test_idle_worker_ttft_is_one_prefill_step() -> None:
    p = TtftPredictor(chunk_tokens=8192)
    got = p.predict(
        new_tokens=1000, queued_prefill_tokens=0, decode_tokens=0, prompt_tokens=1000,
        kv_capacity_tokens=1 << 20,
    )  # fmt: skip
    assert got.ttft_ms == pytest.approx(POLY.prefill_ms(1000))
    assert got.itl_ms == pytest.approx(POLY.decode_ms(1000 / (1 << 20)))


def test_queue_chunks_and_decode_steps_add_up() -> None:
    """20,000 tokens ahead + 1,000 new in 8,192-token chunks: two full steps and one of 4,616
    tokens, each also decoding the running batch."""
    p = TtftPredictor(chunk_tokens=8192)
    got = p.predict(
        new_tokens=1000, queued_prefill_tokens=20_000, decode_tokens=100_000, prompt_tokens=1200,
        kv_capacity_tokens=1_000_000,
    )  # fmt: skip
    decode = POLY.decode_ms(0.1)
    expected = 2 * POLY.prefill_ms(8192) + POLY.prefill_ms(21_000 - 2 * 8192) + 3 * decode
    assert got.ttft_ms == pytest.approx(expected)
    assert got.itl_ms == pytest.approx(POLY.decode_ms(101_200 / 1_000_000))


def test_a_full_worker_adds_the_wait_for_free_slots() -> None:
    p = TtftPredictor(chunk_tokens=8192)
    kw = {"new_tokens": 100, "queued_prefill_tokens": 0, "decode_tokens": 0,
          "prompt_tokens": 100, "kv_capacity_tokens": 1 << 20, "max_num_seqs": 8}  # fmt: skip
    free = p.predict(requests=7, completion_rate=10.0, **kw)  # type: ignore[arg-type]
    full = p.predict(requests=10, completion_rate=10.0, **kw)  # type: ignore[arg-type]
    assert free.ttft_ms == pytest.approx(POLY.prefill_ms(100))
    # three requests must end first, one every 100 ms, then the prompt prefills
    assert full.ttft_ms == pytest.approx(300 + POLY.prefill_ms(100))
    unlimited = p.predict(requests=10, completion_rate=10.0, **{**kw, "max_num_seqs": 0})  # type: ignore[arg-type]
    assert unlimited.ttft_ms == free.ttft_ms


def test_decode_delay_is_a_step_of_its_own_or_the_tokens_joining_one() -> None:
    """What a prefill adds to the steps of the requests running on a worker: with no prefill
    queued there, a step's prefill of its own (fixed cost included); joining a queued one,
    only its tokens' time (and over the chunk budget, the extra chunks')."""
    p = TtftPredictor(chunk_tokens=8192)
    assert p.decode_delay_ms(1000, 0) == pytest.approx(POLY.prefill_ms(1000))
    joined = p.decode_delay_ms(1000, 2000)
    assert joined == pytest.approx(POLY.prefill_ms(3000) - POLY.prefill_ms(2000))
    assert joined < POLY.prefill_ms(1000) - 14.0  # the step's fixed cost (16.5) is paid
    assert p.decode_delay_ms(0, 0) == pytest.approx(POLY.prefill_ms(1))  # the last token
    chunked = p.decode_delay_ms(1000, 8000)  # spills into a second step
    assert chunked == pytest.approx(
        POLY.prefill_ms(8192) + POLY.prefill_ms(808) - POLY.prefill_ms(8000)
    )
    assert p.decode_delay_ms(20_000, 0) == pytest.approx(p.prefill_ms(20_000, 0.0))


def test_a_measured_table_replaces_the_polynomial() -> None:
    table = TableTiming([0, 1000], [0, 100], [0, 1], [10, 10])
    p = TtftPredictor(table, chunk_tokens=500)
    got = p.predict(
        new_tokens=1000, queued_prefill_tokens=0, decode_tokens=1, prompt_tokens=1000,
        kv_capacity_tokens=1000,
    )  # fmt: skip
    assert got.ttft_ms == pytest.approx(2 * (50 + 10)) and got.itl_ms == 10
    with pytest.raises(ValueError):
        TtftPredictor(chunk_tokens=0)


def test_cost_score_is_the_linear_cost() -> None:
    got = cost_score(overlap_weight=2.0, new_blocks=3, queued_prefill_blocks=5, decode_blocks=7)
    assert got == 2.0 * (5 + 3) + 7 + 3


def cache(sched: KvScheduler, worker: str, tokens: list[int]) -> None:
    blocks, parent = [], None
    for i in range(len(tokens) // BS):
        b = tuple(tokens[i * BS : (i + 1) * BS])
        parent = engine_hash(parent, b)
        blocks.append(StoredBlock(parent, b))
    sched.indexer.apply_event(worker, BlocksStored(None, blocks))


def make(n: int = 2, **cfg: float) -> KvScheduler:
    """A ttft-policy scheduler (the default policy)."""
    config = KvRouterConfig(policy=KvPolicyKind.TTFT, **cfg)  # type: ignore[arg-type]
    sched = KvScheduler(config, router_id="r")
    for i in range(n):
        sched.add_worker(f"w{i}", block_size=BS, kv_total_blocks=65536, max_num_seqs=4)
    return sched


def test_ttft_scores_are_predicted_ms() -> None:
    assert KvRouterConfig().policy is KvPolicyKind.TTFT is KvPolicyFlags().router_policy
    sched = make()
    assert sched.config.policy is KvPolicyKind.TTFT
    prompt = list(range(1600))
    cache(sched, "w1", prompt[:1280])
    sel = sched.select(prompt, 0.0)
    assert sel.worker_id == "w1" and sel.overlap_blocks == 80
    assert sel.costs == pytest.approx({"w0": POLY.prefill_ms(1600), "w1": POLY.prefill_ms(320)})


def test_replicas_agree_on_near_ties_whatever_their_private_state() -> None:
    """Two replicas with the same KV index, but one holding a peer's booking the other already
    freed (in transit) and different seeds and output estimates: predictions that differ by
    less than one idle decode step are near-ties, decided by shared state alike."""
    a, b = make(4, seed=1), make(4, seed=2)
    short = list(range(144))  # 8 blocks cached on w2 + one of its own
    for s in (a, b):
        cache(s, "w2", short[:128])
    sel = a.select(short, 0.0, candidates=["w2"])
    a.book("peer", sel, 0.0, expected_output_tokens=500)  # a phantom on a only
    costs = a.select(short, 0.0).costs
    assert costs["w2"] > min(costs.values()), "the phantom makes w2 look slower on a"
    assert costs["w2"] - min(costs.values()) < a.agree_ms == POLY.decode_ms(0.0)
    assert a.select(short, 0.0).worker_id == b.select(short, 0.0).worker_id == "w2"
    # A miss on an idle fleet: no seed decides, the prompt does (rendezvous hashing), and
    # different prompts spread over the workers.
    c, d = make(4, seed=3), make(4, seed=4)
    picks = {c.select(list(range(k, k + 40)), 0.0).worker_id for k in range(1000, 1400, 10)}
    assert picks == {"w0", "w1", "w2", "w3"}
    for k in range(1000, 1400, 10):
        prompt = list(range(k, k + 40))
        assert c.select(prompt, 0.0).worker_id == d.select(prompt, 0.0).worker_id
        assert c.select(prompt[:7], 0.0).worker_id == d.select(prompt[:7], 0.0).worker_id
    # Beyond the margin the prediction decides: a queue ahead outweighs the cached prefix.
    for i in range(3):
        sel = a.select(list(range(9000 + 9000 * i, 9000 + 9000 * i + 8000)), 0.0,
                       candidates=["w2"])  # fmt: skip
        a.book(f"big{i}", sel, 0.0)
    assert a.select(short, 0.0).worker_id != "w2"


def test_a_queue_ahead_outweighs_the_cached_prefix() -> None:
    sched = make()
    prompt = list(range(1600))
    cache(sched, "w1", prompt[:1280])
    for i in range(3):  # 3 x 8,000 uncached tokens waiting to prefill on w1
        sel = sched.select(
            list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8000)), 0.0, candidates=["w1"]
        )
        sched.book(f"big{i}", sel, 0.0)
    assert sched.select(prompt, 0.0).worker_id == "w0"
    for i in range(3):
        sched.first_token(f"big{i}")  # prefilled: now they only decode there
    assert sched.select(prompt, 0.0).worker_id == "w1"


def test_full_request_slots_send_requests_elsewhere() -> None:
    sched = make()
    prompt = list(range(1600))
    cache(sched, "w1", prompt)
    for i in range(4):  # w1 runs max_num_seqs requests already
        sel = sched.select(list(range(5000 + 16 * i, 5016 + 16 * i)), 0.0, candidates=["w1"])
        sched.book(f"r{i}", sel, 0.0, expected_output_tokens=100)
        sched.first_token(f"r{i}")
    assert sched.select(prompt, 0.0).worker_id == "w0"
    sched.free("r0")  # a slot is free again: the cache wins
    assert sched.select(prompt, 0.0).worker_id == "w1"


def busy(sched: KvScheduler, worker: str, running: int, decode_blocks: int = 0) -> None:
    """A load sample: `running` requests decoding on `worker`, holding `decode_blocks`."""
    sched.update_load(worker, LoadSample(kv_active_blocks=decode_blocks, num_running=running), 0.0)


def test_a_prefill_costs_the_requests_running_there() -> None:
    """w0 holds 1,024 of the prompt's 2,048 tokens but runs 200 requests of 256, w1 runs 10:
    scoring only its own TTFT the cache wins; counting what its prefill adds to the 200
    requests' steps (x 200 / 256) sends it to w1, whose decode batch is small."""
    prompt = list(range(2048))

    def pick(**cfg: float) -> tuple[str, dict[str, float]]:
        sched = KvScheduler(KvRouterConfig(**cfg))  # type: ignore[arg-type]
        for w in ("w0", "w1"):
            sched.add_worker(w, block_size=BS, kv_total_blocks=65536, max_num_seqs=256)
        cache(sched, "w0", prompt[:1024])
        busy(sched, "w0", 200, 4096)
        busy(sched, "w1", 10, 4096)
        sel = sched.select(prompt, 0.0)
        return sel.worker_id, sel.costs

    own, own_costs = pick(decode_delay_weight=0.0)
    assert own == "w0"
    assert pick(decode_delay_weight=1.0)[0] == "w1"
    chosen, costs = pick()  # the default weight
    assert chosen == "w1"
    d = DEFAULT_DECODE_DELAY_WEIGHT
    assert costs["w0"] - own_costs["w0"] == pytest.approx(d * 200 / 256 * POLY.prefill_ms(1024))
    assert costs["w1"] - own_costs["w1"] == pytest.approx(d * 10 / 256 * POLY.prefill_ms(2048))


def test_a_prefill_joins_one_queued_rather_than_start_a_step() -> None:
    """Both workers run 3 of 4 slots; w0 has 256 tokens queued to prefill. Its own TTFT is
    lower on the idle w1 (by less than a near-tie: the lower prediction wins), but there it
    costs the running requests a step of its own, on w0 only its tokens: it joins w0."""

    def pick(**cfg: float) -> str:
        sched = make(**cfg)
        sel = sched.select(list(range(5000, 5256)), 0.0, candidates=["w0"])
        sched.book("queued", sel, 0.0)
        busy(sched, "w0", 2)  # + the queued one: 3 of 4
        busy(sched, "w1", 3)
        return sched.select(list(range(256)), 0.0).worker_id

    assert pick(decode_delay_weight=0.0) == "w1"
    assert pick(decode_delay_weight=1.0) == pick() == "w0"


def test_decode_delay_weighs_nothing_on_idle_workers() -> None:
    sched = make()
    prompt = list(range(1600))
    cache(sched, "w1", prompt[:1280])
    costs = sched.select(prompt, 0.0).costs
    assert costs == pytest.approx({"w0": POLY.prefill_ms(1600), "w1": POLY.prefill_ms(320)})


def test_decode_delay_is_not_scored_where_every_slot_is_taken() -> None:
    """w0 runs all 4 of its request slots, w1 3 of 4: on w0 the request would wait for a slot,
    so only w1's score carries what its prefill adds to the requests running there."""
    prompt = list(range(512))

    def costs(**cfg: float) -> dict[str, float]:
        sched = make(**cfg)
        busy(sched, "w0", 4)
        busy(sched, "w1", 3)
        return sched.select(prompt, 0.0).costs

    own, scored = costs(decode_delay_weight=0.0), costs(decode_delay_weight=1.0)
    assert scored["w0"] == pytest.approx(own["w0"])
    assert scored["w1"] - own["w1"] == pytest.approx(3 / 4 * POLY.prefill_ms(512))


def test_slot_hold_is_measured_from_first_token_to_end() -> None:
    """How long a request holds its slot: first token to end, a running mean over the requests
    that ended; times from the calls, or the latest time the scheduler was given."""
    sched = make(1)
    for i in range(3):
        sched.book(f"r{i}", sched.select([i] * 32, 0.0), 0.0)
    assert sched.slot_hold_s == 0.0
    sched.first_token("r0", now=1.0)
    sched.free("r0", now=3.0)
    assert sched.slot_hold_s == pytest.approx(2.0)
    sched.first_token("r1", now=3.0)
    sched.first_token("r1", now=4.0)  # repeated: the first one counts
    sched.free("r1", now=7.0)
    assert sched.slot_hold_s == pytest.approx(2.0 + SLOT_HOLD_SMOOTHING * (4.0 - 2.0))
    sched.update_load("w0", LoadSample(num_running=1), 8.0)  # no time given below: the latest
    sched.first_token("r2")
    sched.update_load("w0", LoadSample(num_running=1), 10.0)
    before = sched.slot_hold_s
    sched.free("r2")
    assert sched.slot_hold_s == pytest.approx(before + SLOT_HOLD_SMOOTHING * (2.0 - before))
    sched.book("r3", sched.select([3] * 32, 10.0), 10.0)
    sched.free("r3", now=11.0)  # ended before its first token: no slot hold to learn from
    assert sched.slot_hold_s == pytest.approx(before + SLOT_HOLD_SMOOTHING * (2.0 - before))


def test_a_full_worker_waits_its_slot_hold_over_its_busy_slots_per_request_ahead() -> None:
    """A burst after a lull: the slot hold, not the lull's completion rate, paces the wait.
    w0 (4 slots) runs 4 requests and has 2 waiting; requests held their slot 2 s: one of its 4
    busy slots frees every 0.5 s, and a new request waits for 3 of them."""
    sched = make(1)
    sched.book("old", sched.select([9] * 32, 0.0), 0.0)
    sched.first_token("old", now=0.0)
    sched.free("old", now=2.0)
    for i in range(6):
        sched.book(f"r{i}", sched.select([i] * 32, 2.0), 2.0)
    prompt = [7] * 32
    cost = sched.select(prompt, 2.0).costs["w0"]
    assert cost >= 3 * 0.5e3
    assert cost == pytest.approx(3 * 0.5e3 + POLY.prefill_ms(32), rel=0.05)


def test_the_slot_hold_scales_with_the_step_time_where_it_is_waited_for() -> None:
    """A hold is output tokens x step time: measured where the KV cache was empty (the
    smallest step), it is longer on a worker whose KV usage (90 %) makes every step longer."""
    sched = make(1)
    sched.book("old", sched.select([9] * 32, 0.0), 0.0)
    sched.first_token("old", now=0.0)
    sched.free("old", now=2.0)
    assert sched.slot_hold_step_ms == pytest.approx(POLY.decode_ms(0.0))
    for i in range(6):
        sched.book(f"r{i}", sched.select([i] * 32, 2.0), 2.0)
    sched.update_load("w0", LoadSample(kv_active_blocks=int(0.9 * 65536)), 2.0)
    ratio = POLY.decode_ms(0.9) / POLY.decode_ms(0.0)
    cost = sched.select([7] * 32, 2.0).costs["w0"]
    assert 3 * 0.5e3 * ratio <= cost <= 3 * 0.5e3 * ratio + 2 * POLY.prefill_ms(32) + 100


def _pick_beside_a_busy_decoder(decoding: int, **cfg: float) -> str:
    """w1 holds 1,280 of a 1,600-token prompt and decodes `decoding` tokens of one request (1 of
    its 4 request slots); w0 is idle. Where the request of 500 output tokens goes."""
    prompt = list(range(1600))
    sched = make(**cfg)
    cache(sched, "w1", prompt[:1280])
    sel = sched.select(list(range(50_000, 50_000 + decoding)), 0.0, candidates=["w1"])
    sched.book("long", sel, 0.0)
    sched.first_token("long")
    return sched.select(prompt, 0.0, expected_output_tokens=500).worker_id


def test_the_itl_penalty_is_bounded() -> None:
    """With no penalty the cache wins; a penalty (against the best worker's ITL: ratio 1) that
    outweighs the prefill it saves sends the request to w0, scaled by the share of w1's request
    slots in use; a cap below that saving keeps it on w1."""
    decoding = 100_000  # tokens decoding on w1: u = 0.095 of 65,536 blocks x 16
    capacity = 65536 * BS
    saving = POLY.prefill_ms(1600) - POLY.prefill_ms(320) - POLY.decode_ms(decoding / capacity)
    itl_gap = POLY.decode_ms((decoding + 1600) / capacity) - POLY.decode_ms(1600 / capacity)
    assert saving > 0 and itl_gap > 0

    def pick(**cfg: float) -> str:
        return _pick_beside_a_busy_decoder(decoding, itl_penalty_ratio=1.0, **cfg)

    assert pick(itl_weight=0.0) == "w1"
    # w1 has 1 of its 4 request slots taken: the penalty counts a quarter
    weight = 2 * saving / (500 * itl_gap)  # twice what the cache saves, a half at 1/4 slots
    assert pick(itl_weight=weight, itl_penalty_cap_ms=1e6) == "w1"
    assert pick(itl_weight=4 * weight, itl_penalty_cap_ms=1e6) == "w0"
    assert pick(itl_weight=4 * weight, itl_penalty_cap_ms=2 * saving) == "w1"  # capped


def test_the_itl_penalty_counts_only_decode_slower_than_a_ratio_of_the_best() -> None:
    """The defaults: a worker decoding within 2x of the best one's ITL keeps what its cache
    saves; one decoding several times slower (the prefix holder whose decode batch grew, beside
    an idle worker) pays the request's own lost decode time, and the request goes elsewhere."""
    capacity = 65536 * BS
    best = POLY.decode_ms(1600 / capacity)
    near, far = 100_000, 300_000
    assert POLY.decode_ms((near + 1600) / capacity) < 2 * best
    assert POLY.decode_ms((far + 1600) / capacity) > 3 * best
    assert _pick_beside_a_busy_decoder(near) == "w1"
    assert _pick_beside_a_busy_decoder(far) == "w0"
    assert _pick_beside_a_busy_decoder(far, itl_weight=0.0) == "w1"  # TTFT alone: the cache
    assert _pick_beside_a_busy_decoder(far, itl_penalty_ratio=4.0) == "w1"  # within 4x


def test_bad_settings_are_refused() -> None:
    for bad in (
        {"itl_weight": -1.0},
        {"itl_penalty_cap_ms": math.nan},
        {"itl_penalty_ratio": 0.5},
        {"itl_penalty_ratio": math.inf},
        {"chunk_tokens": 0},
        {"decode_delay_weight": -1.0},
    ):
        with pytest.raises(ValueError):
            KvRouterConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KvRouterConfig(policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timing profile"):
        KvScheduler(KvRouterConfig(timing_profile="/nonexistent.json"))


def _hot_prefix_holder(**cfg: float) -> tuple[KvScheduler, list[int]]:
    """w1 holds 1,280 of a 1,600-token prompt and decodes 300,000 tokens (its predicted step
    3.3x idle w0's); a request that ended on w1 decoded at twice the step predicted there. No
    ITL penalty: the rule under test alone."""
    sched = make(itl_weight=0.0, **cfg)
    prompt = list(range(1600))
    cache(sched, "w1", prompt[:1280])
    sched.book("long", sched.select(list(range(50_000, 350_000)), 0.0, candidates=["w1"]), 0.0)
    sched.first_token("long", now=0.0)
    sched.book("done", sched.select([5] * 32, 0.0, candidates=["w1"]), 0.0)
    sched.first_token("done", now=0.0)
    capacity = 65536 * BS
    step = 0.5 * (POLY.decode_ms((300_000 + 32) / capacity) + POLY.decode_ms(300_000 / capacity))
    sched.free("done", now=2 * step * 99 / 1e3, output_tokens=100)
    return sched, prompt


def test_an_itl_target_keeps_requests_off_a_worker_decoding_over_it() -> None:
    """The prefix holder wins on TTFT; with an ITL target between what the idle worker and the
    holder realize (2x their predicted steps: the holder's measured ratio, and the fleet's for
    the worker with none of its own), the request goes to the idle worker. A target both meet,
    an alternative not `itl_penalty_ratio` x faster, or one that cannot start the request
    within the TTFT target: the cache wins."""
    capacity = 65536 * BS
    idle, hot = POLY.decode_ms(1600 / capacity), POLY.decode_ms((300_000 + 1600) / capacity)
    assert hot > 3 * idle

    def pick(**cfg: float) -> str:
        sched, prompt = _hot_prefix_holder(**cfg)
        return sched.select(prompt, 10.0, expected_output_tokens=500).worker_id

    sched, _ = _hot_prefix_holder(itl_slo_ms=30.0)
    assert sched.worker("w1").itl_ratio == pytest.approx(2.0)  # type: ignore[union-attr]
    assert sched.fleet_itl_ratio == pytest.approx(2.0)
    assert sched.worker("w0").itl_ratio == 0.0  # type: ignore[union-attr]
    assert pick() == "w1"  # no target
    assert pick(itl_slo_ms=1.8 * hot) == "w0"  # 2 x hot is over it, 2 x idle within
    assert pick(itl_slo_ms=2.2 * hot) == "w1"  # both within
    assert 3.0 * idle < hot < 3.5 * idle
    assert pick(itl_slo_ms=1.8 * hot, itl_penalty_ratio=3.0) == "w0"
    assert pick(itl_slo_ms=1.8 * hot, itl_penalty_ratio=3.5) == "w1"  # w0 not 3.5x faster
    assert pick(itl_slo_ms=1.8 * hot, ttft_slo_ms=POLY.prefill_ms(1600) + 1) == "w0"
    assert pick(itl_slo_ms=1.8 * hot, ttft_slo_ms=POLY.prefill_ms(1600) - 1) == "w1"


def test_the_realized_itl_is_learned_only_with_a_target_and_a_token_count() -> None:
    """Without an ITL target the first token records no step (nothing extra on the routing
    path); an end without its token count (0: unknown) teaches nothing."""
    sched, _ = _hot_prefix_holder()
    assert sched.worker("w1").itl_ratio == 0.0 and sched.fleet_itl_ratio == 0.0  # type: ignore[union-attr]
    sched = make(itl_slo_ms=30.0)
    sched.book("r", sched.select([1] * 32, 0.0), 0.0)
    sched.first_token("r", now=0.0)
    sched.free("r", now=5.0)
    assert sched.fleet_itl_ratio == 0.0
    with pytest.raises(ValueError):
        KvRouterConfig(itl_slo_ms=-1.0)
