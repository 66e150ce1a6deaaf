"""The planner inside `kvmesh replay`: dynamic pools in virtual time (start-up delay, drained
workers finishing their requests and counted until they exit), the SLO and worker-hour
accounting, the day reshaping, the mocker's virtual-time profile, and the CLI contract."""

from __future__ import annotations

import io
import json
import math
import random
from collections.abc import Mapping
from pathlib import Path

import numpy
import pytest

from kvmesh.apps.cli import build_parser, replay_config
from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.policy import Decision, Observation, PoolState
from kvmesh.router.routing import RouterMode
from kvmesh.runtime.config import ConfigError, from_args
from kvmesh.runtime.types import Role
from kvmesh.sim.cluster import Cluster
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.main import run_replay
from kvmesh.sim.planned import PlannedReplay, simulate_planned
from kvmesh.sim.policies import make_policy
from kvmesh.sim.profiler import profile_mocker
from kvmesh.sim.replay import simulate
from kvmesh.sim.reshape import DayShape, day_rate, reshape_day
from kvmesh.sim.results import ModeResult, mean_itl
from kvmesh.sim.trace import Trace, TraceRequest, write_trace
from kvmesh.workers.mocker import PolynomialTiming
from kvmesh.workers.mocker.config import MockerConfig

pytestmark = pytest.mark.unit


def _trace(rows: list[tuple[float, int, int]]) -> Trace:
    return Trace("test", [TraceRequest(t * 1e3, isl, osl, []) for t, isl, osl in rows])


def _azure_like(n: int, seed: int = 0) -> Trace:
    """`n` requests shaped like Azure's conversation trace (no prefix ids; lognormal lengths,
    about 1 request/s), built here so the tests need no file outside the repository."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        isl = max(1, int(rng.lognormvariate(math.log(1000), 0.9)))
        osl = max(1, int(rng.lognormvariate(math.log(200), 0.8)))
        rows.append((t, isl, osl))
    return _trace(rows)


def test_mocker_profile_measures_the_timing_model() -> None:
    config = MockerConfig()
    profile = profile_mocker(config, max_model_len=40000)
    curve = profile.prefill_curve(Role.AGGREGATED)
    timing = PolynomialTiming()
    for isl, ttft in zip(curve.isl, curve.ttft_ms, strict=True):
        if isl <= config.max_num_batched_tokens:  # one step: exactly the prefill time
            assert ttft == pytest.approx(timing.prefill_ms(int(isl)), rel=1e-6)
    assert curve.ttft_ms == sorted(curve.ttft_ms)
    grid = profile.decode_grid(Role.AGGREGATED)
    assert grid.itl_at(256, 1) == pytest.approx(timing.decode_ms(257 / (16384 * 64)), rel=0.05)
    assert grid.itl_at(4096, 64) > grid.itl_at(4096, 1)  # more sequences, slower steps
    assert math.isinf(grid.itl_at(16384, 256))  # does not fit the KV cache
    fast = profile_mocker(MockerConfig(speedup_ratio=10.0), max_model_len=40000)
    assert fast.prefill_curve(Role.AGGREGATED).ttft_ms[0] == pytest.approx(curve.ttft_ms[0] / 10)


def test_reshape_makes_a_day() -> None:
    source = _azure_like(500, seed=3)
    day = reshape_day(source, duration_s=200.0, low_rps=2.0, peak_rps=20.0, seed=1)
    times = [r.timestamp_ms / 1e3 for r in day.requests]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 200.0
    expected = 200.0 * (2.0 + 20.0) / 2
    assert len(times) == pytest.approx(expected, rel=0.1)
    edges = sum(1 for t in times if t < 40 or t >= 160)
    middle = sum(1 for t in times if 80 <= t < 120)
    assert middle > 2 * edges / 2  # the peak is in the middle
    assert day_rate(100.0, 200.0, 2.0, 20.0) == pytest.approx(20.0)
    # more requests than the source: it starts over, repeats sharing no prefix
    mooncake = Trace("m", [TraceRequest(0.0, 600, 5, [1, 2]), TraceRequest(1.0, 700, 5, [1, 3])])
    cycled = reshape_day(mooncake, duration_s=10.0, low_rps=1.0, peak_rps=1.0, seed=0)
    assert len(cycled.requests) > 2
    assert cycled.requests[2].hash_ids == [5, 6] and cycled.requests[3].hash_ids == [5, 7]
    again = reshape_day(source, duration_s=200.0, low_rps=2.0, peak_rps=20.0, seed=1)
    assert [r.timestamp_ms for r in again.requests] == [r.timestamp_ms for r in day.requests]


def test_static_pool_hours_and_slo_attainment() -> None:
    trace = _trace([(0.1 * i, 200 + 50 * i, 20 + i) for i in range(30)])
    config = ReplayConfig(trace="test", workers=3, planning=PlannerConfig(ttft_slo_ms=40.0))
    result = simulate(trace, config, RouterMode.ROUND_ROBIN)
    assert result.worker_hours == pytest.approx(3 * result.duration_s / 3600, rel=1e-9)
    assert 0.0 < result.slo_attainment < 1.0  # the long prompts miss the 40 ms TTFT target
    loose = simulate(
        trace,
        ReplayConfig(trace="test", workers=3, planning=PlannerConfig(ttft_slo_ms=1e6)),
        RouterMode.ROUND_ROBIN,
    )
    assert loose.slo_attainment == 1.0
    assert sum(row["arrival_rps"] for row in result.timeline) * 10.0 == pytest.approx(30)
    assert {"t_s", "serving", "starting", "draining", "ttft_p90_ms", "itl_p90_ms"} <= set(
        result.timeline[0]
    )
    # each interval's share of its arrivals within the SLO adds up to the whole run's
    met = sum(row["slo_met"] * row["arrival_rps"] * 10.0 for row in result.timeline)
    assert met / 30 == pytest.approx(result.slo_attainment, abs=1e-3)
    assert all(row["slo_met"] == 1.0 for row in loose.timeline if row["arrival_rps"])


class Scripted:
    """A decider that asks for given pool sizes at given times (the planner's interface)."""

    def __init__(self, plan: dict[float, int]) -> None:
        self.plan = plan
        self.seen: list[tuple[float, Observation, PoolState]] = []

    def decide(self, now: float, obs: Observation, pools: Mapping[Role, PoolState]) -> Decision:
        pool = pools[Role.AGGREGATED]
        self.seen.append((now, obs, pool))
        target = self.plan.get(round(now, 6), pool.target)
        return Decision(targets={Role.AGGREGATED: target})

    def surge(self, now: float, obs: Observation, pools: Mapping[Role, PoolState]) -> Decision:
        return Decision(targets={})  # only the scripted sizes, at the intervals


def test_planned_pool_start_up_delay_and_drain_without_dropping_a_request() -> None:
    # 60 requests over 30 s, each decoding 400 tokens (a few seconds): workers always busy.
    trace = _trace([(0.5 * i, 300, 400) for i in range(60)])
    settings = PlannerConfig(adjustment_interval_s=5.0, worker_startup_s=3.0, min_workers=1)
    config = ReplayConfig(trace="test", planning=settings, planner=PlannerPolicy.QUEUE)
    ids = ["w0"]
    cluster = Cluster(trace, config, ids, make_policy(RouterMode.KV, ids, config))
    decider = Scripted({5.0: 4, 20.0: 1})
    replay = PlannedReplay(cluster, decider, config)
    replay.start(0.0)
    cluster.run(replay)
    result = cluster.summarize("planned", 0.0, replay.samples)
    assert result.requests == 60 and result.rejected == 0 and result.unfinished == 0
    workers = cluster.workers
    assert len(workers) == 4
    # the new workers started at 5 s and served nobody before 8 s (start-up)
    for w in workers[1:]:
        assert w.started_at == 5.0
    assert replay.samples[1][1] == {"serving": 1, "starting": 3, "draining": 0}  # at 5 s
    # at 20 s three of four left routing; they drained: each exited only after finishing
    drained = [w for w in workers if math.isfinite(w.stopped_at)]
    assert len(drained) == 3
    for w in drained:
        assert w.stopped_at >= 20.0
        assert not w.sched.has_work
    assert any(w.stopped_at > 20.0 for w in drained)  # some had requests in flight
    assert any(s["draining"] > 0 for _, s in replay.samples)
    # worker-hours: each worker from its start to its exit (or the end)
    t0 = min(cluster.timeline.arrival)
    end = t0 + result.duration_s
    expected = sum(min(w.stopped_at, end) - max(w.started_at, t0) for w in workers) / 3600
    assert result.worker_hours == pytest.approx(expected)
    assert result.worker_hours < 4 * result.duration_s / 3600
    # what the planner observed: arrivals in the interval (0, 0.5, ..., 5.0: an arrival at the
    # tick's instant comes before it), requests in flight
    first = decider.seen[0][1]
    assert first.requests == 11 and first.interval_s == 5.0 and first.inflight > 0
    assert first.isl_mean == 300.0 and first.first_tokens >= 5
    # and, per interval, the requests that finished in it with their own mean ITL at the
    # quantile (the per-request histogram a gateway exports)
    t = cluster.timeline
    measured = 0
    for now, o, _ in decider.seen:
        done = [i for i, f in enumerate(t.finished_at) if now - 5.0 < f <= now]
        assert o.finished == len(done)
        if not done:
            assert math.isnan(o.itl_tail_ms)
            continue
        own = sorted(mean_itl(t, i) for i in done)
        assert min(own) <= o.itl_tail_ms / 1e3 <= max(own)
        assert o.itl_tail_ms / 1e3 == pytest.approx(
            float(numpy.quantile(own, settings.itl_quantile))
        )
        # the share of them within the ITL target, and of the interval's first tokens within
        # the TTFT target (the planner's attainment correction)
        assert o.itl_within == sum(x <= settings.itl_slo_ms / 1e3 for x in own) / len(own)
        ttft = [f - a for a, f in zip(t.arrival, t.first_at, strict=True) if now - 5.0 < f <= now]
        assert o.first_tokens == len(ttft)
        if ttft:
            within = sum(x <= settings.ttft_slo_ms / 1e3 for x in ttft) / len(ttft)
            assert o.ttft_within == pytest.approx(within)
        measured += 1
    assert measured >= 3


def test_sla_planner_grows_and_shrinks_with_a_day() -> None:
    # short outputs keep the replay quick; prompts of 800-1500 tokens
    source = _trace([(0.0, 800 + (i * 37) % 700, 30 + (i * 11) % 50) for i in range(200)])
    day = reshape_day(source, duration_s=60.0, low_rps=3.0, peak_rps=50.0, seed=0)
    settings = PlannerConfig(
        ttft_slo_ms=250.0,
        itl_slo_ms=15.0,
        adjustment_interval_s=5.0,
        worker_startup_s=5.0,
        min_workers=1,
        max_workers=10,
    )
    config = ReplayConfig(trace="day", planning=settings, planner=PlannerPolicy.SLA)
    profile = profile_mocker(config.mocker, max_model_len=4096)
    result = simulate_planned(day, config, RouterMode.KV, profile)
    assert result.requests == len(day.requests)
    assert result.planner is not None
    moves = [(d["from"], d["to"]) for d in result.planner["decisions"]]
    assert any(b > a for a, b in moves) and any(b < a for a, b in moves)
    assert result.workers >= 3  # the peak needs several workers
    assert replay_serving_at_end(result) < result.workers  # and fewer once it is over
    assert result.slo_attainment > 0.85  # deterministic (virtual time); a fast, short day
    static = simulate(
        day, ReplayConfig(trace="day", workers=result.workers, planning=settings), RouterMode.KV
    )
    assert result.worker_hours < 0.9 * static.worker_hours


def replay_serving_at_end(result: ModeResult) -> int:
    return int(result.timeline[-1]["serving"])


def test_replay_cli_contract(tmp_path: Path) -> None:
    """The command line the issue's scripts call, and its JSON fields."""
    source = _azure_like(400, seed=4)
    path = tmp_path / "day.jsonl"
    write_trace(reshape_day(source, duration_s=40.0, low_rps=2.0, peak_rps=10.0), str(path))
    common = ["replay", "--trace", str(path), "--router", "kv", "--block-size", "64",
              "--ttft-slo-ms", "300", "--itl-slo-ms", "20", "--json"]  # fmt: skip
    for extra in (
        ["--workers", "2"],
        ["--planner", "sla", "--min-workers", "1", "--max-workers", "4", "--worker-startup-s", "5"],
    ):
        ns = build_parser().parse_args([*common, *extra])
        out = io.StringIO()
        run_replay(replay_config(ns), out=out, err=io.StringIO())
        row = json.loads(out.getvalue())
        assert 0.0 <= row["slo_attainment"] <= 1.0
        assert row["worker_hours"] > 0
        assert row["timeline"] and {"t_s", "arrival_rps", "serving", "ttft_p90_ms",
                                    "itl_p90_ms"} <= set(row["timeline"][0])  # fmt: skip
        assert (row["planner"] is None) == ("--workers" in extra)


def test_the_replayed_sla_planner_gives_the_router_its_targets() -> None:
    """As `kvmesh up --planner sla` does (test_cli_flags): the KV router keeps the SLA
    planner's targets unless given its own; a static pool or the queue baseline keeps none."""

    def router(*extra: str) -> tuple[float, float]:
        ns = build_parser().parse_args(["replay", "--trace", "x", "--ttft-slo-ms", "300",
                                        "--itl-slo-ms", "20", *extra])  # fmt: skip
        kv = replay_config(ns).kv_router()
        return kv.ttft_slo_ms, kv.itl_slo_ms

    assert router() == (0.0, 0.0)
    assert router("--planner", "queue") == (0.0, 0.0)
    assert router("--planner", "sla") == (300.0, 20.0)
    assert router("--planner", "sla", "--router-ttft-slo-ms", "500") == (500.0, 20.0)
    assert router("--router-itl-slo-ms", "25") == (0.0, 25.0)


def test_replay_planner_settings_are_checked() -> None:
    ns = build_parser().parse_args(["replay", "--trace", "x", "--planner", "sla",
                                    "--min-workers", "3", "--max-workers", "2"])  # fmt: skip
    with pytest.raises(ConfigError, match="min-workers"):
        from_args(PlannerConfig, ns)


def test_surge_check_grows_the_pool_between_intervals() -> None:
    # 2 req/s for 20 s, then a step to 40 req/s: the surge check sees it within seconds; without
    # it the pool waits for the next interval (every 10 s)
    rows = [(0.5 * i, 600, 20) for i in range(40)]
    rows += [(20.0 + 0.025 * i, 600, 20) for i in range(800)]
    trace = _trace(rows)

    def first_growth(check_s: float) -> dict[str, object]:
        settings = PlannerConfig(
            ttft_slo_ms=250.0,
            itl_slo_ms=15.0,
            adjustment_interval_s=10.0,
            worker_startup_s=5.0,
            max_workers=12,
            surge_check_s=check_s,
        )
        config = ReplayConfig(trace="step", planning=settings, planner=PlannerPolicy.SLA)
        profile = profile_mocker(config.mocker, max_model_len=4096)
        result = simulate_planned(trace, config, RouterMode.KV, profile)
        assert result.planner is not None and result.planner["surge_check_s"] == check_s
        return next(d for d in result.planner["decisions"] if d["to"] > d["from"])

    with_surge = first_growth(2.0)
    without = first_growth(0.0)
    assert without["t_s"] == 30.0  # the first interval after the step
    assert 20.0 < float(with_surge["t_s"]) < 30.0  # type: ignore[arg-type]
    assert str(with_surge["reason"]).startswith("sla surge")


def test_reshape_shapes() -> None:
    def rate(t: float, shape: DayShape) -> float:
        return day_rate(t, 100.0, 2.0, 20.0, shape)

    two = DayShape.TWO_PEAKS
    assert rate(25.0, two) == pytest.approx(20.0) == rate(75.0, two)
    assert rate(50.0, two) == pytest.approx(2.0)
    ramp = DayShape.RAMP
    assert [rate(t, ramp) for t in (10.0, 25.0, 45.0, 65.0, 90.0)] == pytest.approx(
        [2.0, 11.0, 20.0, 11.0, 2.0]
    )
    flash = DayShape.FLASH
    assert [rate(t, flash) for t in (39.9, 40.0, 49.9, 50.0)] == [2.0, 20.0, 20.0, 2.0]
    source = _trace([(0.0, 100, 10)] * 50)
    day = reshape_day(source, duration_s=100.0, low_rps=1.0, peak_rps=30.0, shape=flash, seed=2)
    inside = sum(1 for r in day.requests if 40e3 <= r.timestamp_ms < 50e3)
    assert inside > 0.6 * len(day.requests)  # the crowd: 300 of ~390 arrivals in 10 % of the day
