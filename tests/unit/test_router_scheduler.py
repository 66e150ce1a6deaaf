"""KvScheduler: the linear cost function, choice, busy thresholds, load tracking, peers, approximate
mode. All synchronous, with explicit `now` (as `kvmesh replay` drives it)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_policy import KvPolicyKind
from kvmesh.router.kv_scheduler import (
    KvRouterConfig,
    KvScheduler,
    LoadEvent,
    LoadEventKind,
    LoadSample,
)
from kvmesh.router.routing import RoutingStats
from kvmesh.runtime.errors import Unavailable
from kvmesh.runtime.kv_events import BlocksStored, StoredBlock
from kvmesh.workers.mocker import block_hash as engine_hash

pytestmark = pytest.mark.unit

BS = 4


def cache(sched: KvScheduler, worker: str, tokens: list[int]) -> None:
    """Tell the scheduler `worker` cached the full blocks of `tokens` (as a KV event would)."""
    blocks, parent = [], None
    for i in range(len(tokens) // BS):
        b = tuple(tokens[i * BS : (i + 1) * BS])
        parent = engine_hash(parent, b)
        blocks.append(StoredBlock(parent, b))
    sched.indexer.apply_event(worker, BlocksStored(None, blocks))


def make(n: int = 3, policy: KvPolicyKind = KvPolicyKind.COST, **cfg: float) -> KvScheduler:
    """A scheduler over `n` workers; the linear cost policy unless `policy` says otherwise (the
    ttft policy has its own tests, tests/unit/test_kv_policy.py)."""
    sched = KvScheduler(KvRouterConfig(policy=policy, **cfg), router_id="r1")  # type: ignore[arg-type]
    for i in range(n):
        sched.add_worker(f"w{i}", block_size=BS, kv_total_blocks=100)
    return sched


def test_prefers_the_worker_holding_the_prefix() -> None:
    sched = make()
    prompt = list(range(40))  # 10 blocks
    cache(sched, "w1", prompt[:24])
    cache(sched, "w2", prompt[:8])
    sel = sched.select(prompt, now=0.0)
    assert (sel.worker_id, sel.overlap_blocks, sel.prompt_blocks) == ("w1", 6, 10)
    # idle fleet: twice the blocks the request adds (to prefill, then to hold)
    assert sel.costs == {"w0": 20.0, "w1": 8.0, "w2": 16.0}
    assert sel.block_hashes == block_hashes(prompt, BS)
    assert sel.cost == 8.0 and sel.prompt_tokens == 40 and sel.block_size == BS
    # A partial block counts as work but never as overlap.
    assert sched.select([*prompt, 1, 2], now=0.0).costs["w1"] == pytest.approx(9.0)


def test_load_outweighs_overlap_and_the_weight_trades_them() -> None:
    sched = make(2)
    prompt = list(range(40))
    cache(sched, "w0", prompt)
    for i in range(3):  # three decoding requests of 10 blocks on w0
        sel = sched.select(list(range(1000 + 50 * i, 1040 + 50 * i)), now=0.0, candidates=["w0"])
        sched.book(f"busy{i}", sel, now=0.0)
        sched.first_token(f"busy{i}")
    sel = sched.select(prompt, now=0.0)
    assert sel.costs == {"w0": 30.0, "w1": 20.0} and sel.worker_id == "w1"
    heavy = KvScheduler(KvRouterConfig(overlap_weight=4.0, policy=KvPolicyKind.COST))
    for w in ("w0", "w1"):
        heavy.add_worker(w, block_size=BS)
    cache(heavy, "w0", prompt)
    assert heavy.select(prompt, now=0.0).worker_id == "w0"


def test_requests_sharing_a_cached_prefix_add_only_their_tails() -> None:
    sched = make(2)
    system = list(range(32))  # 8 blocks every request shares
    cache(sched, "w0", system)
    for i in range(3):  # three running requests with that system prompt on w0
        sel = sched.select([*system, *range(100 + 4 * i, 104 + 4 * i)], 0.0)
        assert sel.worker_id == "w0" and sel.overlap_blocks == 8
        sched.book(f"r{i}", sel, now=0.0)
        sched.first_token(f"r{i}")
    w0 = sched.worker("w0")
    assert w0 is not None and (w0.booked_prefill, w0.booked_decode) == (0, 3)
    sel = sched.select([*system, 7, 7, 7, 7], 0.0)
    assert sel.costs == {"w0": 1 + (3 + 1), "w1": 9 + 9} and sel.worker_id == "w0"
    for i in range(3):
        sched.free(f"r{i}")
    assert (w0.booked_prefill, w0.booked_decode) == (0, 0)


def test_a_prefix_being_computed_counts_as_cached_until_the_first_token() -> None:
    # A burst sharing a new 8-block prefix: the first request lands anywhere; on its worker the
    # next ones find the prefix it will have computed by the time they are admitted.
    sched = make()
    shared = list(range(1000, 1032))
    first = sched.select([*shared, 1, 2, 3, 4], now=0.0)
    assert first.overlap_blocks == 0
    sched.book("a", first, 0.0)
    second = sched.select([*shared, 5, 6, 7, 8], now=0.0)
    # there: a's 9 queued blocks + 1 new, 9 decoding + 1 new; elsewhere 9 new, twice
    assert second.costs == {w: 20.0 if w == first.worker_id else 18.0 for w in second.costs}
    second = sched.select([*shared, 5, 6, 7, 8], now=0.0, candidates=[first.worker_id])
    assert second.overlap_blocks == 8
    sched.book("b", second, 0.0)
    assert sched.worker(first.worker_id).booked_prefill == 9 + 1  # type: ignore[union-attr]
    # a's prefill ends: its blocks come from KV events now; b's block on top still counts
    assert sched.first_token("a")
    tail = [*shared, 5, 6, 7, 8, 9]
    assert sched.select(tail, now=0.0).overlap_blocks == 0  # the event has not come yet
    cache(sched, first.worker_id, [*shared, 1, 2, 3, 4])
    assert sched.select(tail, now=0.0).overlap_blocks == 8 + 1
    assert sched.free("b")
    assert sched.select(tail, now=0.0).overlap_blocks == 8
    off = KvScheduler(KvRouterConfig(inflight_prefixes=False))
    for i in range(3):
        off.add_worker(f"w{i}", block_size=BS, kv_total_blocks=100)
    off.book("a", off.select([*shared, 1, 2, 3, 4], now=0.0), 0.0)
    assert off.select([*shared, 5, 6, 7, 8], now=0.0).overlap_blocks == 0


def test_after_the_first_token_the_computed_prefix_counts_until_its_events_can_be_here() -> None:
    # A request's worker announces the blocks it computed only through its KV events, which
    # reach the router some time after its first token: the prefix stays counted there for
    # `inflight_hold_s` after the first token, even once the request is gone.
    sched = make(inflight_hold_s=1.0)
    prompt = list(range(1000, 1032))
    first = sched.select([*prompt, 1], now=0.0)
    sched.book("a", first, 0.0)
    assert sched.first_token("a", now=10.0)
    assert sched.free("a")
    again = [*prompt, 2]
    assert sched.select(again, now=10.5).overlap_blocks == 8
    assert sched.select(again, now=10.5).worker_id == first.worker_id
    assert sched.select(again, now=11.0).overlap_blocks == 0  # held no longer; no event came
    assert len(sched.inflight) == 0
    # Without a time (the replay, whose events arrive at once): until the first token only.
    sched.book("b", sched.select([*prompt, 3], now=20.0), 20.0)
    assert sched.first_token("b")
    assert sched.select(again, now=20.0).overlap_blocks == 0


def test_a_finished_request_does_not_linger_in_its_workers_load() -> None:
    # A load sample may show a request the router thinks too young to show (a fast worker), or
    # arrive after the request ended, measured while it ran: once the request is freed, its
    # worker must not look busy with it until the next sample (the next turn, sent at once,
    # would go elsewhere and miss the prefix that worker holds).
    sched = make(1)
    w0 = sched.worker("w0")
    assert w0 is not None
    running = LoadSample(kv_active_blocks=9, num_running=1)
    prompt = list(range(32))  # 8 blocks, 1 more expected output
    sched.book("a", sched.select(prompt, now=10.0), 10.0, expected_output_tokens=4)
    sched.update_load("w0", running, now=10.01)  # showed "a", booked 10 ms before
    assert w0.view(10.02, 2.0)[1:] == (9 + 9, 2)  # counted twice while it runs
    assert sched.free("a", now=10.03)
    assert w0.view(10.04, 2.0)[1:] == (0, 0)
    sched.book("b", sched.select(prompt, now=20.0), 20.0, expected_output_tokens=4)
    sched.update_load("w0", running, now=20.5)
    assert sched.free("b", now=20.6)
    sched.update_load("w0", running, now=20.62)  # measured before "b" ended
    assert w0.view(20.63, 2.0)[1:] == (0, 0)
    sched.update_load("w0", running, now=21.0)  # later: somebody else's request, counted
    assert w0.view(21.01, 2.0)[1:] == (9, 1)


def test_ties_are_broken_at_random_not_always_the_first() -> None:
    sched = make(4, seed=7)
    picks = Counter(sched.select([1, 2, 3, 4], now=0.0).worker_id for _ in range(400))
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert min(picks.values()) > 50


def test_choices_are_reproducible_with_a_seed() -> None:
    a, b = make(4, seed=3), make(4, seed=3)
    seq_a = [a.select([1, 2, 3, 4], 0.0).worker_id for _ in range(30)]
    seq_b = [b.select([1, 2, 3, 4], 0.0).worker_id for _ in range(30)]
    assert seq_a == seq_b


def test_softmax_sampling_favours_low_cost() -> None:
    sched = make(2, temperature=0.5, seed=1)
    prompt = list(range(40))
    cache(sched, "w0", prompt)
    picks = Counter(sched.select(prompt, 0.0).worker_id for _ in range(2000))
    # normalized costs 0 and 1: p(w0) = 1 / (1 + e^-2) ~ 0.88
    assert 0.83 < picks["w0"] / 2000 < 0.93
    flat = make(2, temperature=1.0, seed=1)
    picks = Counter(flat.select(prompt, 0.0).worker_id for _ in range(1000))
    assert min(picks.values()) > 400  # equal costs: uniform


def test_busy_workers_are_skipped_and_all_busy_is_unavailable() -> None:
    sched = make(3, busy_kv_fraction=0.9, busy_waiting_requests=5, load_max_age_s=1.0)
    prompt = list(range(40))
    cache(sched, "w0", prompt)
    sched.update_load("w0", LoadSample(kv_active_blocks=95, kv_total_blocks=100), now=10.0)
    sched.update_load("w1", LoadSample(num_waiting=5), now=10.0)
    sched.update_load("w2", LoadSample(draining=True), now=10.0)
    with pytest.raises(Unavailable, match="busy"):
        sched.select(prompt, now=10.5)
    sched.update_load("w2", LoadSample(num_waiting=4), now=10.5)
    assert sched.select(prompt, now=10.6).worker_id == "w2"
    # Stale metrics give no verdict (and no correction): w0 wins on overlap again.
    assert sched.select(prompt, now=12.0).worker_id == "w0"
    with pytest.raises(Unavailable, match="no workers"):
        sched.select(prompt, now=12.0, candidates=["nope"])
    with pytest.raises(Unavailable):
        KvScheduler().select(prompt, now=0.0)


def test_bookings_track_prefill_until_first_token_and_decode_until_free() -> None:
    sched = make(1)
    events: list[LoadEvent] = []
    sched.add_listener(events.append)
    prompt = list(range(38))  # 9 full blocks + 2 tokens: 10 blocks of KV
    cache(sched, "w0", prompt[:12])
    sel = sched.select(prompt, now=0.0)
    sched.book("r1", sel, now=0.0, expected_output_tokens=6)  # 44 tokens: 11 blocks
    load = sched.worker("w0")
    assert load is not None
    assert (load.booked_prefill, load.booked_decode) == (7, 8)  # 3 of 10 (11) blocks cached
    assert sched.booking_worker("r1") == "w0" and sched.num_bookings() == 1
    assert sched.first_token("r1") and sched.first_token("r1")
    assert (load.booked_prefill, load.booked_decode) == (0, 8)
    assert sched.free("r1") and not sched.free("r1") and not sched.first_token("r1")
    assert (load.booked_prefill, load.booked_decode) == (0, 0)
    assert [e.kind for e in events] == [
        LoadEventKind.BOOKED,
        LoadEventKind.FIRST_TOKEN,
        LoadEventKind.FREED,
    ]
    assert events[0] == LoadEvent("r1", "r1", "w0", LoadEventKind.BOOKED, 7, 8)
    # Re-booking an id (a retry) replaces its booking.
    sched.book("r2", sel, now=0.0)
    sched.book("r2", sel, now=0.0)
    assert (load.booked_prefill, load.booked_decode) == (7, 7)
    sched.remove_listener(events.append)
    sched.remove_listener(events.append)


def test_load_metrics_correct_the_prediction_while_fresh() -> None:
    # chunk_tokens 16: one step prefills at most 4 blocks (BS 4), which a load sample taken
    # while that step runs may leave out.
    sched = make(2, load_max_age_s=1.0, chunk_tokens=16)
    sel = sched.select(list(range(40)), now=0.0, candidates=["w0"])
    sched.book("r", sel, now=0.0)  # w0: 10 prefill, 10 decode booked
    # The engine reports fewer active blocks (shared prefixes) and its prefill queue: 2 blocks,
    # 8 fewer than booked, of which up to one step (4 blocks) may be the step in flight.
    sched.update_load("w0", LoadSample(kv_active_blocks=4, pending_prefill_tokens=8), now=1.0)
    load = sched.worker("w0")
    assert load is not None
    assert load.decode_blocks(1.0, 1.0) == 4 and load.prefill_blocks(1.0, 1.0) == 2 + 4
    sched.book("r2", sched.select(list(range(100, 140)), 1.0, candidates=["w0"]), now=1.0)
    assert load.decode_blocks(1.5, 1.0) == 14 and load.prefill_blocks(1.5, 1.0) == 16
    assert load.decode_blocks(3.0, 1.0) == 20  # stale: bookings only
    sched.update_load("nobody", LoadSample(), now=1.0)
    # A booking younger than load_settle_s (0.25 s) cannot show in a measurement yet: it is
    # added to it rather than corrected away.
    sched.book("r3", sched.select(list(range(200, 240)), 3.0, candidates=["w0"]), now=3.0)
    sched.update_load("w0", LoadSample(kv_active_blocks=4, pending_prefill_tokens=8), now=3.1)
    assert load.decode_blocks(3.1, 1.0) == 4 + 10 and load.prefill_blocks(3.1, 1.0) == 2 + 4 + 10
    sched.update_load("w0", LoadSample(kv_active_blocks=4, pending_prefill_tokens=8), now=3.5)
    assert load.decode_blocks(3.5, 1.0) == 4 and load.prefill_blocks(3.5, 1.0) == 2 + 4
    # Within one step's budget of the bookings (30 blocks), a measurement corrects nothing
    # down; above them it corrects up (work the router did not book).
    sched.update_load("w0", LoadSample(pending_prefill_tokens=4 * 27), now=3.6)
    assert load.prefill_blocks(3.6, 1.0) == 30
    sched.update_load("w0", LoadSample(pending_prefill_tokens=4 * 33), now=3.7)
    assert load.prefill_blocks(3.7, 1.0) == 33


def test_peer_bookings_count_and_drop_with_the_peer() -> None:
    sched = make(2)
    sched.apply_peer("peer:a", LoadEvent("r2", "x", "w0", LoadEventKind.BOOKED, 5, 9))
    sched.apply_peer("peer:a", LoadEvent("r2", "y", "w0", LoadEventKind.BOOKED, 3, 3))
    sched.apply_peer("peer:a", LoadEvent("r2", "z", "gone", LoadEventKind.BOOKED, 3, 3))
    load = sched.worker("w0")
    assert load is not None
    assert (load.booked_prefill, load.booked_decode) == (8, 12)
    sched.apply_peer("peer:a", LoadEvent("r2", "x", "w0", LoadEventKind.FIRST_TOKEN))
    sched.apply_peer("peer:a", LoadEvent("r2", "y", "w0", LoadEventKind.FREED))
    assert (load.booked_prefill, load.booked_decode) == (0, 9)
    assert sched.num_bookings("peer:a") == 1 and sched.own_bookings() == []
    assert sched.select(list(range(8)), 0.0).worker_id == "w1"
    sched.drop_peer("peer:a")
    assert (load.booked_prefill, load.booked_decode) == (0, 0)
    with pytest.raises(ValueError):
        sched.apply_peer("", LoadEvent("r2", "x", "w0", LoadEventKind.FREED))


def test_a_worker_that_rejoins_is_not_touched_by_old_bookings() -> None:
    sched = make(1)
    sched.book("r", sched.select(list(range(8)), 0.0), now=0.0)
    sched.remove_worker("w0")
    with pytest.raises(Unavailable):
        sched.book("r3", sched.select(list(range(8)), 0.0), now=0.0)
    sched.add_worker("w0", block_size=BS)
    sched.free("r")
    load = sched.worker("w0")
    assert load is not None and (load.booked_prefill, load.booked_decode) == (0, 0)


def test_approximate_mode_learns_from_decisions_and_forgets_after_ttl() -> None:
    sched = KvScheduler(KvRouterConfig(approx_ttl_s=10.0, seed=2))
    for w in ("a", "b"):
        sched.add_worker(w, block_size=BS, kv_events=False)
    prompt = list(range(40))
    first = sched.select(prompt, now=0.0)
    sched.book("r1", first, now=0.0)
    sched.free("r1")
    again = sched.select(prompt, now=5.0)
    assert again.worker_id == first.worker_id and again.overlap_blocks == 10
    assert sched.select(prompt, now=10.0).overlap_blocks == 0  # expired
    # Switching a worker to exact mode drops what approximate mode knew.
    sched.book("r2", sched.select(prompt, now=11.0), now=11.0)
    sched.set_kv_events("a", True)
    sched.set_kv_events("b", True)
    sched.set_kv_events("b", True)
    assert sched.select(prompt, now=12.0).overlap_blocks == 0
    sched.set_kv_events("a", False)
    assert sched.workers() == ["a", "b"]


def test_config_is_validated() -> None:
    for bad in (
        {"overlap_weight": -1.0},
        {"temperature": -0.1},
        {"busy_kv_fraction": 1.5},
        {"busy_waiting_requests": -1},
        {"approx_ttl_s": 0.0},
        {"load_settle_s": -1.0},
    ):
        with pytest.raises(ValueError):
            KvRouterConfig(**bad)  # type: ignore[arg-type]


def test_routing_stats_histogram() -> None:
    stats = RoutingStats(bounds=(1e-5, 1e-4))
    assert stats.quantile(0.5) == 0.0 and stats.mean_s == 0.0
    for v in (5e-6, 5e-5, 5e-5, 1.0):
        stats.observe(v, overlap_blocks=1, prompt_blocks=2)
    assert stats.buckets() == [(1e-5, 1), (1e-4, 3), (float("inf"), 4)]
    assert stats.quantile(0.5) == 1e-4 and stats.quantile(1.0) == float("inf")
    assert stats.decisions == 4 and stats.overlap_blocks == 4 and stats.prompt_blocks == 8
    assert stats.mean_s == pytest.approx((5e-6 + 1e-4 + 1.0) / 4)


booking_ops = st.lists(
    st.tuples(
        st.sampled_from(["book", "first", "free", "peer_book", "peer_first", "peer_free", "drop"]),
        st.integers(0, 5),
        st.integers(0, 2),
        st.integers(0, 60),
    ),
    max_size=80,
)


@given(booking_ops)
@settings(max_examples=200, deadline=None)
def test_booked_load_equals_the_sum_of_active_bookings(
    ops: list[tuple[str, int, int, int]],
) -> None:
    """Bookings add up, with the prefix that own bookings still in prefill on the same worker
    will compute credited as cached (every prompt here is a prefix of range(60))."""
    sched = make(3)
    # (source, id) -> (worker, prefill blocks, decode blocks, the blocks [start, end) of
    # range(60)'s chain it has in the in-flight index)
    active: dict[tuple[str, str], tuple[str, int, int, tuple[int, int]]] = {}

    def computing(worker: str, skip: tuple[str, str] | None = None) -> int:
        covered = {
            i for k, v in active.items() if v[0] == worker and k != skip for i in range(*v[3])
        }
        depth = 0
        while depth in covered:
            depth += 1
        return depth

    for op, rid_n, wi, size in ops:
        rid, w = f"r{rid_n}", f"w{wi}"
        if op == "book":
            full = size // BS
            sel = sched.select(list(range(size)), 0.0, candidates=[w])
            assert sel.overlap_blocks == min(full, computing(w))
            sched.book(rid, sel, 0.0, expected_output_tokens=size)
            # booking it again: it does not share the blocks its first booking computes
            overlap = min(full, computing(w, skip=("", rid)))
            prefill = -(-size // BS) - overlap
            active[("", rid)] = (w, prefill, -(-2 * size // BS) - overlap, (overlap, full))
        elif op == "first" and ("", rid) in active:
            assert sched.first_token(rid)
            w0, _, d, _ = active[("", rid)]
            active[("", rid)] = (w0, 0, d, (0, 0))
        elif op == "free":
            assert sched.free(rid) == (("", rid) in active)
            active.pop(("", rid), None)
        elif op == "peer_book":
            sched.apply_peer("p", LoadEvent("x", rid, w, LoadEventKind.BOOKED, size, size + 1))
            active[("p", rid)] = (w, size, size + 1, (0, 0))  # peers share loads, not prompts
        elif op == "peer_first" and ("p", rid) in active:
            sched.apply_peer("p", LoadEvent("x", rid, w, LoadEventKind.FIRST_TOKEN))
            w0, _, d, _ = active[("p", rid)]
            active[("p", rid)] = (w0, 0, d, (0, 0))
        elif op == "peer_free":
            sched.apply_peer("p", LoadEvent("x", rid, w, LoadEventKind.FREED))
            active.pop(("p", rid), None)
        elif op == "drop":
            sched.drop_peer("p")
            active = {k: v for k, v in active.items() if k[0] != "p"}
        for i in range(3):
            load = sched.worker(f"w{i}")
            assert load is not None
            mine = [v for v in active.values() if v[0] == f"w{i}"]
            assert load.booked_prefill == sum(v[1] for v in mine)
            assert load.booked_decode == sum(v[2] for v in mine)
            chain = block_hashes(list(range(60)), BS)
            assert sched.inflight.extend(f"w{i}", chain, 0) == computing(f"w{i}")
        assert len(sched.own_bookings()) == sum(1 for k in active if not k[0])
