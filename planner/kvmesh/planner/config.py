"""Settings of the planner's decisions (`PlannerConfig`), shared by `kvmesh planner`, `kvmesh up
--planner` and `kvmesh replay --planner`: the same flags mean the same everywhere."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvmesh.planner.predictors import PredictorKind
from kvmesh.runtime.config import opt

__all__ = ["PlannerConfig", "PlannerPolicy"]


class PlannerPolicy(enum.Enum):
    """How the planner sizes the pools."""

    SLA = "sla"
    """From a performance profile and predicted load, the replicas that meet the TTFT and ITL
    targets (kvmesh.planner.policy.SlaPolicy)."""
    QUEUE = "queue"
    """Reactive, as a KEDA/HPA autoscaler on queue length: replicas * (in-flight requests per
    worker / --queue-target), within a 10 % tolerance (kvmesh.planner.policy.QueuePolicy)."""


@dataclass
class PlannerConfig:
    """How the planner decides pool sizes (SLA targets, predictor, limits, pacing)."""

    ttft_slo_ms: float = opt(500.0, "time-to-first-token target, ms")
    itl_slo_ms: float = opt(50.0, "inter-token latency target (a request's mean ITL), ms")
    adjustment_interval_s: float = opt(10.0, "how often the planner observes and decides, s")
    profile: str = opt(
        "",
        "sla: the workers' performance profile (kvmesh profile); empty: mocker workers are "
        "measured in virtual time from their flags (other engines need one)",
    )
    predictor: PredictorKind = opt(
        PredictorKind.KALMAN,
        "load predictor: constant, moving-average, kalman (always available), arima, prophet "
        "(optional extras kvmesh[arima], kvmesh[prophet])",
    )
    prediction_margin: float = opt(
        1.0,
        "sla: plan for the predicted rate plus this many times the RMS of how far past "
        "predictions fell short (more headroom while the load rises faster than predicted)",
    )
    surge_check_s: float = opt(
        2.0,
        "sla: between intervals, this often, check whether the load already outgrew the pool "
        "(latency over the targets, or arrivals / queued work beyond the pool's capacity, past "
        "their noise) and grow it at once (never shrinks); 0: off",
    )
    min_workers: int = opt(
        1, "fewest workers per pool; 0 lets an idle pool scale to zero (cold start)"
    )
    max_workers: int = opt(64, "most workers per pool")
    max_total_workers: int = opt(0, "budget: most workers over all pools (0: no budget)")
    scale_down_delay_s: float | None = opt(
        None,
        "a pool shrinks only to the largest size wanted over this window (stabilization, as "
        "HPA's; growing is immediate); unset: --worker-startup-s + --adjustment-interval-s, "
        "so a worker let go is not one that would have to start again before it could serve; "
        "sla: one adjustment interval while the arrival rate falls past its noise",
    )
    worker_startup_s: float = opt(
        30.0,
        "how long a new worker takes to serve; the planner sizes for the load predicted that "
        "far ahead (replay: also the simulated start-up delay)",
    )
    ttft_quantile: float = opt(
        0.95, "sla: the TTFT quantile held under the target (observed/expected correction)"
    )
    itl_quantile: float = opt(
        0.9,
        "sla: the quantile of the requests' own mean ITL held under the ITL target (the "
        "observed/expected correction, where the gateways export a per-request ITL histogram)",
    )
    slo_attainment: float = opt(
        0.97,
        "sla: the share of requests within both targets a pool is sized for: where a steady, "
        "loaded pool showed fewer (more), the ITL it plans is lowered (raised) beside the "
        "quantiles' corrections; 0: off",
    )
    itl_headroom: float = opt(
        0.9,
        "sla: without a per-request ITL histogram, plan the mean ITL at this fraction of the "
        "ITL target (requests vary around it)",
    )
    queue_target: float = opt(
        8.0, "queue: in-flight requests per worker the reactive policy holds (HPA target value)"
    )

    @property
    def stabilization_s(self) -> float:
        """The scale-down window in force."""
        if self.scale_down_delay_s is not None:
            return self.scale_down_delay_s
        return self.worker_startup_s + self.adjustment_interval_s

    def router_targets(self, ttft_slo_ms: float, itl_slo_ms: float) -> tuple[float, float]:
        """The (TTFT, ITL) targets the KV router keeps beside the SLA planner: the router's own
        (`--router-ttft-slo-ms`, `--router-itl-slo-ms`; 0: not given), else the planner's
        (`kvmesh up --planner sla`, `kvmesh replay --planner sla`; kv_policy, SLO)."""
        return ttft_slo_ms or self.ttft_slo_ms, itl_slo_ms or self.itl_slo_ms

    def __post_init__(self) -> None:
        for name in ("ttft_slo_ms", "itl_slo_ms", "adjustment_interval_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number")
        if self.min_workers < 0 or self.max_workers < 1:
            raise ValueError("--min-workers must be >= 0 and --max-workers >= 1")
        if self.min_workers > self.max_workers:
            raise ValueError("--min-workers must not exceed --max-workers")
        if self.max_total_workers < 0:
            raise ValueError("--max-total-workers must be >= 0")
        delay = self.scale_down_delay_s
        if (delay is not None and not delay >= 0) or not self.worker_startup_s >= 0:
            raise ValueError("--scale-down-delay-s and --worker-startup-s must be >= 0")
        if not 0 < self.ttft_quantile < 1:
            raise ValueError("--ttft-quantile must be in (0, 1)")
        if not 0 < self.itl_quantile < 1:
            raise ValueError("--itl-quantile must be in (0, 1)")
        if not 0 <= self.slo_attainment < 1:
            raise ValueError("--slo-attainment must be in [0, 1)")
        if not 0 < self.itl_headroom <= 1:
            raise ValueError("--itl-headroom must be in (0, 1]")
        if not self.prediction_margin >= 0:
            raise ValueError("--prediction-margin must be >= 0")
        if not (self.surge_check_s >= 0 and math.isfinite(self.surge_check_s)):
            raise ValueError("--surge-check-s must be >= 0")
        if not self.queue_target > 0:
            raise ValueError("--queue-target must be > 0")
