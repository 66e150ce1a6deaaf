"""The planner's pure parts: predictors, the latency model over a profile, the SLA and queue
policies, the shared limits (min/max, stabilization window, budget), the drain order."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.drain import DrainCandidate, drain_order
from kvmesh.planner.model import WorkerModel
from kvmesh.planner.policy import (
    ATTAIN_GAIN_DOWN,
    ATTAIN_GAIN_UP,
    ATTAIN_LIMITS,
    ATTAIN_SAMPLES,
    Decision,
    Observation,
    Planner,
    PoolState,
    SlaPolicy,
)
from kvmesh.planner.predictors import (
    ConstantPredictor,
    KalmanPredictor,
    MovingAveragePredictor,
    PredictorKind,
    make_predictor,
)
from kvmesh.planner.profile import DecodeGrid, PerfProfile, PrefillCurve, RoleProfile
from kvmesh.runtime.errors import InvalidRequest, Unimplemented
from kvmesh.runtime.types import Role

pytestmark = pytest.mark.unit

AGG = Role.AGGREGATED

# A worker whose prefill takes 10 ms + 0.02 ms/token alone, and whose decode step is 5 ms plus
# 0.05 ms per sequence (context does not matter), measured up to 256 sequences.
PREFILL = PrefillCurve([100.0, 1000.0, 10000.0], [12.0, 30.0, 210.0], [4e4, 4e4, 4e4])
CONC = [1.0, 16.0, 64.0, 256.0]
DECODE = DecodeGrid(
    [512.0, 8192.0],
    CONC,
    [[5.0 + 0.05 * c for c in CONC], [5.0 + 0.05 * c for c in CONC]],
    [[c / (5.0 + 0.05 * c) * 1e3 for c in CONC], [c / (5.0 + 0.05 * c) * 1e3 for c in CONC]],
)
PROFILE = PerfProfile("test", "m", "hand-made", {AGG: RoleProfile(PREFILL, DECODE)})


def obs(rate: float, *, interval: float = 10.0, inflight: int = 0, **kw: float) -> Observation:
    n = round(rate * interval)
    return Observation(
        interval_s=interval, requests=n, isl_mean=1000.0 if n else math.nan,
        osl_mean=100.0 if n else math.nan, inflight=inflight, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def config(**kw: object) -> PlannerConfig:
    base: dict[str, object] = {
        "ttft_slo_ms": 200.0,
        "itl_slo_ms": 20.0,
        "adjustment_interval_s": 10.0,
        "predictor": PredictorKind.CONSTANT,
        "min_workers": 1,
        "max_workers": 20,
        "scale_down_delay_s": 30.0,
        "worker_startup_s": 0.0,
        "prediction_margin": 0.0,
    }
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def test_predictors() -> None:
    c = ConstantPredictor()
    assert c.predict() == 0.0
    c.observe(5.0)
    assert c.predict(3) == 5.0
    m = MovingAveragePredictor(window=3)
    for v in (1, 2, 3, 10):
        m.observe(v)
    assert m.predict() == pytest.approx(5.0)
    k = KalmanPredictor()
    for t in range(40):  # a ramp, +2 per interval, with a little noise
        k.observe(10 + 2 * t + (0.5 if t % 2 else -0.5))
    assert k.predict(1) == pytest.approx(10 + 2 * 40, abs=2.0)
    assert k.predict(5) == pytest.approx(10 + 2 * 44, abs=4.0)  # extrapolates the trend
    flat = KalmanPredictor()
    for _ in range(30):
        flat.observe(7.0)
    assert flat.predict(10) == pytest.approx(7.0, abs=1e-3)
    down = KalmanPredictor()
    for t in range(20):
        down.observe(max(0.0, 20 - 3 * t))
    assert down.predict(5) >= 0.0  # never negative


def test_optional_predictors_say_how_to_get_them() -> None:
    for kind, module in ((PredictorKind.ARIMA, "statsmodels"), (PredictorKind.PROPHET, "prophet")):
        try:
            __import__(module)
        except ImportError:
            with pytest.raises(Unimplemented, match=f"kvmesh\\[{kind.value}\\]"):
                make_predictor(kind, 10.0)
        else:
            p = make_predictor(kind, 10.0)
            for t in range(30):
                p.observe(10.0 + t)
            assert p.predict(1) == pytest.approx(40.0, abs=4.0)


def test_latency_model_and_capacity() -> None:
    model = WorkerModel(PREFILL, DECODE)
    idle = model.latency(1e-6, 1000, 100)
    assert idle.ttft_ms == pytest.approx(30.0, rel=1e-3)  # the prefill alone
    assert idle.itl_ms == pytest.approx(5.05, rel=1e-2)
    busy = model.latency(20.0, 1000, 100)  # rho = 0.6: queueing and interleaved prefills
    assert busy.ttft_ms > idle.ttft_ms and busy.itl_ms > idle.itl_ms / (1 - 0.6) * 0.99
    assert math.isinf(model.latency(40.0, 1000, 100).ttft_ms)  # prefill saturated
    cap = model.capacity(1000, 100, ttft_ms=200.0, itl_ms=20.0)
    at_cap = model.latency(cap, 1000, 100)
    assert at_cap.itl_ms <= 20.0 + 1e-6 and at_cap.ttft_ms <= 200.0 + 1e-6
    over = model.latency(cap * 1.05, 1000, 100)
    assert over.itl_ms > 20.0 or over.ttft_ms > 200.0
    assert model.capacity(1000, 100, ttft_ms=1.0, itl_ms=20.0) == 0.0  # unreachable
    # decode-only and prefill-only workers (disaggregated pools)
    assert WorkerModel(None, DECODE).latency(10.0, 1000, 100).ttft_ms == 0.0
    assert WorkerModel(PREFILL, None).capacity(1000, 100, 200.0, 1.0) > 0


def test_sla_planner_follows_the_load_both_ways() -> None:
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    high = math.floor(100 * cap) / 10  # 10 workers' worth, in whole requests per interval
    pool = PoolState(AGG, target=1, ready=1)
    now = 0.0
    targets = []
    for rate in (2.0, high, high, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0):
        now += 10.0
        d = planner.decide(now, obs(rate), {AGG: pool})
        targets.append(d.targets[AGG])
        pool = PoolState(AGG, target=d.targets[AGG], ready=d.targets[AGG])
    assert targets[0] == 1
    assert targets[1] == math.ceil(high / cap - 1e-9) == 10  # up at once
    # down only once the window (30 s, ends included) holds nothing larger: the last high
    # interval was at 30 s, so 60 s still holds
    assert targets[2:6] == [10, 10, 10, 10]
    assert targets[6] == 1
    assert targets[-1] == 1  # zero traffic: the minimum


def test_a_falling_load_shrinks_the_pool_after_one_interval() -> None:
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)

    def targets(checks: bool) -> list[int]:
        # 10 s start-up: a 20 s stabilization window, and a trend over the last 20 s
        planner = Planner(config(worker_startup_s=10.0, scale_down_delay_s=None),
                          PlannerPolicy.SLA, [AGG], PROFILE)  # fmt: skip
        pool = PoolState(AGG, target=10, ready=10)
        out = []
        now = 0.0
        for workers in (10, 10, 8, 6, 4, 2, 2, 2):
            rate = 0.95 * workers * cap
            if checks:  # the surge checks' windows feed the trend between intervals
                for k in range(1, 5):
                    planner.surge(now + 2.0 * k, obs(rate, interval=2.0), {AGG: pool})
            now += 10.0
            d = planner.decide(now, obs(rate), {AGG: pool})
            out.append(d.targets[AGG])
            pool = PoolState(AGG, target=out[-1], ready=out[-1])
        return out

    # the trend falls past its noise: each interval keeps only the last one's size; once the
    # rate stopped falling (2, 2 after 4), the whole window holds again
    assert targets(checks=True) == [10, 10, 10, 8, 6, 4, 4, 2]
    # with too few windows to tell a trend (no surge checks here), the whole window holds
    assert targets(checks=False) == [10, 10, 10, 10, 8, 6, 4, 2]


def test_zero_traffic_scales_to_zero_and_a_waiting_request_brings_one_back() -> None:
    planner = Planner(
        config(min_workers=0, scale_down_delay_s=0.0), PlannerPolicy.SLA, [AGG], PROFILE
    )
    d = planner.decide(10.0, obs(0.0), {AGG: PoolState(AGG, target=2, ready=2)})
    assert d.targets[AGG] == 0
    d = planner.decide(20.0, obs(0.0, inflight=1), {AGG: PoolState(AGG, target=0, ready=0)})
    assert d.targets[AGG] == 1


def test_queued_work_counts_and_starting_workers_are_not_counted_twice() -> None:
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    calm = planner.decide(10.0, obs(5.0), {AGG: PoolState(AGG, target=1, ready=1)})
    assert calm.targets[AGG] == 1
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    burst = planner.decide(10.0, obs(5.0, inflight=2000), {AGG: PoolState(AGG, target=1, ready=1)})
    assert burst.targets[AGG] > 3  # the backlog asks for more workers
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    pending = planner.decide(
        10.0,
        obs(5.0, inflight=2000),
        {AGG: PoolState(AGG, target=burst.targets[AGG], ready=1, starting=burst.targets[AGG] - 1)},
    )
    # the same backlog with those workers already starting: no more than asked before
    assert pending.targets[AGG] <= burst.targets[AGG]


def test_observed_latency_corrects_the_profile() -> None:
    def capacity(ttft_tail: float, itl: float) -> float:
        planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
        o = obs(30.0, first_tokens=300, ttft_tail_ms=ttft_tail, itl_ms=itl)
        decision = planner.decide(10.0, o, {AGG: PoolState(AGG, target=3, ready=3)})
        return decision.capacity_rps[AGG]

    expected = WorkerModel(PREFILL, DECODE).latency(10.0, 1000, 100)
    as_profiled = capacity(expected.ttft_ms, expected.itl_ms)
    assert as_profiled == pytest.approx(
        WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9), rel=1e-6
    )
    # slower than the profile says (TTFT tail or ITL): less per worker, so more workers
    assert capacity(20 * expected.ttft_ms, expected.itl_ms) < as_profiled
    assert capacity(expected.ttft_ms, 2 * expected.itl_ms) < as_profiled
    assert capacity(expected.ttft_ms / 2, expected.itl_ms / 2) > as_profiled


def test_prediction_margin_grows_with_prediction_errors() -> None:
    def planned(margin: float, rates: list[float]) -> float:
        planner = Planner(config(prediction_margin=margin), PlannerPolicy.SLA, [AGG], PROFILE)
        d = None
        for i, rate in enumerate(rates):
            d = planner.decide(10.0 * (i + 1), obs(rate), {AGG: PoolState(AGG, 1, 1)})
        assert d is not None
        return d.predicted_rps

    steady = [20.0] * 8
    assert planned(1.0, steady) == pytest.approx(planned(0.0, steady))  # no error, no margin
    jumpy = [20.0, 40.0, 20.0, 40.0, 20.0, 40.0]
    assert planned(1.0, jumpy) > planned(0.0, jumpy) + 5


def test_budget_and_limits() -> None:
    planner = Planner(config(max_total_workers=5, max_workers=4), PlannerPolicy.SLA,
                      [Role.PREFILL, Role.DECODE], PROFILE)  # fmt: skip
    pools = {
        Role.PREFILL: PoolState(Role.PREFILL, target=1, ready=1),
        Role.DECODE: PoolState(Role.DECODE, target=1, ready=1),
    }
    d = planner.decide(10.0, obs(500.0), pools)
    assert all(1 <= n <= 4 for n in d.targets.values())
    assert sum(d.targets.values()) == 5
    with pytest.raises(InvalidRequest, match="not both"):
        Planner(config(), PlannerPolicy.SLA, [AGG, Role.DECODE], PROFILE)
    with pytest.raises(InvalidRequest, match="profile"):
        Planner(config(), PlannerPolicy.SLA, [AGG], None)
    with pytest.raises(ValueError, match="min-workers"):
        PlannerConfig(min_workers=5, max_workers=2)


def test_queue_policy_is_hpa() -> None:
    cfg = config(queue_target=4.0, scale_down_delay_s=0.0)
    planner = Planner(cfg, PlannerPolicy.QUEUE, [AGG])
    pool = PoolState(AGG, target=10, ready=10)
    assert planner.decide(10.0, obs(1.0, inflight=40), {AGG: pool}).targets[AGG] == 10
    assert planner.decide(20.0, obs(1.0, inflight=43), {AGG: pool}).targets[AGG] == 10  # +-10 %
    assert planner.decide(30.0, obs(1.0, inflight=60), {AGG: pool}).targets[AGG] == 15
    assert planner.decide(40.0, obs(1.0, inflight=8), {AGG: pool}).targets[AGG] == 2


def test_drain_order_prefers_the_least_cached_value() -> None:
    order = drain_order(
        [
            DrainCandidate("hot", started=1.0, cached_blocks=900, inflight=1),
            DrainCandidate("cold", started=2.0, cached_blocks=10, inflight=5),
            DrainCandidate("cold-idle", started=0.0, cached_blocks=10, inflight=0),
            DrainCandidate("booting", started=3.0, serving=False),
            DrainCandidate("booting-new", started=4.0, serving=False),
        ]
    )
    assert [c.worker_id for c in order] == ["booting-new", "booting", "cold-idle", "cold", "hot"]


def test_surge_grows_an_overloaded_pool_between_intervals() -> None:
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    one = PoolState(AGG, target=1, ready=1)
    assert planner.decide(10.0, obs(0.5 * cap), {AGG: one}).targets[AGG] == 1
    # 2 s later the arrivals run at 6 workers' worth: grown now, not at the next interval
    d = planner.surge(12.0, obs(6 * cap, interval=2.0), {AGG: one})
    assert 5 <= d.targets[AGG] <= 6 and d.reasons[AGG].startswith("sla surge")
    grown = PoolState(AGG, target=d.targets[AGG], ready=1, starting=d.targets[AGG] - 1)
    # a calm window changes nothing (a surge never shrinks)
    assert planner.surge(16.0, obs(0.1 * cap, interval=2.0), {AGG: grown}).targets == {}
    # and what the surge asked for holds through the stabilization window (30 s)
    ready = PoolState(AGG, target=d.targets[AGG], ready=d.targets[AGG])
    assert planner.decide(20.0, obs(0.5 * cap), {AGG: ready}).targets[AGG] == d.targets[AGG]
    assert planner.decide(50.0, obs(0.5 * cap), {AGG: ready}).targets[AGG] == 1


def test_surge_counts_starting_workers() -> None:
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    n = planner.decide(10.0, obs(6 * cap), {AGG: PoolState(AGG, 1, 1)}).targets[AGG]
    assert 6 <= n <= 7
    # the same steady load with those workers still starting: not asked for again
    starting = PoolState(AGG, target=n, ready=1, starting=n - 1)
    for t in (12.0, 14.0, 16.0, 18.0):
        assert planner.surge(t, obs(6 * cap, interval=2.0), {AGG: starting}).targets == {}


def test_surge_foresees_a_ramp_before_the_pool_is_outgrown() -> None:
    # Start-up 10 s; the load climbs 0.1 worker's capacity per second from 1.5 workers' worth.
    # No window yet exceeds what 3 workers serve, but the trend passes it before a worker
    # asked now could serve: the trend-reading surge grows the pool; without the trend
    # (the arrivals alone) nothing would.
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    cfg = config(worker_startup_s=10.0)
    planner = Planner(cfg, PlannerPolicy.SLA, [AGG], PROFILE)
    three = PoolState(AGG, 3, 3)
    assert planner.decide(10.0, obs(1.5 * cap), {AGG: three}).targets[AGG] == 3
    grew: dict[Role, int] = {}
    t = 10.0
    while not grew and t < 24.0:
        t += 2.0
        rate = (1.5 + 0.1 * (t - 11.0)) * cap
        assert rate < 3 * cap  # the pool has not been outgrown
        grew = planner.surge(t, obs(rate, interval=2.0), {AGG: three}).targets
    assert grew and grew[AGG] > 3, "the trend should have grown the pool before it was outgrown"


@pytest.mark.parametrize(
    ("value", "error", "grows"),
    [
        (3.3, 0.5, True),  # over 3 workers' worth by more than half its standard error
        (3.3, 1.0, False),  # by less: noise
        (3.3, math.inf, False),  # too few windows for a trend
        (2.9, 0.0, False),  # the pool serves it
    ],
)
def test_surge_foresight_hedges_half_a_standard_error(
    monkeypatch: pytest.MonkeyPatch, value: float, error: float, grows: bool
) -> None:
    """The trend's forecast (in workers' worth of load) counts less half of its standard error:
    a pool grown a check early costs a few worker-seconds, one grown late is overloaded until
    its worker starts."""
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    three = PoolState(AGG, 3, 3)
    planner = Planner(config(worker_startup_s=10.0), PlannerPolicy.SLA, [AGG], PROFILE)
    assert planner.decide(10.0, obs(1.5 * cap), {AGG: three}).targets[AGG] == 3
    policy = planner.policy
    assert isinstance(policy, SlaPolicy)
    monkeypatch.setattr(policy.trend, "forecast", lambda at: (value * cap, error * cap))
    d = planner.surge(12.0, obs(1.5 * cap, interval=2.0), {AGG: three})
    assert d.targets == ({AGG: 4} if grows else {})
    if grows:
        assert "on the trend" in d.reasons[AGG]


def test_surge_reads_queued_work_and_latency_but_not_noise() -> None:
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    four = PoolState(AGG, target=4, ready=4)

    def surge(o: Observation) -> dict[Role, int]:
        planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
        planner.decide(10.0, obs(3 * cap), {AGG: four})
        return planner.surge(12.0, o, {AGG: four}).targets

    assert surge(obs(3 * cap, interval=2.0)) == {}  # the load it was sized for
    assert surge(obs(3 * cap, interval=2.0, inflight=5000))[AGG] > 4  # queued work
    assert surge(obs(3 * cap, interval=2.0, itl_ms=40.0))[AGG] > 4  # ITL over the target
    slow = {"first_tokens": 50.0, "ttft_tail_ms": 900.0}
    assert surge(obs(3 * cap, interval=2.0, **slow))[AGG] > 4  # TTFT tail over the target
    # a short window: 3 arrivals where 2 were expected is noise, not a surge
    small = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    small.decide(10.0, obs(0.9 * cap), {AGG: PoolState(AGG, 1, 1)})
    blip = Observation(interval_s=0.2, requests=math.ceil(0.2 * 1.4 * cap), isl_mean=1000.0)
    assert small.surge(10.2, blip, {AGG: PoolState(AGG, 1, 1)}).targets == {}


def test_surge_respects_limits_and_the_queue_baseline_has_none() -> None:
    cap = WorkerModel(PREFILL, DECODE).capacity(1000, 100, 200.0, 20.0 * 0.9)
    planner = Planner(config(max_total_workers=5, max_workers=4), PlannerPolicy.SLA,
                      [Role.PREFILL, Role.DECODE], PROFILE)  # fmt: skip
    pools = {
        Role.PREFILL: PoolState(Role.PREFILL, target=1, ready=1),
        Role.DECODE: PoolState(Role.DECODE, target=1, ready=1),
    }
    planner.decide(10.0, obs(1.0), pools)
    d = planner.surge(12.0, obs(50 * cap, interval=2.0), pools)
    assert d.targets and all(n <= 4 for n in d.targets.values())
    assert sum({**{r: s.target for r, s in pools.items()}, **d.targets}.values()) <= 5
    queue = Planner(config(), PlannerPolicy.QUEUE, [AGG])
    queue.decide(10.0, obs(1.0, inflight=8), {AGG: PoolState(AGG, 1, 1)})
    big = obs(100.0, interval=2.0, inflight=5000)
    assert queue.surge(12.0, big, {AGG: PoolState(AGG, 1, 1)}).targets == {}


def test_prefix_cached_prompt_tokens_are_not_priced_as_prefill() -> None:
    model = WorkerModel(PREFILL, DECODE)
    cold = model.capacity(8000, 100, 200.0, 18.0)
    warm = model.capacity(8000, 100, 200.0, 18.0, cached=6000)
    assert warm > 1.5 * cold  # 2000 new tokens to prefill instead of 8000
    assert (
        model.latency(1.0, 8000, 100, cached=6000).ttft_ms < model.latency(1.0, 8000, 100).ttft_ms
    )

    # the SLA policy reads the cached share from the observations: fewer workers for the same
    # load when most of each prompt is found in the prefix cache
    def size(**kw: float) -> int:
        planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
        pool = PoolState(AGG, 1, 1)
        n = round(10 * 4 * cold)
        o = Observation(interval_s=10.0, requests=n, finished=n, isl_mean=8000.0,
                        osl_mean=100.0, **kw)  # type: ignore[arg-type]  # fmt: skip
        return planner.decide(10.0, o, {AGG: pool}).targets[AGG]

    assert size(cached_mean=6000.0) < size()
    assert size(cached_mean=math.nan) == size()


def test_metrics_observation_reads_the_cached_prompt_tokens() -> None:
    from kvmesh.planner.metrics import (
        FRONTEND_METRICS,
        HistogramValue,
        MetricNames,
        Snapshot,
        observation,
    )

    names = FRONTEND_METRICS

    def snap(at: float, n: float, cached_sum: float) -> Snapshot:
        hist = {
            names.prompt_tokens: HistogramValue([(math.inf, n)], 1000.0 * n, n),
            names.cached_tokens: HistogramValue([(math.inf, n)], cached_sum, n),
        }
        return Snapshot(at, hist)

    o = observation(snap(0.0, 10, 1000.0), snap(10.0, 30, 13000.0), names, 0.95, 0.95)
    assert o.requests == 20 and o.cached_mean == pytest.approx(600.0)
    # a gateway that does not export it: not measured
    bare = MetricNames(names.prompt_tokens, names.output_tokens, names.ttft_seconds,
                       names.itl_seconds, names.inflight)  # fmt: skip
    o = observation(snap(0.0, 10, 0.0), snap(10.0, 30, 5.0), bare, 0.95, 0.95)
    assert math.isnan(o.cached_mean) and math.isnan(o.itl_tail_ms)


def test_cached_share_is_the_lowest_of_the_window() -> None:
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    policy = planner.policy
    assert isinstance(policy, SlaPolicy)
    pool = {AGG: PoolState(AGG, 1, 1)}

    def interval(now: float, finished: int, cached: float) -> None:
        o = Observation(10.0, finished, finished=finished, isl_mean=1000.0, osl_mean=100.0,
                        cached_mean=cached)  # fmt: skip
        planner.decide(now, o, pool)

    # quiet intervals only (fewer than 5 finished each): weighted by prompt tokens
    interval(10.0, 1, 900.0)
    assert policy.cached_share() == pytest.approx(0.9)
    interval(20.0, 3, 100.0)
    assert policy.cached_share() == pytest.approx((900 + 300) / 4000)
    # a busy interval at 10 %, then the share rises: planned on only once it held the window
    interval(30.0, 99, 100.0)
    assert policy.cached_share() == pytest.approx(0.1)
    for i in range(5):
        interval(40.0 + 10 * i, 99, 700.0)
        assert policy.cached_share() == pytest.approx(0.1)
    interval(90.0, 99, 700.0)
    assert policy.cached_share() == pytest.approx(0.7)
    # an interval where nothing finished does not move it
    planner.decide(100.0, Observation(10.0, 5, isl_mean=1000.0), pool)
    assert policy.cached_share() == pytest.approx(0.7)


def test_pool_is_sized_on_the_requests_own_itl_at_the_quantile() -> None:
    model = WorkerModel(PREFILL, DECODE)
    expected = model.latency(10.0, 1000, 100)

    def capacity(intervals: int = 40, finished: int = 300, itl_tail_ms: float = math.nan) -> float:
        planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
        o = obs(30.0, first_tokens=300, finished=finished, ttft_tail_ms=expected.ttft_ms,
                itl_ms=expected.itl_ms, itl_tail_ms=itl_tail_ms)  # fmt: skip
        pools = {AGG: PoolState(AGG, target=3, ready=3)}
        decisions = [planner.decide(10.0 * (i + 1), o, pools) for i in range(intervals)]
        return decisions[-1].capacity_rps[AGG]

    # no per-request ITL measured: the mean, with the headroom under the target
    mean_based = model.capacity(1000, 100, 200.0, 20.0 * 0.9)
    assert capacity() == pytest.approx(mean_based, rel=1e-6)
    # the requests' own mean ITL at the quantile is 1.5x the mean: the model's mean may reach
    # only target / 1.5 (tighter than the headroom's 0.9), so each worker serves less
    spread = capacity(itl_tail_ms=1.5 * expected.itl_ms)
    assert spread == pytest.approx(model.capacity(1000, 100, 200.0, 20.0 / 1.5), rel=1e-3)
    assert spread < mean_based
    # one interval moves the correction from what the headroom assumed, not all the way
    once = capacity(1, itl_tail_ms=1.5 * expected.itl_ms)
    factor = 0.7 / 0.9 + 0.3 * 1.5
    assert once == pytest.approx(model.capacity(1000, 100, 200.0, 20.0 / factor), rel=1e-6)
    # requests that barely vary: the whole target, more per worker than the headroom allows
    assert capacity(itl_tail_ms=1.02 * expected.itl_ms) > mean_based
    # too few finished requests for the 90th percentile (fewer than 10): not used
    assert PlannerConfig().itl_quantile == 0.9
    few = capacity(finished=9, itl_tail_ms=3 * expected.itl_ms)
    assert few == pytest.approx(mean_based, rel=1e-6)


def test_metrics_observation_reads_the_per_request_itl_quantile() -> None:
    from kvmesh.planner.metrics import FRONTEND_METRICS, HistogramValue, Snapshot, observation

    names = FRONTEND_METRICS
    assert names.request_itl_seconds in names.histograms

    def snap(at: float, fast: float, slow: float) -> Snapshot:
        # per-request mean ITL: `fast` requests under 10 ms, `slow` between 10 and 40 ms
        buckets = [(0.01, fast), (0.04, fast + slow), (math.inf, fast + slow)]
        hist = {names.request_itl_seconds: HistogramValue(buckets, 0.0, fast + slow)}
        return Snapshot(at, hist)

    o = observation(snap(0.0, 10, 0), snap(10.0, 100, 10), names, 0.95, 0.95)
    # 100 new requests, 90 under 10 ms: the 95th is halfway through the 10 slow ones
    assert o.itl_tail_ms == pytest.approx(25.0)
    assert math.isnan(observation(snap(0.0, 1, 0), snap(10.0, 1, 0), names, 0.95, 0.95).itl_tail_ms)


def test_metrics_observation_reads_the_shares_within_the_targets() -> None:
    from kvmesh.planner.metrics import (
        FRONTEND_METRICS,
        HistogramValue,
        Snapshot,
        histogram_share,
        observation,
    )

    buckets = [(0.01, 90.0), (0.04, 100.0), (math.inf, 100.0)]
    assert histogram_share(0.025, buckets) == pytest.approx(0.95)  # halfway through 10-40 ms
    assert histogram_share(0.005, buckets) == pytest.approx(0.45)
    assert histogram_share(0.01, buckets) == pytest.approx(0.9)
    assert histogram_share(5.0, buckets) == 1.0
    assert histogram_share(5.0, [(0.01, 90.0), (math.inf, 100.0)]) == pytest.approx(0.9)
    assert math.isnan(histogram_share(0.01, [])) and math.isnan(histogram_share(0.01, [(1, 0)]))
    names = FRONTEND_METRICS

    def snap(at: float, fast: float, slow: float) -> Snapshot:
        # `fast` requests (TTFT and own mean ITL) under 10 ms, `slow` between 10 and 40 ms
        hist = [(0.01, fast), (0.04, fast + slow), (math.inf, fast + slow)]
        return Snapshot(at, {
            names.request_itl_seconds: HistogramValue(hist, 0.0, fast + slow),
            names.ttft_seconds: HistogramValue(hist, 0.0, fast + slow),
        })  # fmt: skip

    o = observation(snap(0.0, 10, 0), snap(10.0, 100, 10), names, 0.95, 0.9, (10.0, 25.0))
    # 100 new requests, 90 under 10 ms, 10 spread over 10-40 ms
    assert o.ttft_within == pytest.approx(0.9) and o.itl_within == pytest.approx(0.95)
    # no targets given (the default): not measured
    o = observation(snap(0.0, 10, 0), snap(10.0, 100, 10), names, 0.95, 0.9)
    assert math.isnan(o.ttft_within) and math.isnan(o.itl_within)


def test_pool_is_sized_for_the_share_of_requests_within_the_targets() -> None:
    model = WorkerModel(PREFILL, DECODE)
    cap = model.capacity(1000, 100, 200.0, 20.0 * 0.9)  # the mean, with the headroom
    rate = 0.9 * 4 * cap  # four workers, each at 90 % of what it was planned for
    expected = model.latency(rate / 4, 1000, 100)

    def run(
        shares: list[float], *, ready: int = 4, starting: int = 0, at_rate: float = rate,
        finished: int = 300, **kw: object,
    ) -> tuple[list[float], SlaPolicy]:  # fmt: skip
        planner = Planner(config(**kw), PlannerPolicy.SLA, [AGG], PROFILE)
        pools = {AGG: PoolState(AGG, target=ready + starting, ready=ready, starting=starting)}
        caps = []
        for i, share in enumerate([math.nan, *shares]):
            o = obs(at_rate, first_tokens=300, finished=finished, ttft_ms=expected.ttft_ms,
                    itl_ms=expected.itl_ms, itl_within=share, ttft_within=1.0)  # fmt: skip
            caps.append(planner.decide(10.0 * (i + 1), o, pools).capacity_rps[AGG])
        policy = planner.policy
        assert isinstance(policy, SlaPolicy)
        return caps[1:], policy

    assert PlannerConfig().slo_attainment == 0.97
    # a steady, loaded pool with 90 % of its requests within the targets: planned tighter at
    # every interval until it meets the goal; with every one within, looser, more slowly
    low, policy = run([0.9] * 2)
    assert cap > low[0] > low[1]
    assert policy.attain_factor == pytest.approx(math.exp(2 * ATTAIN_GAIN_UP * 0.07))
    high, policy = run([1.0] * 2)
    assert cap < high[0] < high[1]
    assert policy.attain_factor == pytest.approx(math.exp(-2 * ATTAIN_GAIN_DOWN * 0.03))
    assert high[1] / cap - 1 < 1 - low[1] / cap
    # bounded
    _, policy = run([0.0] * 10)
    assert policy.attain_factor == ATTAIN_LIMITS[1]
    _, policy = run([1.0] * 400)
    assert policy.attain_factor == ATTAIN_LIMITS[0]
    # a share that says nothing about the capacity moves nothing: a worker starting (the
    # pool is known to be short), the pool at its maximum, workers carrying little of what
    # they were planned for, too few requests, or no goal
    cases: list[dict[str, Any]] = [
        {"starting": 1}, {"max_workers": 4}, {"at_rate": 0.5 * rate},
        {"finished": ATTAIN_SAMPLES - 1}, {"slo_attainment": 0.0},
    ]  # fmt: skip
    for kw in cases:
        _, policy = run([0.5] * 3, **kw)
        assert policy.attain_factor == 1.0, kw
    # a pool that does not prefill (disaggregated decode) goes by the ITL share alone: the
    # TTFT misses are the prefill pool's
    pool = PoolState(AGG, target=4, ready=4)
    slow_first = obs(rate, finished=300, itl_within=0.97, ttft_within=0.9)
    _, policy = run([])
    policy._attain(slow_first, pool, AGG, prefills=False)
    assert policy.attain_factor == 1.0
    policy._attain(slow_first, pool, AGG, prefills=True)
    assert policy.attain_factor == pytest.approx(math.exp(ATTAIN_GAIN_UP * (0.97 - 0.873)))


def test_rate_trend_extrapolates_a_ramp_over_uneven_windows() -> None:
    from kvmesh.planner.predictors import RateTrend

    trend = RateTrend(span_s=20.0)
    assert math.isnan(trend.forecast(10.0)[0])  # nothing yet
    # rate 10 + 2 t, counted over a 10 s interval and then 2 s checks
    windows = [(10.0, 10.0), (12.0, 2.0), (14.0, 2.0), (16.0, 2.0), (18.0, 2.0)]
    for end, length in windows:
        mid = end - length / 2
        trend.add(end, length, round((10 + 2 * mid) * length))
    value, error = trend.forecast(30.0)
    assert value == pytest.approx(70.0, rel=0.02) and 0 < error < 10
    # the oldest window leaves once it is older than the span
    trend.add(32.0, 2.0, 140)
    assert trend.windows[0][0] >= 10.0
    flat = RateTrend(span_s=20.0)
    for k in range(1, 8):
        flat.add(2.0 * k, 2.0, 20)
    assert flat.forecast(30.0)[0] == pytest.approx(10.0)
    # falling past its noise: a ramp down is, a flat rate, a rising one, Poisson-sized wobbles
    # and fewer than three windows are not
    assert trend.falling(2.0) is False and flat.falling(2.0) is False
    down = RateTrend(span_s=20.0)
    for k in range(1, 8):
        down.add(2.0 * k, 2.0, round((100 - 3 * 2.0 * k) * 2.0))
    assert down.falling(2.0)
    wobbly = RateTrend(span_s=20.0)
    for k, count in enumerate([200, 180, 215, 190, 185, 205, 190], start=1):
        wobbly.add(2.0 * k, 2.0, count)  # 100 req/s, within 1.5 Poisson standard deviations
    assert not wobbly.falling(2.0)
    short = RateTrend(span_s=20.0)
    short.add(10.0, 10.0, 1000)
    short.add(20.0, 10.0, 10)
    assert not short.falling(2.0)


def test_a_correction_past_the_profile_shrinks_the_capacity_not_to_the_maximum() -> None:
    model = WorkerModel(PREFILL, DECODE)
    expected = model.latency(10.0, 1000, 100)
    raw = model.capacity(1000, 100, 200.0, 20.0)
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    pools = {AGG: PoolState(AGG, target=3, ready=3)}
    # an overloaded pool: its requests' ITL 5x what the model says, interval after interval;
    # the corrected ITL target falls under the decode step alone (unreachable per the profile)
    o = obs(30.0, first_tokens=300, finished=300, ttft_tail_ms=expected.ttft_ms,
            itl_ms=expected.itl_ms, itl_tail_ms=5 * expected.itl_ms)  # fmt: skip
    decision = [planner.decide(10.0 * (i + 1), o, pools) for i in range(30)][-1]
    policy = planner.policy
    assert isinstance(policy, SlaPolicy) and policy.itl_tail_factor is not None
    assert model.capacity(1000, 100, 200.0, 20.0 / policy.itl_tail_factor) == 0.0
    cap = decision.capacity_rps[AGG]
    assert cap == pytest.approx(raw / policy.itl_tail_factor, rel=1e-6)
    assert decision.targets[AGG] == math.ceil(30.0 / cap) < 20  # not the maximum
    # targets the profile itself cannot reach: the maximum
    strict = Planner(config(itl_slo_ms=1.0), PlannerPolicy.SLA, [AGG], PROFILE)
    assert strict.decide(10.0, obs(30.0), pools).targets[AGG] == 20


def test_kalman_damps_a_trend_that_weakens_near_a_peak() -> None:
    # A day's rise (sin^2, peak at t = 16) observed up to t = 13: the filter's slope still
    # holds most of the rise that has already slowed. The series fell short of the trend, so
    # the damped prediction 2.5 intervals ahead is lower and nearer the truth.
    def day(t: float) -> float:
        return 10 + 90 * math.sin(math.pi * t / 32) ** 2

    straight, damped = KalmanPredictor(damped=False), KalmanPredictor()
    for t in range(14):
        straight.observe(day(t))
        damped.observe(day(t))
    truth = day(13 + 2.5)
    assert straight.predict(2.5) - truth > 8.0  # the straight trend overshoots the peak
    assert damped.damping() < 0.9
    assert abs(damped.predict(2.5) - truth) < 0.7 * abs(straight.predict(2.5) - truth)
    assert damped.predict(1) <= straight.predict(1)
    # a ramp the series keeps up with is extrapolated straight (noise around it aside)
    ramp_straight, ramp = KalmanPredictor(damped=False), KalmanPredictor()
    for t in range(30):
        value = 10 + 3 * t + (0.5 if t % 2 else -0.5)
        ramp_straight.observe(value)
        ramp.observe(value)
    assert ramp.damping() > 0.999
    assert ramp.predict(2.5) == pytest.approx(ramp_straight.predict(2.5), rel=1e-3)
    # a trend that turned adds nothing: the level
    turned = KalmanPredictor()
    for value in (10.0, 20.0, 30.0, 40.0, 50.0, 50.0, 45.0):
        turned.observe(value)
    assert turned.predict(3) <= turned.level + 1e-9


def test_sizing_looks_ahead_to_the_next_chance_to_ask() -> None:
    # A worker asked for now serves after its start-up (10 s) and is the last word only until
    # one asked for at the planner's next chance serves: the next surge check (2 s) when they
    # run, else the next interval (10 s). On a steady ramp the planned rate is the trend at
    # 0.5 + (10 + 2) / 10 = 1.7 intervals ahead, not 2.5.
    def planned(surge_check_s: float) -> float:
        cfg = config(predictor=PredictorKind.KALMAN, worker_startup_s=10.0,
                     surge_check_s=surge_check_s)  # fmt: skip
        planner = Planner(cfg, PlannerPolicy.SLA, [AGG], PROFILE)
        d = None
        for i in range(30):
            d = planner.decide(10.0 * (i + 1), obs(10.0 + 2.0 * i), {AGG: PoolState(AGG, 9, 9)})
        assert d is not None
        return d.predicted_rps

    last = 10.0 + 2.0 * 29
    assert planned(0.0) == pytest.approx(last + 2.5 * 2.0, abs=0.3)
    assert planned(2.0) == pytest.approx(last + 1.7 * 2.0, abs=0.3)


def test_queued_work_is_counted_at_the_itl_the_pool_shows() -> None:
    # The pool decodes at 2x the profile's mean ITL (as observed, over many intervals); the
    # requests in flight are what its workers hold at that ITL: nothing is queued beyond the
    # pool, so it is sized on the rate alone (at the lower capacity the correction gives).
    model = WorkerModel(PREFILL, DECODE)
    planner = Planner(config(), PlannerPolicy.SLA, [AGG], PROFILE)
    pool = PoolState(AGG, target=4, ready=4)
    expected = model.latency(30.0 / 4, 1000, 100)
    d = None
    for i in range(30):
        o = obs(30.0, first_tokens=300, ttft_tail_ms=expected.ttft_ms, itl_ms=2 * expected.itl_ms)
        d = planner.decide(10.0 * (i + 1), o, {AGG: pool})
    assert d is not None
    cap = d.capacity_rps[AGG]
    lat = model.latency(cap, 1000, 100)
    holds = cap * (lat.ttft_ms + 99 * 2 * lat.itl_ms) / 1e3  # per worker, at the observed ITL
    o = obs(30.0, first_tokens=300, ttft_tail_ms=expected.ttft_ms, itl_ms=2 * expected.itl_ms,
            inflight=math.floor(4 * holds * 0.98))  # fmt: skip
    d = planner.decide(310.0, o, {AGG: pool})
    assert "backlog 0," in d.reasons[AGG]
    assert d.targets[AGG] <= max(4, math.ceil(30.0 / cap - 1e-9))


def _grow_on_latency(latency: Callable[[int], float], steps: int = 14) -> list[Decision]:
    """A pool at 20 req/s that the planner sizes each interval (its workers ready by the next),
    with the surge checks between; `latency(ready)`: the mean ITL and the requests' own mean
    ITL at the quantile the pool shows with that many workers."""
    planner = Planner(config(max_workers=20), PlannerPolicy.SLA, [AGG], PROFILE)
    ready = 2
    decisions = []
    for i in range(steps):
        itl = latency(ready)
        o = obs(20.0, first_tokens=200, finished=200, ttft_tail_ms=40.0, itl_ms=itl,
                itl_tail_ms=itl)  # fmt: skip
        pool = PoolState(AGG, ready, ready)
        d = planner.decide(10.0 * (i + 1), o, {AGG: pool})
        decisions.append(d)
        target = d.targets[AGG]
        surge = planner.surge(
            10.0 * (i + 1) + 2.0,
            obs(20.0, interval=2.0, itl_ms=itl),
            {AGG: PoolState(AGG, target, ready, starting=target - ready)},
        )
        ready = surge.targets.get(AGG, target)  # fmt: skip
    return decisions


def test_growth_that_does_not_lower_latency_stops() -> None:
    # The pool's ITL is 30 ms (1.5x the target) whatever its size (a router that keeps the new
    # workers idle, say): each worker added lowers the model's ITL, not the observed one, so
    # the correction would climb with the pool and grow it to its maximum. The guard sees a
    # growth that did not lower the latency (once the grown pool served a whole interval) and
    # holds the corrections at what they were before it: the pool comes back to the size it
    # grew from and stays there (without the guard: at its maximum, 20).
    stuck = _grow_on_latency(lambda ready: 30.0)
    sizes = [d.targets[AGG] for d in stuck]
    assert max(sizes) == 20, sizes  # the correction ran past the profile in one step
    assert sizes[-6:] == [3] * 6, sizes
    assert "growth did not lower latency: itl held since 3 ready" in stuck[-1].reasons[AGG]
    # A pool whose latency falls as it grows, as the model says (1.6x the model at the load
    # each worker has): the guard never holds it, and it grows to what the load needs.
    model = WorkerModel(PREFILL, DECODE)
    scaled = _grow_on_latency(lambda ready: 1.6 * model.latency(20.0 / ready, 1000, 100).itl_ms)
    assert not any("growth did not lower latency" in d.reasons[AGG] for d in scaled)
    need = math.ceil(20.0 / scaled[-1].capacity_rps[AGG] - 1e-9)
    assert scaled[-1].targets[AGG] >= need


def test_surge_adds_no_worker_for_a_latency_growth_did_not_lower() -> None:
    planner = Planner(config(max_workers=20), PlannerPolicy.SLA, [AGG], PROFILE)
    slow = {"first_tokens": 200.0, "finished": 200.0, "ttft_tail_ms": 40.0, "itl_ms": 30.0,
            "itl_tail_ms": 30.0}  # fmt: skip
    for i, ready in enumerate((2, 2, 6, 6)):  # grew from 2 to 6: the ITL stayed at 30 ms
        planner.decide(10.0 * (i + 1), obs(20.0, **slow), {AGG: PoolState(AGG, ready, ready)})
    six = PoolState(AGG, 6, 6)
    assert planner.surge(42.0, obs(20.0, interval=2.0, itl_ms=30.0), {AGG: six}).targets == {}
    fresh = Planner(config(max_workers=20), PlannerPolicy.SLA, [AGG], PROFILE)
    fresh.decide(10.0, obs(20.0, **slow), {AGG: six})
    assert fresh.surge(12.0, obs(20.0, interval=2.0, itl_ms=30.0), {AGG: six}).targets[AGG] == 7
