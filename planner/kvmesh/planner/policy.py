"""The planner's decisions, as pure functions of what it observed: `Planner.decide(now,
observation, pools)` returns the size each pool should have. The live planner (kvmesh.planner.
main, fed by the gateways' metrics) and the simulator (kvmesh.sim.planned, fed by the replay's
own timeline) call the same code.

Two policies compute the size each pool wants:

  * `SlaPolicy`: predicts the next intervals' request rate (`--predictor`, plus
    `--prediction-margin` times the running RMS of how far its past one-interval predictions
    fell short, so the margin grows while the load rises faster than predicted) and the mean prompt
    and output lengths (averaged over the last intervals: they wander without a trend) and the
    share of prompt tokens found in a prefix cache (the lowest of the last intervals) up to when
    a worker asked for now stops being the last word (its start-up, plus the time to the
    planner's next chance to ask: one surge check period, or one interval without them; the
    Kalman trend damped where the series falls short of it, as near a peak), reads from the
    performance profile how many requests/s one worker serves within the targets
    (kvmesh.planner.model; cached prompt tokens cost no prefill), corrects that by what the pool
    showed, per request as the SLO counts (observed TTFT at `--ttft-quantile` / the model's TTFT
    at the observed load; the requests' own mean ITL at `--itl-quantile` / the model's mean ITL,
    where the gateways export that per-request histogram, else observed mean ITL / the model's
    with `--itl-headroom`; smoothed; held by the no-gain guard where a growth did not lower the
    latency, see `SlaPolicy._guard`; and by the share of requests a steady, loaded pool kept
    within both targets against `--slo-attainment`, see `SlaPolicy._attain`), and adds the
    queued work: requests in flight beyond what
    the ready and starting workers hold at that capacity (and at the ITL the pool shows), to be
    served within one interval. Workers already starting count as capacity (never asked for
    twice). Aggregated pools and disaggregated prefill/decode pools (prefill sized on TTFT,
    decode on ITL).
  * `QueuePolicy`: the reactive baseline, as KEDA/HPA scale on queue length: replicas *
    (in-flight requests per ready worker / `--queue-target`), unchanged within 10 %.

Between intervals (`--surge-check-s`, sla only), `Planner.surge(now, observation, pools)` looks
at the seconds since the last check and grows a pool at once when the load outgrew it or will
before a worker asked for now could serve, instead of up to one interval later. Foresight:
every window seen (the intervals, less what the checks saw of them, and the checks' windows)
over the last start-up + one interval feeds `RateTrend`, a least-squares line of the arrival
rate; the check takes the rate that line reaches at now + start-up + one check period, less
`FORESIGHT_Z` standard errors, or the window's own arrivals less `SURGE_Z` Poisson standard
deviations (a short window is noisy) if higher. When that rate plus the requests in flight
beyond what the pool holds exceed what its ready and starting workers serve (at the capacity
the last interval sized them with), the pool grows to the workers that load needs; when the
window's mean ITL is over what the pool is sized for (the mean the last interval planned, as
observed) or its TTFT tail over the target, by one worker (not for a latency the no-gain
guard saw growth fail to lower). Starting workers count (a pool whose new workers are on the
way is not asked for them again); a surge never shrinks a pool, and what it asked for enters
the stabilization window below, so the next intervals do not take it back before the window
has passed (the hysteresis both ways).

`Planner` then applies what both share: the per-pool minimum and maximum, the scale-down
stabilization window (a pool shrinks only to the largest size wanted over the last
`--scale-down-delay-s`, and only once that window of history exists; it grows at once), and the
total budget. With no traffic at all a pool goes to its minimum, which may be 0; a request
waiting while a pool is at 0 brings it back to at least 1.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.model import WorkerModel
from kvmesh.planner.predictors import (
    MovingAveragePredictor,
    Predictor,
    RateTrend,
    make_predictor,
)
from kvmesh.planner.profile import PerfProfile
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import Role

__all__ = [
    "Decision",
    "Observation",
    "Planner",
    "PoolState",
    "QueuePolicy",
    "SlaPolicy",
]

FACTOR_LIMITS = (0.2, 20.0)
"""Bounds of the observed/expected corrections (a wild measurement cannot run away)."""
FACTOR_SMOOTHING = 0.3
"""Weight of the newest observed/expected ratio in the smoothed correction."""
MIN_SAMPLES = 5
"""Fewest first tokens in an interval for its latencies to move the corrections."""
QUEUE_TOLERANCE = 0.1
LENGTH_WINDOW = 6
"""Intervals the mean prompt and output lengths are averaged over."""
"""The reactive policy leaves a pool alone while metric/target is within 1 +- this (HPA)."""
ERROR_SMOOTHING = 0.2
"""Weight of the newest squared rate-prediction error in its running mean."""
SURGE_Z = 1.0
"""A surge check grows a pool on arrivals or requests in flight only past this many Poisson
standard deviations over what the pool serves (the hysteresis against a short window's noise)."""
FORESIGHT_Z = 0.5
"""A surge check grows a pool for the rate the recent trend reaches less this many of the
forecast's standard errors. Half of one, not one: a pool grown a check early costs a few
worker-seconds, one grown late is overloaded past the knee of its latency until the worker
starts, and the corrections learn that overload as a slower engine (over 43 replayed days,
1 -> 0.5: SLO met +0.24 points, worker-hours -0.4 % on average; README, SLA planner)."""
ATTAIN_GAIN_UP = 2.0
"""How fast the attainment correction tightens: x exp(this x (goal - share within the
targets)) per interval under the goal."""
ATTAIN_GAIN_DOWN = 0.5
"""How fast it loosens over the goal: slower (a pool planned past the knee of its latency
loses far more requests than one planned short of it costs in workers)."""
ATTAIN_LIMITS = (0.7, 1.5)
"""Bounds of the attainment correction."""
ATTAIN_SAMPLES = 20
"""Fewest finished requests in an interval for its share within the targets to count."""
ATTAIN_LOAD = 0.75
"""An interval's share within the targets moves the attainment correction only when each ready
worker carried at least this share of the capacity it was planned for (a pool the rounding left
half idle meets the targets at any capacity: its share says nothing about the capacity)."""
FALLING_Z = 2.0
"""The stabilization window shrinks to one interval while the arrival rate's trend
(`RateTrend`, over the last start-up + one interval) falls by more than this many standard
errors of its slope (26 replayed days: worker-hours -1.8 % at -0.03 points of SLO met on
average; z = 1 moved nothing further and spent 11 % more on one Mooncake day; README)."""
GAIN_WINDOW = 4
"""Intervals the no-gain guard looks back over for the smaller pool a growth started from."""
GAIN_EXPECTED = 0.1
"""The no-gain guard judges a growth only when the model says it lowers the latency by at least
this share (a growth that merely follows the load proves nothing)."""
GAIN_SHARE = 0.5
"""A growth lowered the latency when the observed latency fell by at least this share of what
the model expected it to fall by."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the gateways measured over one adjustment interval (NaN: nothing to measure)."""

    interval_s: float
    requests: int
    """Requests that arrived."""
    finished: int = 0
    """Requests that finished."""
    isl_mean: float = math.nan
    """Prompt tokens per arrived request."""
    osl_mean: float = math.nan
    """Output tokens per request that finished."""
    cached_mean: float = math.nan
    """Prompt tokens per request that finished found in a prefix cache (NaN: not measured)."""
    first_tokens: int = 0
    """Requests whose first token came in the interval."""
    ttft_ms: float = math.nan
    """Their mean TTFT."""
    ttft_tail_ms: float = math.nan
    """Their TTFT at the planner's `ttft_quantile`."""
    itl_ms: float = math.nan
    """Mean gap between consecutive tokens emitted in the interval."""
    itl_tail_ms: float = math.nan
    """The requests that finished, each's own mean ITL ((last token - first token) / (tokens -
    1)), at the planner's `itl_quantile` (NaN: not measured)."""
    ttft_within: float = math.nan
    """The share of those first tokens with TTFT <= the TTFT target (NaN: not measured)."""
    itl_within: float = math.nan
    """The share of the requests that finished whose own mean ITL is <= the ITL target (NaN:
    not measured)."""
    inflight: int = 0
    """Requests in flight at the end (arrived, not finished)."""

    @property
    def rate_rps(self) -> float:
        """Arrivals per second."""
        return self.requests / self.interval_s if self.interval_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PoolState:
    """A pool as its connector reports it."""

    role: Role
    target: int
    ready: int
    """Workers serving (registered, not draining)."""
    starting: int = 0
    draining: int = 0


@dataclass(slots=True)
class Decision:
    """What the planner wants, and why."""

    targets: dict[Role, int]
    reasons: dict[Role, str] = field(default_factory=dict)
    predicted_rps: float = 0.0
    capacity_rps: dict[Role, float] = field(default_factory=dict)
    """Requests/s one worker of each pool serves within the targets (sla)."""

    def changes(self, pools: Mapping[Role, PoolState]) -> dict[Role, int]:
        """The targets that differ from the pools' current ones."""
        return {r: n for r, n in self.targets.items() if r in pools and pools[r].target != n}


class Policy(Protocol):
    """Computes the size each pool wants now (before limits and stabilization)."""

    def desired(
        self, now: float, obs: Observation, pools: Mapping[Role, PoolState], decision: Decision
    ) -> dict[Role, int]: ...

    def surge(
        self, now: float, obs: Observation, pools: Mapping[Role, PoolState], decision: Decision
    ) -> dict[Role, int]:
        """Between intervals: the size of each pool the load outgrew or is about to outgrow
        before a worker asked for now could serve (others left out)."""
        ...


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the last interval sized a pool with (the surge checks compare against it)."""

    capacity_rps: float
    """Requests/s one worker serves within the targets."""
    hold: float
    """Requests one worker holds in flight at that rate."""
    itl_ms: float
    """The mean ITL (per gap, as observed) the pool was sized to run at, at most."""


@dataclass(frozen=True, slots=True)
class _Seen:
    """One interval's latency of a pool against the model (the no-gain guard's history)."""

    ready: int
    expected_ms: float
    """The model's latency at the load each worker had."""
    observed_ms: float
    factors: tuple[float, ...]
    """The corrections of this kind of latency as they stood after the interval."""


def _no_gain(
    history: Sequence[_Seen], ready: int, expected: float, observed: float
) -> _Seen | None:
    """The first interval of `history` with a smaller pool than `ready` whose latency the
    growth since should have lowered, per the model, by `GAIN_EXPECTED` at least, but did not
    (the observed latency fell by less than `GAIN_SHARE` of that); None if the growth helped."""
    for past in history:
        if past.ready >= ready or not (past.expected_ms > 0 and past.observed_ms > 0):
            continue
        fell_expected = 1 - expected / past.expected_ms
        if fell_expected < GAIN_EXPECTED:
            continue
        if 1 - observed / past.observed_ms < GAIN_SHARE * fell_expected:
            return past
    return None


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(max(value, lo), hi)


class SlaPolicy:
    """Replicas from the profile and the predicted load (see the module doc)."""

    def __init__(self, config: PlannerConfig, profile: PerfProfile, roles: Sequence[Role]) -> None:
        self.config = config
        if Role.AGGREGATED in roles and (Role.PREFILL in roles or Role.DECODE in roles):
            raise InvalidRequest("the planner sizes aggregated or prefill/decode pools, not both")
        if (Role.PREFILL in roles) != (Role.DECODE in roles):
            raise InvalidRequest("disaggregated planning needs both a prefill and a decode pool")
        self.models: dict[Role, WorkerModel] = {}
        for role in roles:
            prefill = profile.prefill_curve(role) if role is not Role.DECODE else None
            decode = profile.decode_grid(role) if role is not Role.PREFILL else None
            self.models[role] = WorkerModel(prefill, decode)
        interval = config.adjustment_interval_s
        self.rate: Predictor = make_predictor(config.predictor, interval)
        # Mean prompt and output lengths wander without a trend: extrapolating their noise
        # would swing the capacity, so they are averaged over the last intervals.
        self.isl: Predictor = MovingAveragePredictor(LENGTH_WINDOW)
        self.osl: Predictor = MovingAveragePredictor(LENGTH_WINDOW)
        self.cache_tokens: deque[tuple[int, float, float]] = deque(maxlen=LENGTH_WINDOW)
        """Per interval, the requests that finished, their prompt tokens found in a prefix cache
        and their prompt tokens (the interval's mean prompt for each) (`cached_share`)."""
        self.seen_isl = False
        self.seen_osl = False
        self.trend = RateTrend(config.worker_startup_s + interval)
        """The arrival rate's recent trend over every window observed (intervals and surge
        checks), looking back as far as a decision must look ahead."""
        self._since_tick = (0, 0.0)
        """Arrivals and seconds the surge checks saw since the last interval."""
        self.rate_error = 0.0
        """Exponentially weighted mean square of how far the one-interval rate predictions
        fell short (over-predictions count as 0)."""
        self._predicted_next: float | None = None
        again = config.surge_check_s if config.surge_check_s > 0 else interval
        self.horizon = 0.5 + (config.worker_startup_s + again) / interval
        """Intervals from the middle of the one just observed to when a worker asked for now
        stops being the last word: after its start-up, until one the planner asks for at its
        next chance (the next surge check, or the next interval without them) serves: the rate
        to size for."""
        self.ttft_factor = 1.0
        self.itl_factor = 1.0
        """Observed / modelled mean ITL."""
        self.tail_samples = max(MIN_SAMPLES, math.ceil(1 / (1 - config.itl_quantile) - 1e-9))
        """Fewest finished requests in an interval for their ITL quantile to move the correction
        (at least one of them above the quantile)."""
        self.itl_tail_factor: float | None = None
        """The requests' own mean ITL at `itl_quantile` / the modelled mean ITL (None until the
        gateways showed one: the pool is then sized on the mean with `itl_headroom`)."""
        self.attain_factor = 1.0
        """How much lower than the corrected model says the pool plans its ITL so that the share
        of requests within both targets meets `slo_attainment` (learned from that share)."""
        self.plans: dict[Role, _Plan] = {}
        """Per pool, what the last interval sized it with."""
        self.seen: dict[tuple[Role, str], deque[_Seen]] = {}
        """Per pool and kind of latency ("ttft", "itl"), the last `GAIN_WINDOW` intervals."""
        self.stalled: dict[tuple[Role, str], _Seen] = {}
        """Per pool and kind of latency, the interval a growth that did not lower that latency
        started from (the no-gain guard; see `_guard`)."""
        self.last_ready: dict[Role, int] = {}
        """Per pool, the ready workers the last interval's decision saw."""

    def _observe(self, now: float, obs: Observation) -> None:
        count, seconds = self._since_tick
        self._since_tick = (0, 0.0)
        # the part of the interval no surge check saw
        self.trend.add(now, obs.interval_s - seconds, obs.requests - count)
        if self._predicted_next is not None:
            under = max(0.0, obs.rate_rps - self._predicted_next)  # only too low hurts
            a = ERROR_SMOOTHING
            self.rate_error = (1 - a) * self.rate_error + a * under * under
        self.rate.observe(obs.rate_rps)
        if obs.requests and math.isfinite(obs.isl_mean):
            self.isl.observe(obs.isl_mean)
            self.seen_isl = True
        if math.isfinite(obs.osl_mean):
            self.osl.observe(obs.osl_mean)
            self.seen_osl = True
        if obs.finished and math.isfinite(obs.cached_mean) and math.isfinite(obs.isl_mean):
            prompt = obs.finished * obs.isl_mean
            cached = min(obs.finished * obs.cached_mean, prompt)
            self.cache_tokens.append((obs.finished, cached, prompt))

    def cached_share(self) -> float:
        """The share of prompt tokens found in a prefix cache to plan with: the lowest any of
        the last intervals with `MIN_SAMPLES` finished requests showed (the share depends on the
        pool: a drained worker takes its cache with it, so a share that just rose is planned on
        only once it held over the window); with none, over all of them, weighted by prompt
        tokens."""
        shares = [c / p for n, c, p in self.cache_tokens if n >= MIN_SAMPLES and p > 0]
        if shares:
            return min(shares)
        prompt = math.fsum(p for _, _, p in self.cache_tokens)
        return math.fsum(c for _, c, _ in self.cache_tokens) / prompt if prompt > 0 else 0.0

    def _correct(
        self, obs: Observation, pools: Mapping[Role, PoolState], osl: float, hit: float
    ) -> None:
        """Move the corrections toward observed / expected at the observed load."""
        if obs.first_tokens < MIN_SAMPLES or not math.isfinite(obs.isl_mean):
            return
        osl = obs.osl_mean if math.isfinite(obs.osl_mean) else osl
        cached = hit * obs.isl_mean
        lo, hi = FACTOR_LIMITS
        a = FACTOR_SMOOTHING
        for role, model in self.models.items():
            ready = pools[role].ready if role in pools else 0
            if ready < 1:
                continue
            expected = model.latency(obs.rate_rps / ready, obs.isl_mean, osl, cached)
            if model.prefill is not None and math.isfinite(obs.ttft_tail_ms):
                if 0 < expected.ttft_ms < math.inf:
                    f = _clamp(obs.ttft_tail_ms / expected.ttft_ms, lo, hi)
                    self.ttft_factor = (1 - a) * self.ttft_factor + a * f
                    (self.ttft_factor,) = self._guard(
                        role, "ttft", ready, expected.ttft_ms, obs.ttft_tail_ms,
                        self.config.ttft_slo_ms, (self.ttft_factor,),
                    )  # fmt: skip
            if model.decode is None or not 0 < expected.itl_ms < math.inf:
                continue
            if math.isfinite(obs.itl_ms):
                f = _clamp(obs.itl_ms / expected.itl_ms, lo, hi)
                self.itl_factor = (1 - a) * self.itl_factor + a * f
            tail = math.isfinite(obs.itl_tail_ms) and obs.finished >= self.tail_samples
            if tail:
                f = _clamp(obs.itl_tail_ms / expected.itl_ms, lo, hi)
                # from what the headroom assumed, so one interval does not set it alone
                prev = self.itl_tail_factor or 1 / self.config.itl_headroom
                self.itl_tail_factor = (1 - a) * prev + a * f
            self._attain(obs, pools[role], role, model.prefill is not None)
            observed = obs.itl_tail_ms if tail else obs.itl_ms
            if math.isfinite(observed):
                headroom = 1 / self.config.itl_headroom
                target = self.config.itl_slo_ms * (1 if tail else self.config.itl_headroom)
                self.itl_factor, tail_factor = self._guard(
                    role, "itl", ready, expected.itl_ms, observed, target,
                    (self.itl_factor, self.itl_tail_factor or headroom),
                )  # fmt: skip
                if self.itl_tail_factor is not None:
                    self.itl_tail_factor = tail_factor

    def _attain(self, obs: Observation, state: PoolState, role: Role, prefills: bool) -> None:
        """Move the attainment correction by the share of the interval's requests within both
        targets (the share within the ITL target x, where the pool also `prefills`, the share of
        first tokens within the TTFT target: a decode pool is not sized for prefill's misses)
        against `slo_attainment`: up by `ATTAIN_GAIN_UP` x the shortfall, down by
        `ATTAIN_GAIN_DOWN` x the excess (in the exponent), within `ATTAIN_LIMITS`. Only where
        that share tells something about the capacity planned: a steady pool (the ready workers
        the last decision saw, none starting: a pool waiting for workers is known to be short),
        below its maximum (more workers could not be had), each worker carrying `ATTAIN_LOAD`
        of the capacity it was planned for at least (a pool the rounding left half idle meets
        the targets at any capacity), `ATTAIN_SAMPLES` finished requests at least."""
        goal = self.config.slo_attainment
        plan = self.plans.get(role)
        if not goal or plan is None or obs.finished < ATTAIN_SAMPLES:
            return
        if not math.isfinite(obs.itl_within):
            return
        ready = state.ready
        if self.last_ready.get(role) != ready or state.starting or ready >= self.config.max_workers:
            return
        if obs.rate_rps < ATTAIN_LOAD * plan.capacity_rps * ready:
            return
        ttft = obs.ttft_within if prefills and math.isfinite(obs.ttft_within) else 1.0
        share = obs.itl_within * ttft
        gain = ATTAIN_GAIN_UP if share < goal else ATTAIN_GAIN_DOWN
        lo, hi = ATTAIN_LIMITS
        self.attain_factor = _clamp(self.attain_factor * math.exp(gain * (goal - share)), lo, hi)

    def _guard(
        self,
        role: Role,
        kind: str,
        ready: int,
        expected: float,
        observed: float,
        target: float,
        factors: tuple[float, ...],
    ) -> tuple[float, ...]:
        """The no-gain guard: growth that does not lower the latency stops.

        A correction reads slow latency as load: observed over modelled at the load each worker
        had. When the latency does not come from load (a router that keeps the new workers idle
        because the old ones hold the prompts' prefixes, a slow shared dependency), a larger pool
        lowers the modelled latency and not the observed one, so the correction rises with every
        worker added and the pool grows on, to its maximum. Here: when the pool, over the
        `target` (the latency of this `kind` the SLO allows) with every worker it has now ready
        through the whole interval (the last decision saw as many: a worker that just joined
        has not had the time to take load, and a backlog built up before it is still draining),
        is larger than in one of the last `GAIN_WINDOW` intervals and its latency did not fall
        as the model said it would (`_no_gain`), the corrections of that kind are held at most
        at what they were then (so the pool is sized as it was, and shrinks back to that size
        unless the load asks for more); and the surge checks do not add workers for that
        latency meanwhile (`stalled`). Until the latency is under the target, or a pool larger
        than the one the growth started from, steady, shows the latency lower as the model says
        it should be (a growth did help: the latency is load again). Returns the corrections to
        use.
        """
        key = (role, kind)
        history = self.seen.setdefault(key, deque(maxlen=GAIN_WINDOW))
        stall = self.stalled.get(key)
        steady = self.last_ready.get(role) == ready
        if stall is not None and (
            observed <= target
            or (steady and ready > stall.ready and not _no_gain([stall], ready, expected, observed))
        ):
            stall = None
            del self.stalled[key]
        if stall is None and steady and observed > target:
            stall = _no_gain(history, ready, expected, observed)
            if stall is not None:
                self.stalled[key] = stall
        if stall is not None:
            factors = tuple(min(f, c) for f, c in zip(factors, stall.factors, strict=True))
        history.append(_Seen(ready, expected, observed, factors))
        return factors

    def desired(
        self, now: float, obs: Observation, pools: Mapping[Role, PoolState], decision: Decision
    ) -> dict[Role, int]:
        cfg = self.config
        self._observe(now, obs)
        isl = self.isl.predict() if self.seen_isl else 0.0
        osl = max(1.0, self.osl.predict()) if self.seen_osl else 1.0
        hit = self.cached_share()
        cached = hit * isl
        self._predicted_next = self.rate.predict(1)
        # The load a worker asked for now will serve, plus the prediction's typical error.
        rate = max(self._predicted_next, self.rate.predict(self.horizon))
        rate += cfg.prediction_margin * math.sqrt(self.rate_error)
        decision.predicted_rps = rate
        self._correct(obs, pools, osl, hit)
        self.last_ready = {role: state.ready for role, state in pools.items()}
        ttft_target = cfg.ttft_slo_ms / self.ttft_factor
        # The ITL the model may plan (its mean): the target over what the requests' own mean
        # ITL at the quantile showed against the model; without it, a headroom under the target
        # over what the mean showed.
        if self.itl_tail_factor is not None:
            itl_target = cfg.itl_slo_ms / self.itl_tail_factor
        else:
            itl_target = cfg.itl_slo_ms * cfg.itl_headroom / self.itl_factor
        itl_target /= self.attain_factor
        out: dict[Role, int] = {}
        for role, model in self.models.items():
            cap = model.capacity(isl, osl, ttft_target, itl_target, cached)
            if cap <= 0:
                # Corrected past what one worker reaches per the profile (a pool that was
                # overloaded shows latencies the model cannot reproduce at any load): the
                # capacity at the targets themselves, shrunk by the correction, not the maximum.
                slowest = max(self.ttft_factor, cfg.itl_slo_ms / itl_target)
                raw = model.capacity(isl, osl, cfg.ttft_slo_ms, cfg.itl_slo_ms, cached)
                cap = raw / slowest
            decision.capacity_rps[role] = cap
            state = pools.get(role)
            if obs.requests == 0 and obs.inflight == 0:
                out[role] = 0  # no traffic at all: the minimum
                decision.reasons[role] = "sla: no traffic"
                continue
            if cap <= 0:
                out[role] = cfg.max_workers
                decision.reasons[role] = "sla: targets unreachable per the profile: pool at maximum"
                continue
            # Queued work: requests in flight beyond what ready + starting workers hold at
            # this capacity, to be served within one interval.
            lat = model.latency(cap, isl, osl, cached)
            # at the ITL the pool shows (the model's, corrected as the mean was observed)
            hold = cap * (lat.ttft_ms + max(osl - 1, 0) * lat.itl_ms * self.itl_factor) / 1e3
            self.plans[role] = _Plan(cap, hold, itl_target * self.itl_factor)
            backlog = 0.0
            if state is not None:
                backlog = max(0.0, obs.inflight - (state.ready + state.starting) * hold)
            demand = rate + backlog / cfg.adjustment_interval_s
            # at least one worker while anything waits (a pool at 0 with a request queued)
            out[role] = max(1, math.ceil(demand / cap - 1e-9))
            decision.reasons[role] = (
                f"sla: {rate:.2f} req/s predicted (isl {isl:.0f}, {100 * hit:.0f} % cached, "
                f"osl {osl:.0f}), "
                f"backlog {backlog:.0f}, {cap:.2f} req/s per worker "
                f"(corrections ttft x{self.ttft_factor:.2f}, itl x{self.itl_factor:.2f}, "
                f"per-request itl x{self.itl_tail_factor or math.nan:.2f}, "
                f"attainment x{self.attain_factor:.2f})"
            )
            held = [
                f"{kind} held since {seen.ready} ready"
                for (r, kind), seen in self.stalled.items()
                if r is role
            ]
            if held:
                decision.reasons[role] += f"; growth did not lower latency: {', '.join(held)}"
        return out

    def surge(
        self, now: float, obs: Observation, pools: Mapping[Role, PoolState], decision: Decision
    ) -> dict[Role, int]:
        cfg = self.config
        out: dict[Role, int] = {}
        if obs.interval_s > 0:
            self.trend.add(now, obs.interval_s, obs.requests)
            count, seconds = self._since_tick
            self._since_tick = (count + obs.requests, seconds + obs.interval_s)
        # Foresight: the rate the recent trend reaches when a worker asked for now has started
        # and the next check could ask again, less part of its noise.
        value, error = self.trend.forecast(now + cfg.worker_startup_s + cfg.surge_check_s)
        foreseen = value - FORESIGHT_Z * error if math.isfinite(value) else 0.0
        for role, model in self.models.items():
            state = pools.get(role)
            plan = self.plans.get(role)
            if state is None or plan is None or obs.interval_s <= 0:
                continue
            have = state.ready + state.starting
            need = 1 if obs.inflight and have == 0 else 0
            why = "a request waits on an empty pool"
            # Latency over what the pool is sized for: the ready workers are overloaded now;
            # one more (a pool with workers starting already has it).
            # (not for a latency that growth was seen not to lower: the no-gain guard)
            slow_itl = (
                model.decode is not None
                and obs.itl_ms > plan.itl_ms
                and (role, "itl") not in self.stalled
            )
            slow_ttft = (
                model.prefill is not None
                and obs.first_tokens >= MIN_SAMPLES
                and obs.ttft_tail_ms > cfg.ttft_slo_ms
                and (role, "ttft") not in self.stalled
            )
            if (slow_itl or slow_ttft) and state.ready + 1 > need:
                need, why = (
                    state.ready + 1,
                    (
                        f"ITL {obs.itl_ms:.1f} ms, TTFT tail {obs.ttft_tail_ms:.0f} ms on "
                        f"{state.ready} ready, over the targets"
                    ),
                )
            # Arrivals and requests in flight beyond what the pool serves, past their noise.
            n = obs.requests
            evident_rps = max(0.0, n - SURGE_Z * math.sqrt(n)) / obs.interval_s
            held = have * plan.hold
            queued = max(0.0, obs.inflight - held - SURGE_Z * math.sqrt(held))
            demand = max(evident_rps, foreseen) + queued / cfg.adjustment_interval_s
            if plan.capacity_rps > 0:
                load_need = math.ceil(demand / plan.capacity_rps - 1e-9)
                if load_need > need:
                    need, why = (
                        load_need,
                        (
                            f"{evident_rps:.2f} req/s arriving, {foreseen:.2f} req/s on the "
                            f"trend in {cfg.worker_startup_s:g} s, {queued:.0f} queued beyond "
                            f"the pool, {plan.capacity_rps:.2f} req/s per worker"
                        ),
                    )
            if need > have:
                out[role] = need
                decision.reasons[role] = f"sla surge: {why}"
        return out


class QueuePolicy:
    """Reactive queue-length scaling, as KEDA/HPA do it (see the module doc)."""

    def __init__(self, config: PlannerConfig, roles: Sequence[Role]) -> None:
        self.config = config
        self.roles = list(roles)

    def desired(
        self, now: float, obs: Observation, pools: Mapping[Role, PoolState], decision: Decision
    ) -> dict[Role, int]:
        decision.predicted_rps = obs.rate_rps
        out: dict[Role, int] = {}
        for role in self.roles:
            state = pools.get(role)
            if state is None:
                continue
            current = state.ready
            if current == 0:
                out[role] = 1 if obs.inflight or obs.requests else 0
                decision.reasons[role] = "queue: empty pool"
                continue
            ratio = obs.inflight / current / self.config.queue_target
            if abs(ratio - 1) <= QUEUE_TOLERANCE:
                out[role] = state.target
            else:
                out[role] = math.ceil(current * ratio)
            decision.reasons[role] = (
                f"queue: {obs.inflight} in flight on {current} workers, "
                f"target {self.config.queue_target:g} per worker"
            )
        return out

    def surge(
        self, now: float, obs: Observation, pools: Mapping[Role, PoolState], decision: Decision
    ) -> dict[Role, int]:
        return {}  # HPA acts on its own sync period only


class Planner:
    """One planner over a set of pools: a policy plus the limits, stabilization and budget."""

    def __init__(
        self,
        config: PlannerConfig,
        policy: PlannerPolicy,
        roles: Sequence[Role],
        profile: PerfProfile | None = None,
    ) -> None:
        if not roles:
            raise InvalidRequest("the planner needs at least one pool")
        self.config = config
        self.roles = list(roles)
        if policy is PlannerPolicy.SLA:
            if profile is None:
                raise InvalidRequest("the sla policy needs a performance profile (--profile)")
            self.policy: Policy = SlaPolicy(config, profile, roles)
        else:
            self.policy = QueuePolicy(config, roles)
        self._wanted: dict[Role, deque[tuple[float, int]]] = {r: deque() for r in roles}
        self._since: float | None = None

    def decide(self, now: float, obs: Observation, pools: Mapping[Role, PoolState]) -> Decision:
        """The size each pool should have from now on (`now`: seconds on any clock that only
        goes forward)."""
        cfg = self.config
        decision = Decision(targets={})
        desired = self.policy.desired(now, obs, pools, decision)
        if self._since is None:
            self._since = now
        window = cfg.stabilization_s
        history_covers_window = now - self._since >= window
        # A load that falls past its noise shrinks the pools after one interval, not the window
        # (which guards against shrinking on noise; a downward trend is not noise).
        recent = window
        if isinstance(self.policy, SlaPolicy) and self.policy.trend.falling(FALLING_Z):
            recent = min(window, cfg.adjustment_interval_s)
        for role in self.roles:
            state = pools.get(role)
            current = state.target if state is not None else 0
            want = int(_clamp(desired.get(role, current), cfg.min_workers, cfg.max_workers))
            wanted = self._wanted[role]
            wanted.append((now, want))
            while wanted and wanted[0][0] < now - window:
                wanted.popleft()
            if want >= current:
                target = want
            elif history_covers_window:
                target = min(current, max(w for t, w in wanted if t >= now - recent))
            else:
                target = current
            decision.targets[role] = target
        self._apply_budget(decision)
        return decision

    def surge(self, now: float, obs: Observation, pools: Mapping[Role, PoolState]) -> Decision:
        """Between intervals (`obs`: the window since the last check or interval): the pools
        the load already outgrew, grown (see the module doc); `targets` holds only those."""
        cfg = self.config
        decision = Decision(targets={})
        grown = self.policy.surge(now, obs, pools, decision)
        spare = math.inf
        if cfg.max_total_workers:
            total = sum(s.target for r, s in pools.items() if r in self._wanted)
            spare = max(0, cfg.max_total_workers - total)
        for role in self.roles:
            state = pools.get(role)
            if role not in grown or state is None:
                decision.reasons.pop(role, None)
                continue
            want = int(_clamp(grown[role], cfg.min_workers, cfg.max_workers))
            want = int(min(want, state.target + spare))
            if want <= state.target:
                decision.reasons.pop(role, None)
                continue
            spare -= want - state.target
            self._wanted[role].append((now, want))  # held through the stabilization window
            decision.targets[role] = want
        return decision

    def _apply_budget(self, decision: Decision) -> None:
        """Cut the largest pools first until the total fits `max_total_workers`."""
        budget = self.config.max_total_workers
        targets = decision.targets
        if not budget:
            return
        floor = self.config.min_workers
        while sum(targets.values()) > budget:
            role = max(targets, key=lambda r: targets[r])
            if targets[role] <= floor:
                break
            targets[role] -= 1
            decision.reasons[role] = decision.reasons.get(role, "") + " (cut to the budget)"
