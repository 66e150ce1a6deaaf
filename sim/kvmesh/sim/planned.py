"""`kvmesh replay --planner sla|queue`: an aggregated pool that the live planner resizes in
virtual time.

The pool starts at `--min-workers` (at least one). Every `--adjustment-interval-s` the planner
(kvmesh.planner.policy.Planner, the code `kvmesh planner` runs) gets what a gateway's metrics
would have shown over the interval (arrivals, mean prompt and output length, TTFT mean and
quantile, mean ITL, prompt tokens found in the prefix cache, the finished requests' own mean
ITL at `--itl-quantile` (the per-request histogram a gateway would export), requests in flight:
`IntervalMeter`) and the pool's state, and returns a target:

  * growing: new workers are simulated mockers that serve only `--worker-startup-s` later (they
    count as starting, and toward worker-hours, from the moment they are asked for);
  * shrinking: the workers chosen by kvmesh.planner.drain (starting ones first, then the least
    cached value) leave routing at once (the router forgets them, as it does a worker that
    leaves discovery), finish their requests and exit when idle; they count as draining, and
    toward worker-hours, until then.

Between ticks, every `--surge-check-s` (sla), the planner's surge check (`Planner.surge`) gets the
same kind of Observation over the window since the last check or tick (a second meter) and may
grow the pool at once, with the same start-up delay.

Requests route among serving workers only (the live routing policy, as in kvmesh.sim.replay);
while none serves (a pool at 0), they wait at the gateway, in flight, until one does.
"""

from __future__ import annotations

import enum
import functools
import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.planner.drain import DrainCandidate, drain_order
from kvmesh.planner.policy import Decision, Observation, Planner, PoolState
from kvmesh.planner.profile import PerfProfile
from kvmesh.router.routing import RouterMode
from kvmesh.runtime.types import Role
from kvmesh.sim.cluster import Cluster, Progress, SimWorker
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.policies import make_policy
from kvmesh.sim.replay import AggregatedReplay
from kvmesh.sim.results import ModeResult, ReplicaSample, Timeline, mean_itl, quantile
from kvmesh.sim.trace import Trace
from kvmesh.workers.batching.scheduler import SeqOutput

__all__ = ["IntervalMeter", "PlannedReplay", "simulate_planned"]


class IntervalMeter:
    """What a gateway's metrics show over one interval, from the replay's timeline."""

    def __init__(self, timeline: Timeline, trace: Trace, config: PlannerConfig) -> None:
        self.timeline = timeline
        self.trace = trace
        self.ttft_quantile = config.ttft_quantile
        self.itl_quantile = config.itl_quantile
        self.targets_s = (config.ttft_slo_ms / 1e3, config.itl_slo_ms / 1e3)
        self._reset(0)

    def _reset(self, itl_from: int) -> None:
        self.arrived = 0
        self.prompt_tokens = 0
        self.finished = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self.ttft_s: list[float] = []
        self.request_itl_s: list[float] = []
        """The finished requests' own mean ITL (two tokens or more)."""
        self.itl_from = itl_from
        """Gaps recorded in the timeline before this interval."""

    def arrival(self, index: int) -> None:
        self.arrived += 1
        self.prompt_tokens += self.trace.requests[index].input_length

    def first_token(self, ttft_s: float) -> None:
        self.ttft_s.append(ttft_s)

    def finish(self, output_tokens: int, cached_tokens: int, mean_itl_s: float) -> None:
        self.finished += 1
        self.output_tokens += output_tokens
        self.cached_tokens += cached_tokens
        if output_tokens > 1:
            self.request_itl_s.append(mean_itl_s)

    def observe(self, interval_s: float, inflight: int) -> Observation:
        """The interval's Observation; starts the next interval."""
        itl = self.timeline.itl
        gaps = len(itl) - self.itl_from
        ttft = self.ttft_s
        per_request = self.request_itl_s
        obs = Observation(
            interval_s=interval_s,
            requests=self.arrived,
            finished=self.finished,
            isl_mean=self.prompt_tokens / self.arrived if self.arrived else math.nan,
            osl_mean=self.output_tokens / self.finished if self.finished else math.nan,
            cached_mean=self.cached_tokens / self.finished if self.finished else math.nan,
            first_tokens=len(ttft),
            ttft_ms=1e3 * sum(ttft) / len(ttft) if ttft else math.nan,
            ttft_tail_ms=1e3 * quantile(sorted(ttft), self.ttft_quantile) if ttft else math.nan,
            itl_ms=1e3 * math.fsum(itl[self.itl_from :]) / gaps if gaps else math.nan,
            itl_tail_ms=(
                1e3 * quantile(sorted(per_request), self.itl_quantile) if per_request else math.nan
            ),
            ttft_within=_share(ttft, self.targets_s[0]),
            itl_within=_share(per_request, self.targets_s[1]),
            inflight=inflight,
        )
        self._reset(len(itl))
        return obs


def _share(xs: list[float], limit: float) -> float:
    """The share of `xs` at or under `limit` (NaN: none)."""
    return sum(1 for x in xs if x <= limit) / len(xs) if xs else math.nan


class Decider(Protocol):
    """What decides the pool's size each interval (kvmesh.planner.policy.Planner)."""

    def decide(self, now: float, obs: Observation, pools: Mapping[Role, PoolState]) -> Decision: ...

    def surge(self, now: float, obs: Observation, pools: Mapping[Role, PoolState]) -> Decision: ...


class _State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    EXITED = "exited"


class PlannedReplay(AggregatedReplay):
    """Aggregated replay on a pool the planner resizes (see the module doc)."""

    def __init__(self, cluster: Cluster, planner: Decider, config: ReplayConfig) -> None:
        super().__init__(cluster)
        self.planner = planner
        self.settings = config.planning
        self.state: list[_State] = [_State.SERVING] * len(cluster.workers)
        self.serving = len(cluster.workers)
        self.waiting: deque[int] = deque()
        self.meter = IntervalMeter(cluster.timeline, cluster.trace, self.settings)
        self.check_meter = IntervalMeter(cluster.timeline, cluster.trace, self.settings)
        """The window since the last surge check or tick."""
        self.meters = (self.meter, self.check_meter)
        self.last_check = 0.0
        sla = config.planner is PlannerPolicy.SLA
        self.check_s = self.settings.surge_check_s if sla else 0.0
        """Surge checks (sla only: the queue baseline acts on its own period, as live)."""
        self.samples: list[ReplicaSample] = []
        self.decisions: list[dict[str, Any]] = []
        self.peak = self.serving
        self.total = len(cluster.trace.requests)
        self.arrived = 0

    # -- pool ------------------------------------------------------------------------------

    def _count(self, state: _State) -> int:
        return sum(1 for s in self.state if s is state)

    def _sample(self, now: float) -> None:
        self.samples.append(
            (
                now,
                {
                    "serving": self.serving,
                    "starting": self._count(_State.STARTING),
                    "draining": self._count(_State.DRAINING),
                },
            )
        )

    def start(self, now: float) -> None:
        """Record the pool as it starts and schedule the first tick."""
        self._sample(now)
        self.last_check = now
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        """The next tick, and the surge checks before it."""
        c = self.cluster
        interval = self.settings.adjustment_interval_s
        check = self.check_s
        if check > 0:
            k = 1
            while k * check < interval - 1e-9:
                c.call_later(k * check, self._check)
                k += 1
        c.call_later(interval, self._tick)

    def _pool(self) -> PoolState:
        starting = self._count(_State.STARTING)
        return PoolState(
            Role.AGGREGATED,
            target=self.serving + starting,
            ready=self.serving,
            starting=starting,
            draining=self._count(_State.DRAINING),
        )

    def _apply(self, decision: Decision, pool: PoolState, now: float) -> None:
        target = decision.targets.get(Role.AGGREGATED, pool.target)
        if target != pool.target:
            self.decisions.append(
                {
                    "t_s": round(now, 3),
                    "from": pool.target,
                    "to": target,
                    "reason": decision.reasons.get(Role.AGGREGATED, ""),
                }
            )
            self._resize(target, now)

    def _inflight(self) -> int:
        return self.arrived - self.cluster.timeline.settled

    def _check(self) -> None:
        now = self.cluster.now
        obs = self.check_meter.observe(now - self.last_check, self._inflight())
        self.last_check = now
        if self.cluster.timeline.settled >= self.total:
            return
        pool = self._pool()
        self._apply(self.planner.surge(now, obs, {Role.AGGREGATED: pool}), pool, now)

    def _tick(self) -> None:
        c = self.cluster
        now = c.now
        inflight = self._inflight()
        obs = self.meter.observe(self.settings.adjustment_interval_s, inflight)
        self.check_meter.observe(now - self.last_check, inflight)  # the next window starts
        self.last_check = now
        pool = self._pool()
        self._apply(self.planner.decide(now, obs, {Role.AGGREGATED: pool}), pool, now)
        self._sample(now)
        if c.timeline.settled < self.total:
            self._schedule(now)

    def _resize(self, target: int, now: float) -> None:
        c = self.cluster
        current = [w for w, s in zip(c.workers, self.state, strict=True) if _live(s)]
        for _ in range(target - len(current)):
            worker = c.add_worker(f"w{len(c.workers)}")
            worker.started_at = now
            self.state.append(_State.STARTING)
            c.call_later(self.settings.worker_startup_s, functools.partial(self._ready, worker))
        if target >= len(current):
            return
        candidates = [
            DrainCandidate(
                worker_id=str(w.index),
                started=w.started_at,
                serving=self.state[w.index] is _State.SERVING,
                cached_blocks=w.sched.pool.num_cached,
                inflight=c.policy.inflight(w.index),
            )
            for w in current
        ]
        for cand in drain_order(candidates)[: len(current) - target]:
            self._drain(c.workers[int(cand.worker_id)], now)

    def _ready(self, worker: SimWorker) -> None:
        if self.state[worker.index] is not _State.STARTING:
            return  # cancelled while starting
        self.state[worker.index] = _State.SERVING
        self.serving += 1
        self.peak = max(self.peak, self.serving)
        self.cluster.policy.add_worker(worker.index, worker.worker_id)
        now = self.cluster.now
        while self.waiting:
            super().arrival(self.waiting.popleft(), now)

    def _drain(self, worker: SimWorker, now: float) -> None:
        if self.state[worker.index] is _State.STARTING:
            self.state[worker.index] = _State.EXITED
            worker.stopped_at = now
            return
        self.state[worker.index] = _State.DRAINING
        self.serving -= 1
        self.cluster.policy.remove_worker(worker.index)
        self._exit_if_idle(worker, now)

    def _exit_if_idle(self, worker: SimWorker, now: float) -> None:
        if worker.result is None and not worker.sched.has_work:
            self.state[worker.index] = _State.EXITED
            worker.stopped_at = now

    # -- requests --------------------------------------------------------------------------

    def arrival(self, index: int, now: float) -> None:
        self.arrived += 1
        for meter in self.meters:
            meter.arrival(index)
        if self.serving == 0:
            self.waiting.append(index)
            return
        super().arrival(index, now)

    def output(self, worker: SimWorker, out: SeqOutput, now: float) -> None:
        t = self.cluster.timeline
        index = int(out.request_id[1:])
        first = t.ntok[index] == 0
        super().output(worker, out, now)
        for meter in self.meters:
            if first:
                meter.first_token(now - t.arrival[index])
            if out.finish_reason is not None:
                meter.finish(t.ntok[index], t.cached[index], mean_itl(t, index))
        if out.finish_reason is not None:
            if self.state[worker.index] is _State.DRAINING:
                self._exit_if_idle(worker, now)


def _live(state: _State) -> bool:
    return state is _State.STARTING or state is _State.SERVING


def simulate_planned(
    trace: Trace,
    config: ReplayConfig,
    mode: RouterMode,
    profile: PerfProfile | None,
    *,
    progress: Progress | None = None,
) -> ModeResult:
    """Replay `trace` on a pool the planner `config.planner` resizes (see the module doc)."""
    assert config.planner is not None
    settings = config.planning
    initial = max(1, settings.min_workers)
    worker_ids = [f"w{i}" for i in range(initial)]
    cluster = Cluster(trace, config, worker_ids, make_policy(mode, worker_ids, config))
    planner = Planner(settings, config.planner, [Role.AGGREGATED], profile)
    replay = PlannedReplay(cluster, planner, config)
    replay.start(cluster.now)
    cluster.run(replay, progress)
    result = cluster.summarize(
        f"{mode.value}+{config.planner.value}", replay.predicted_overlap_rate, replay.samples
    )
    result.workers = replay.peak
    result.planner = {
        "policy": config.planner.value,
        "min_workers": settings.min_workers,
        "max_workers": settings.max_workers,
        "worker_startup_s": settings.worker_startup_s,
        "adjustment_interval_s": settings.adjustment_interval_s,
        "predictor": settings.predictor.value,
        "surge_check_s": replay.check_s,
        "workers_started": len(cluster.workers),
        "scale_events": len(replay.decisions),
        "decisions": replay.decisions,
    }
    return result
