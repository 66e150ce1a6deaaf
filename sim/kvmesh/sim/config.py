"""Settings of `kvmesh replay`, its flags, and its error."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from kvmesh.planner.config import PlannerConfig, PlannerPolicy
from kvmesh.router.backend import DisaggConfig
from kvmesh.router.kv_policy import KvPolicyFlags
from kvmesh.router.kv_scheduler import KvRouterConfig
from kvmesh.router.kv_state import DISK_HIT_WEIGHT, HOST_HIT_WEIGHT
from kvmesh.router.routing import RouterMode
from kvmesh.runtime.config import add_args, opt
from kvmesh.runtime.errors import KvmeshError
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.mocker.config import MockerConfig

__all__ = ["ReplayConfig", "ReplayError", "add_replay_args"]


class ReplayError(KvmeshError):
    """A replay cannot run (missing or malformed trace, bad settings)."""


@dataclass
class ReplayConfig(KvPolicyFlags):
    """Settings of `kvmesh replay` (the mocker's own knobs are a MockerConfig, `mocker`; its KV
    tiers a KvTierConfig, `tiers`, the worker's flags; the conditional disaggregation thresholds
    the gateway's, a DisaggConfig, `disagg`; the SLO targets and the planner's settings the
    live planner's, a PlannerConfig, `planning`)."""

    trace: str = opt(
        "",
        "trace to replay (required): Mooncake JSONL, or Azure LLM inference CSV (no prefixes)",
    )
    workers: int = opt(4, "number of simulated mocker workers")
    router: list[RouterMode] = opt(
        [RouterMode.KV],
        "routing policy; repeat (or list several) to run each and compare: "
        "kv, round-robin, random, least-loaded",
    )
    speedup: float = opt(
        1.0, "arrival timestamps are divided by this (Dynamo's arrival_speedup_ratio)"
    )
    limit: int = opt(0, "replay only the first N requests of the trace (0: all)")
    trace_block_size: int = opt(512, "tokens per trace hash id (Mooncake traces: 512)")
    router_overlap_weight: float = opt(
        1.0, "kv: weight of blocks still to prefill against blocks decoding in the cost"
    )
    router_temperature: float = opt(
        0.0, "kv: 0 picks the lowest cost (ties at random); > 0 samples softmax(-cost/T)"
    )
    load_interval_ms: float = opt(
        100.0,
        "kv: simulated interval of the workers' load metrics fed to the router (as a live "
        "router's load stream); 0: the router only counts its own bookings",
    )
    router_host_hit_weight: float = opt(
        HOST_HIT_WEIGHT,
        "kv: what a prompt block on a worker's host KV tier counts for in the cost, a device "
        "block counting 1",
    )
    router_disk_hit_weight: float = opt(
        DISK_HIT_WEIGHT, "kv: the same for a block only on a worker's disk KV tier"
    )
    seed: int = opt(0, "seed of the router's tie-breaking/sampling and of the random policy")
    json: bool = opt(False, "print one JSON object per router mode instead of tables")
    plot: str = opt(
        "",
        "write a PNG here (needs matplotlib): the TTFT CDF per router mode; with --planner, "
        "load, replicas and latency over time",
    )
    progress: bool = opt(True, "progress bar on stderr (only on a terminal, never with --json)")
    prefill_workers: int = opt(
        0,
        "also replay disaggregated pools (kv routing): this many of --workers prefill, the "
        "others decode, so aggregated and disaggregated use the same total (kvmesh.sim.disagg)",
    )
    planner: PlannerPolicy | None = opt(
        None,
        "size the pool over time with this planner policy (sla, or the reactive queue "
        "baseline) between --min-workers and --max-workers, workers taking "
        "--worker-startup-s to start, instead of a static pool of --workers",
    )
    timeline_interval_s: float = opt(
        0.0,
        "interval of the JSON timeline (arrival rate, replicas, TTFT/ITL p90); 0: the "
        "planner's --adjustment-interval-s",
    )
    mocker: MockerConfig = field(
        default_factory=MockerConfig,
        metadata={"help": "the simulated engine (mocker flags)", "cli": False},
    )
    disagg: DisaggConfig = field(
        default_factory=DisaggConfig,
        metadata={"help": "conditional disaggregation (the gateway's flags)", "cli": False},
    )
    planning: PlannerConfig = field(
        default_factory=PlannerConfig,
        metadata={"help": "SLO targets and planner settings (the planner's flags)", "cli": False},
    )
    tiers: KvTierConfig = field(
        default_factory=KvTierConfig,
        metadata={"help": "the workers' KV tiers (the worker's tier flags)", "cli": False},
    )

    def __post_init__(self) -> None:
        modes: list[RouterMode] = []
        for m in self.router:
            mode = RouterMode(m)
            if mode not in modes:
                modes.append(mode)
        if not modes:
            raise ReplayError("give at least one --router mode")
        self.router = modes
        if self.workers < 1:
            raise ReplayError("--workers must be >= 1")
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ReplayError("--speedup must be a positive number")
        if self.limit < 0:
            raise ReplayError("--limit must be >= 0")
        if self.trace_block_size < 1:
            raise ReplayError("--trace-block-size must be >= 1")
        if not self.load_interval_ms >= 0:
            raise ReplayError("--load-interval-ms must be >= 0")
        if self.prefill_workers and not 0 < self.prefill_workers < self.workers:
            raise ReplayError("--prefill-workers must be between 1 and --workers - 1")
        if self.planner is not None and self.prefill_workers:
            raise ReplayError("--planner replays aggregated pools; drop --prefill-workers")
        if not self.timeline_interval_s >= 0:
            raise ReplayError("--timeline-interval-s must be >= 0")
        if self.tiers.enabled and not self.mocker.enable_prefix_caching:
            raise ReplayError("KV tiers (--kv-host-blocks) need prefix caching")
        try:
            self.kv_router()
        except ValueError as exc:
            raise ReplayError(str(exc)) from None

    @property
    def timeline_s(self) -> float:
        """The timeline's interval."""
        return self.timeline_interval_s or self.planning.adjustment_interval_s

    def kv_router(self) -> KvRouterConfig:
        """The KV-aware router's settings. With the SLA planner, the router keeps the planner's
        SLO targets (as `kvmesh up --planner sla` hands them to its routers) unless
        --router-ttft-slo-ms / --router-itl-slo-ms give others."""
        ttft_slo, itl_slo = self.router_ttft_slo_ms, self.router_itl_slo_ms
        if self.planner is PlannerPolicy.SLA:
            ttft_slo, itl_slo = self.planning.router_targets(ttft_slo, itl_slo)
        return KvRouterConfig(
            overlap_weight=self.router_overlap_weight,
            temperature=self.router_temperature,
            seed=self.seed,
            policy=self.router_policy,
            itl_weight=self.router_itl_weight,
            itl_penalty_cap_ms=self.router_itl_penalty_cap_ms,
            itl_penalty_ratio=self.router_itl_penalty_ratio,
            decode_delay_weight=self.router_decode_delay_weight,
            ttft_slo_ms=ttft_slo,
            itl_slo_ms=itl_slo,
            inflight_prefixes=self.router_inflight_prefixes,
            chunk_tokens=self.mocker.max_num_batched_tokens,
            timing_profile=self.mocker.timing_profile,
            host_hit_weight=self.router_host_hit_weight,
            disk_hit_weight=self.router_disk_hit_weight,
            # The replay hands a routed request to its worker at once, so a load sample taken
            # at `now` shows every booking made before it: none is still on its way (the live
            # default of 0.25 s counted the last quarter second's bookings twice here, and so
            # steered bursts away from the workers that had just taken their prefix).
            load_settle_s=0.0,
            # KV events reach the replay's router at once: nothing to wait for past the first
            # token.
            inflight_hold_s=0.0,
        )


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvmesh replay`: ReplayConfig's, the mocker's (MockerConfig), its KV tiers
    (KvTierConfig), the conditional disaggregation thresholds (DisaggConfig) and the planner's
    (PlannerConfig)."""
    add_args(parser, ReplayConfig, skip={"router"})
    parser.add_argument(
        "--router",
        dest="router",
        action="extend",
        nargs="+",
        choices=[m.value for m in RouterMode],
        default=argparse.SUPPRESS,
        help="routing policy; repeat (--router kv --router round-robin) or list several to run "
        "each and compare (default: kv)",
    )
    # The replay owns arrival speed and seeding; the engine's wall-clock speedup means nothing.
    add_args(parser, MockerConfig, skip={"speedup_ratio", "seed"})
    # A simulated disk tier writes no files.
    add_args(parser, KvTierConfig, skip={"kv_disk_dir"})
    # A simulated remote prefill never fails, so it never times out either.
    add_args(parser, DisaggConfig, skip={"disagg_prefill_timeout_s"})
    add_args(parser, PlannerConfig)
