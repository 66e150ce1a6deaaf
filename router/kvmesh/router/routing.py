"""Routing policies: pick a worker for a request.

Every policy implements `Router`: `route` picks a worker and books the request on it;
`first_token` and `finished` update the booking. `RouterMode.KV` (kvmesh.router.kv_router) is
the default: KV-cache-aware routing fed by the workers' KV event streams, with an approximate
mode for engines that publish no events, so it suits every fleet. Round-robin, random and
least-loaded (`SimpleRouter`) remain for comparison.
"""

from __future__ import annotations

import enum
import random
import time
from bisect import bisect_left
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.runtime.errors import NotFound, ResourceExhausted, Unavailable
from kvmesh.runtime.types import Role


class RouterMode(enum.Enum):
    """Routing policies."""

    KV = "kv"
    """KV-cache-aware (kvmesh.router.kv_router.KvRouter): the default."""
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


@dataclass(slots=True)
class RouteDecision:
    """The chosen worker and what the router knew when it chose."""

    worker: WorkerHandle
    overlap_blocks: int = 0
    """Leading prompt blocks the worker already holds (0 when the policy does not know)."""
    prompt_blocks: int = 0
    """Full blocks in the prompt (0 when the policy does not hash prompts)."""
    routing_overhead_s: float = 0.0
    """Time from tokens in hand to worker chosen (hashing, index lookup, cost); 0: not measured."""
    cost: float = 0.0
    """The chosen worker's cost under the policy (kv: blocks to prefill x weight + decode
    blocks); 0 when the policy has none."""
    policy: str = ""
    """The policy that chose (a RouterMode value; "remote": a standalone router did)."""


OVERHEAD_BUCKETS_S = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
)  # fmt: skip


class RoutingStats:
    """Routing overhead histogram (seconds) and decision counters of one policy; cheap enough
    per request.

    A frontend exports it as a Prometheus histogram: `buckets()` gives cumulative (le, count)
    pairs ending with +Inf, `total_s` the sum.
    """

    __slots__ = (
        "bounds",
        "counts",
        "decisions",
        "overlap_blocks",
        "policy",
        "prompt_blocks",
        "total_s",
    )

    def __init__(self, bounds: Sequence[float] = OVERHEAD_BUCKETS_S, policy: str = "") -> None:
        self.policy = policy
        """The routing policy (a RouterMode value) whose decisions these are."""
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total_s = 0.0
        self.decisions = 0
        self.overlap_blocks = 0
        """Sum of RouteDecision.overlap_blocks (predicted cache hits, in blocks)."""
        self.prompt_blocks = 0
        """Sum of RouteDecision.prompt_blocks."""

    def observe(self, seconds: float, overlap_blocks: int = 0, prompt_blocks: int = 0) -> None:
        """Record one decision."""
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds
        self.decisions += 1
        self.overlap_blocks += overlap_blocks
        self.prompt_blocks += prompt_blocks

    def buckets(self) -> list[tuple[float, int]]:
        """Cumulative (upper bound, count) pairs; the last bound is +inf."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile `q` (0 when empty; inf past the last)."""
        if not self.decisions:
            return 0.0
        rank = q * self.decisions
        for bound, running in self.buckets():
            if running >= rank:
                return bound
        return float("inf")  # pragma: no cover - the last bucket always reaches `decisions`

    @property
    def mean_s(self) -> float:
        """Mean overhead in seconds (0 when empty)."""
        return self.total_s / self.decisions if self.decisions else 0.0


class Saturated(ResourceExhausted):
    """Every worker that could take the request has its `max_inflight` requests in flight (the
    caller queues it: kvmesh.router.admission)."""


def pick_candidates(
    pool: WorkerPool,
    model: str,
    exclude: Collection[str],
    role: Role | None,
    lora_name: str = "",
) -> list[WorkerHandle]:
    """Workers serving `model` in the pool for `role`, minus `exclude`; raises when none.

    Adapter affinity: with `lora_name`, only the workers whose card lists the adapter as
    loaded, when any does (a worker without it would answer NOT_FOUND); otherwise all of them.

    `role` None: aggregated workers, or decode workers when the model has no aggregated ones.
    NotFound when nobody serves the model while other models are served; Unavailable when no
    worker is live at all, or none is left after the role filter and `exclude`; Saturated when
    every one left has its `max_inflight` requests in flight (prefill workers have no such
    limit). Workers marked down (WorkerPool.mark_down, health ejections) are left out while
    others remain.
    """
    workers = pool.workers(model)
    if not workers:
        if pool.workers():
            raise NotFound(f"no worker serves model {model!r}")
        raise Unavailable("no workers are available")
    if role is None:
        chosen = [w for w in workers if w.info.role is Role.AGGREGATED]
        if not chosen:
            chosen = [w for w in workers if w.info.role is Role.DECODE]
    else:
        chosen = [w for w in workers if w.info.role is role]
    if not chosen:
        raise Unavailable(f"no {(role or Role.AGGREGATED).value} worker serves model {model!r}")
    if exclude:
        chosen = [w for w in chosen if w.worker_id not in exclude]
        if not chosen:
            raise Unavailable(f"no other worker serves model {model!r}")
    chosen = [w for w in chosen if w.available]
    if not chosen:
        raise Unavailable(f"no worker serving model {model!r} is answering health checks")
    if lora_name:
        chosen = [w for w in chosen if lora_name in w.info.lora_adapters] or chosen
    if role is not Role.PREFILL:
        chosen = [w for w in chosen if not w.max_inflight or w.inflight < w.max_inflight]
        if not chosen:
            raise Saturated(f"every worker serving model {model!r} is at its in-flight limit")
    now = time.monotonic()
    up = [w for w in chosen if w.down_until <= now]
    return up or chosen  # workers that just failed are a last resort, not excluded


class Router(Protocol):
    """Picks workers and keeps per-request bookings."""

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        request_id: str,
        *,
        lora_name: str = "",
        exclude: Collection[str] = (),
        role: Role | None = None,
        expected_output_tokens: int = 0,
        dry_run: bool = False,
    ) -> RouteDecision:
        """Pick a worker for the request and book it. Raises NotFound / Unavailable.

        `role`: the pool to pick from (None: aggregated workers, or decode workers if there are
        none). `expected_output_tokens`: for load prediction (0: unknown). Routing the same
        `request_id` again (a retry with `exclude`) replaces its booking. `dry_run`: choose
        only: book nothing (no load, no event to peer router replicas).
        """
        ...

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done."""
        ...

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        """The request ended (any reason); free its booking. Idempotent. `output_tokens`: what
        it generated on the worker it was booked on (0: unknown), for that worker's realized
        ITL (the KV router with an ITL target)."""
        ...


def pick_simple(
    mode: RouterMode, loads: Sequence[int], turn: int, rng: random.Random
) -> tuple[int, int]:
    """Round-robin's, random's or least-loaded's choice among candidate workers.

    `loads`: each candidate's requests in flight (least-loaded picks the fewest); `turn`: the
    caller's round-robin counter for these candidates (round-robin picks `turn % n`;
    least-loaded breaks ties round-robin from there, so idle fleets are not all sent to the
    first worker); `rng`: random's generator (one draw per choice). Returns (index into
    `loads`, the counter's next value: random leaves it alone). Pure but for the draw:
    `SimpleRouter` and the simulator (kvmesh.sim) both choose through it.
    """
    n = len(loads)
    if not n:
        raise ValueError("no candidate workers")
    if mode is RouterMode.RANDOM:
        return rng.randrange(n), turn
    if mode is RouterMode.ROUND_ROBIN:
        return turn % n, turn + 1
    if mode is RouterMode.LEAST_LOADED:
        return min(((turn + i) % n for i in range(n)), key=loads.__getitem__), turn + 1
    raise ValueError(f"{mode.value} is not a simple routing policy")


def router_ready(router: Router) -> bool:
    """Whether `router` can route now: a router service (RemoteRouter) reports SERVING once it
    has joined a worker that can generate; routers in this process always can."""
    ready = getattr(router, "ready", None)
    return True if ready is None else bool(ready())


class SimpleRouter:
    """Round-robin, random or least-loaded (fewest requests in flight from this process),
    chosen by `pick_simple`; round-robin keeps one counter per model."""

    def __init__(
        self, pool: WorkerPool, mode: RouterMode = RouterMode.ROUND_ROBIN, seed: int = 0
    ) -> None:
        self.pool = pool
        self.mode = mode
        self._cursor: dict[str, int] = {}
        self._booked: dict[str, WorkerHandle] = {}
        self._rng = random.Random(seed)
        self.stats = RoutingStats(policy=mode.value)
        if mode is RouterMode.KV:
            raise ValueError("RouterMode.KV is served by kvmesh.router.kv_router.KvRouter")

    def candidates(
        self, model: str, exclude: Collection[str], role: Role | None = None, lora_name: str = ""
    ) -> list[WorkerHandle]:
        """Workers serving `model` for `role`, minus `exclude` (see pick_candidates); raises
        when there are none."""
        return pick_candidates(self.pool, model, exclude, role, lora_name)

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        request_id: str,
        *,
        lora_name: str = "",
        exclude: Collection[str] = (),
        role: Role | None = None,
        expected_output_tokens: int = 0,
        dry_run: bool = False,
    ) -> RouteDecision:
        t0 = time.perf_counter()
        workers = self.candidates(model, exclude, role, lora_name)
        index, self._cursor[model] = pick_simple(
            self.mode, [w.inflight for w in workers], self._cursor.get(model, 0), self._rng
        )
        chosen = workers[index]
        if dry_run:
            return RouteDecision(chosen, policy=self.mode.value)
        self.finished(request_id)  # a retry replaces its booking
        chosen.inflight += 1
        self._booked[request_id] = chosen
        overhead = time.perf_counter() - t0
        self.stats.observe(overhead)
        return RouteDecision(chosen, routing_overhead_s=overhead, policy=self.mode.value)

    def first_token(self, request_id: str) -> None:
        return None

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        worker = self._booked.pop(request_id, None)
        if worker is not None:
            worker.inflight -= 1
