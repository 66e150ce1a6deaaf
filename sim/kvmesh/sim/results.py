"""What a replay measured: the per-request timeline it records, and its summary.

Metrics: TTFT (first token - arrival), ITL (every gap between consecutive tokens of a request,
pooled over requests), E2E (last token - arrival), throughput over the simulated span (first
arrival to last completion), `prefix_hit_rate` = prompt tokens the mockers served from cache /
prompt tokens (each request's cached tokens at its first admission, the engine's own
accounting), and `prefix_hit_rate_bound` = the trace's infinite-cache bound: leading hash ids
seen in an earlier request / hash ids, as in `shared/ref/traces/trace_stats.json`
(`prefix_hit_rate_bound_tokens` weighs it by tokens). Per worker: requests, prompt tokens,
cached tokens, busy fraction (simulated step time / span), preemptions.

SLO: `slo_attainment` = requests that finished with TTFT <= --ttft-slo-ms and a mean ITL (their
own: (last token - first token) / (tokens - 1)) <= --itl-slo-ms / all requests of the trace
(rejected and unfinished ones miss). `worker_hours` = simulated hours each worker existed within
the span: a static pool's workers the whole span, a planned pool's from the moment the planner
asked for them (start-up included) until they exited after draining. `timeline`: one row per
interval of the span: arrival rate, replicas (serving, starting, draining) at its end, and the
p90 TTFT and p90 per-request mean ITL of the requests that arrived in it, and `slo_met`: the share
of them that met the SLO as `slo_attainment` counts.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvmesh.runtime.types import KvTierStats
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.trace import Trace

__all__ = [
    "ModeResult",
    "ReplicaSample",
    "Stats",
    "Timeline",
    "WorkerResult",
    "WorkerTally",
    "mean_itl",
    "quantile",
    "summarize",
]

ReplicaSample = tuple[float, dict[str, int]]
"""(virtual time, {"serving": n, "starting": n, "draining": n}) as a planned pool was then."""


@dataclass(slots=True)
class Stats:
    """Summary of a latency sample, in milliseconds (all 0 when empty)."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        """Stats of a sample given in seconds (percentiles interpolated linearly)."""
        if not seconds:
            return cls()
        xs = sorted(seconds)
        return cls(
            mean=1e3 * math.fsum(xs) / len(xs),
            p50=1e3 * quantile(xs, 0.5),
            p90=1e3 * quantile(xs, 0.9),
            p99=1e3 * quantile(xs, 0.99),
            max=1e3 * xs[-1],
        )


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted `xs` (numpy's default)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class WorkerResult:
    """One simulated worker's share of the work."""

    worker: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    busy_fraction: float
    """Simulated time spent in steps / the simulated span."""
    preemptions: int
    steps: int


@dataclass(slots=True)
class ModeResult:
    """The outcome of replaying a trace with one router mode."""

    mode: str
    trace: str
    requests: int
    """Requests that finished."""
    requests_total: int
    rejected: int
    """Requests a worker refused at admission (prompt larger than its pool or context)."""
    unfinished: int
    workers: int
    speedup: float
    block_size: int
    num_gpu_blocks: int
    duration_s: float
    """Simulated span: first arrival to last completion."""
    throughput_rps: float
    output_tokens_per_s: float
    ttft_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    prefix_hit_rate: float
    """Prompt tokens served from the workers' caches / prompt tokens (finished requests)."""
    prefix_hit_rate_bound: float
    """Infinite-cache bound: leading hash ids seen before / hash ids (trace_stats.json)."""
    prefix_hit_rate_bound_tokens: float
    """The same bound weighted by tokens."""
    predicted_overlap_rate: float
    """kv: leading prompt blocks the router found on its choice / prompt blocks (0 otherwise)."""
    tier_hit_rates: dict[str, float]
    """Prompt tokens served per KV tier (device: prefix-cache hits; host, disk: onboarded) /
    prompt tokens of the finished requests (a request re-admitted after a preemption counts
    its hits again)."""
    kv_host_blocks: int
    kv_disk_blocks: int
    preemptions: int
    steps: int
    per_worker: list[WorkerResult]
    imbalance: dict[str, float]
    """max / mean over workers of requests, prompt tokens and busy fraction."""
    wall_s: float
    """Wall-clock seconds the simulation took (the only non-deterministic field)."""
    ttft_slo_ms: float = 0.0
    itl_slo_ms: float = 0.0
    slo_attainment: float = 0.0
    """Requests within both SLO targets / requests (see the module doc)."""
    worker_hours: float = 0.0
    """Simulated worker-hours, starting and draining workers included."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Per interval: t_s, arrival_rps, serving/starting/draining replicas, ttft/itl p90 ms."""
    planner: dict[str, Any] | None = None
    """The planner's settings and what it did (planned runs only)."""
    ttft_s: list[float] = field(default_factory=list, repr=False)
    """Every finished request's TTFT in seconds (for plots; not in to_json)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object `kvmesh replay --json` prints (floats rounded)."""
        out = asdict(self)
        del out["ttft_s"]
        rounded: dict[str, Any] = _round(out)
        return rounded


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6) if abs(value) < 1 else round(value, 3)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


class Timeline:
    """What a replay records per request (NaN: never happened) and in total, as virtual time
    runs."""

    __slots__ = (
        "arrival",
        "cached",
        "done",
        "finished_at",
        "first_at",
        "itl",
        "last_at",
        "ntok",
        "output_tokens",
        "rejected",
    )

    def __init__(self, arrival: list[float]) -> None:
        n = len(arrival)
        self.arrival = arrival
        self.first_at = [math.nan] * n
        self.last_at = [0.0] * n
        self.ntok = [0] * n
        self.finished_at = [math.nan] * n
        self.cached = [0] * n
        """Prompt tokens the prefilling worker served from its cache."""
        self.itl = array("d")
        self.output_tokens = 0
        self.done = 0
        """Requests that finished."""
        self.rejected = 0
        """Requests a worker refused at admission."""

    def token(self, i: int, now: float) -> bool:
        """Request `i` got a token at `now`; True if it is its first."""
        first = not self.ntok[i]
        if first:
            self.first_at[i] = now
        else:
            self.itl.append(now - self.last_at[i])
        self.ntok[i] += 1
        self.last_at[i] = now
        return first

    def finish(self, i: int, now: float) -> None:
        """Request `i` finished at `now` (its last token)."""
        self.finished_at[i] = now
        self.output_tokens += self.ntok[i]
        self.done += 1

    @property
    def settled(self) -> int:
        """Requests that finished or were rejected."""
        return self.done + self.rejected


class WorkerTally(Protocol):
    """What a simulated worker counted (kvmesh.sim.cluster.SimWorker)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def requests(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def preemptions(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def kv_tiers(self) -> tuple[KvTierStats, ...]: ...
    @property
    def started_at(self) -> float:
        """When the worker was asked for (-inf: from the start)."""
        ...

    @property
    def stopped_at(self) -> float:
        """When it exited (inf: it ran to the end)."""
        ...


def mean_itl(t: Timeline, i: int) -> float:
    """Request `i`'s own mean ITL in seconds (0 with one token)."""
    n = t.ntok[i]
    return (t.last_at[i] - t.first_at[i]) / (n - 1) if n > 1 else 0.0


def met_slo(t: Timeline, i: int, ttft_s: float, itl_s: float) -> bool:
    """Request `i` finished within both targets."""
    return (
        not math.isnan(t.finished_at[i])
        and t.first_at[i] - t.arrival[i] <= ttft_s
        and mean_itl(t, i) <= itl_s
    )


def _p90_ms(xs: list[float]) -> float:
    return 1e3 * quantile(sorted(xs), 0.9) if xs else 0.0


def interval_rows(
    t: Timeline,
    start: float,
    end: float,
    interval_s: float,
    replicas: Sequence[ReplicaSample],
    met: Sequence[bool] = (),
) -> list[dict[str, Any]]:
    """The timeline: one row per `interval_s` from `start` to `end` (see the module doc);
    `met`: per request, whether it met the SLO (`met_slo`), for `slo_met` (left out without)."""
    if end <= start or interval_s <= 0:
        return []
    n_rows = math.ceil((end - start) / interval_s)
    arrivals: list[list[int]] = [[] for _ in range(n_rows)]
    for i, a in enumerate(t.arrival):
        k = int((a - start) // interval_s)
        if 0 <= k < n_rows:
            arrivals[k].append(i)
    rows: list[dict[str, Any]] = []
    j = 0
    current: dict[str, int] = dict(replicas[0][1]) if replicas else {}
    for k in range(n_rows):
        t0 = start + k * interval_s
        while j < len(replicas) and replicas[j][0] <= t0 + interval_s:
            current = dict(replicas[j][1])
            j += 1
        done = [i for i in arrivals[k] if not math.isnan(t.finished_at[i])]
        rows.append(
            {
                "t_s": round(t0, 3),
                "arrival_rps": round(len(arrivals[k]) / interval_s, 3),
                **current,
                "ttft_p90_ms": round(_p90_ms([t.first_at[i] - t.arrival[i] for i in done]), 3),
                "itl_p90_ms": round(_p90_ms([mean_itl(t, i) for i in done]), 3),
            }
        )
        if met and arrivals[k]:
            rows[-1]["slo_met"] = round(sum(met[i] for i in arrivals[k]) / len(arrivals[k]), 4)
    return rows


def summarize(
    mode: str,
    trace: Trace,
    config: ReplayConfig,
    workers: Sequence[WorkerTally],
    t: Timeline,
    predicted_overlap_rate: float,
    t_wall: float,
    replicas: Sequence[ReplicaSample] = (),
) -> ModeResult:
    """Summarize one simulated run (aggregated or disaggregated) into a ModeResult; `t_wall`:
    the wall clock (time.perf_counter) when it started; `replicas`: how a planned pool's size
    changed (empty: a static pool of all `workers`)."""
    reqs = trace.requests
    n_req = len(t.arrival)
    fin = [i for i in range(n_req) if not math.isnan(t.finished_at[i])]
    t_start = min(t.arrival)
    t_end = max(t.finished_at[i] for i in fin) if fin else t_start
    span = t_end - t_start
    hours = (
        sum(max(0.0, min(w.stopped_at, t_end) - max(w.started_at, t_start)) for w in workers) / 3600
    )
    if not replicas:
        replicas = [(t_start, {"serving": len(workers), "starting": 0, "draining": 0})]
    slo = config.planning
    met = [met_slo(t, i, slo.ttft_slo_ms / 1e3, slo.itl_slo_ms / 1e3) for i in range(n_req)]
    prompt_tokens = sum(reqs[i].input_length for i in fin)
    per_worker = [
        WorkerResult(
            worker=w.worker_id,
            requests=w.requests,
            prompt_tokens=w.prompt_tokens,
            cached_tokens=w.cached_tokens,
            busy_fraction=w.busy_s / span if span > 0 else 0.0,
            preemptions=w.preemptions,
            steps=w.steps,
        )
        for w in workers
    ]
    ttft = [t.first_at[i] - t.arrival[i] for i in fin]
    return ModeResult(
        mode=mode,
        trace=trace.path,
        requests=len(fin),
        requests_total=n_req,
        rejected=t.rejected,
        unfinished=n_req - len(fin) - t.rejected,
        workers=len(workers),
        speedup=config.speedup,
        block_size=config.mocker.block_size,
        num_gpu_blocks=config.mocker.num_gpu_blocks,
        duration_s=span,
        throughput_rps=len(fin) / span if span > 0 else 0.0,
        output_tokens_per_s=t.output_tokens / span if span > 0 else 0.0,
        ttft_ms=Stats.of(ttft),
        itl_ms=Stats.of(t.itl),
        e2e_ms=Stats.of([t.finished_at[i] - t.arrival[i] for i in fin]),
        prefix_hit_rate=sum(t.cached[i] for i in fin) / prompt_tokens if prompt_tokens else 0.0,
        prefix_hit_rate_bound=0.0,
        prefix_hit_rate_bound_tokens=0.0,
        predicted_overlap_rate=predicted_overlap_rate,
        tier_hit_rates=_tier_hit_rates(workers, prompt_tokens),
        kv_host_blocks=config.tiers.kv_host_blocks,
        kv_disk_blocks=config.tiers.kv_disk_blocks,
        preemptions=sum(w.preemptions for w in workers),
        steps=sum(w.steps for w in workers),
        per_worker=per_worker,
        imbalance=_imbalance(per_worker),
        wall_s=time.perf_counter() - t_wall,
        ttft_slo_ms=slo.ttft_slo_ms,
        itl_slo_ms=slo.itl_slo_ms,
        slo_attainment=sum(met) / n_req if n_req else 0.0,
        worker_hours=hours,
        timeline=interval_rows(t, t_start, t_end, config.timeline_s, replicas, met),
        ttft_s=ttft,
    )


def _tier_hit_rates(workers: Sequence[WorkerTally], prompt_tokens: int) -> dict[str, float]:
    hits: dict[str, int] = {}
    for w in workers:
        for t in w.kv_tiers:
            hits[t.tier.label] = hits.get(t.tier.label, 0) + t.hit_tokens
    return {k: v / prompt_tokens if prompt_tokens else 0.0 for k, v in hits.items()}


def _imbalance(per_worker: list[WorkerResult]) -> dict[str, float]:
    def ratio(values: list[float]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 0.0

    return {
        "requests_max_over_mean": ratio([float(w.requests) for w in per_worker]),
        "prompt_tokens_max_over_mean": ratio([float(w.prompt_tokens) for w in per_worker]),
        "busy_fraction_max_over_mean": ratio([w.busy_fraction for w in per_worker]),
    }
