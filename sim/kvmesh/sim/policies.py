"""The live routing policies over simulated workers.

A simulated worker is an index into the cluster's workers; a policy picks among candidate
indices and keeps its bookings by request id, as the live routers do:

  * `KvPolicy` (RouterMode.KV) is the live `KvScheduler` (with its `KvIndexer`), fed the
    workers' own KV events and load metrics by the cluster;
  * `SimplePolicy` (round-robin, random, least-loaded) chooses through the live
    `kvmesh.router.routing.pick_simple`, over the requests it has in flight per worker.

Both count the requests they have in flight per worker, as the live routers count them on each
worker handle (`WorkerHandle.inflight`, read by conditional disaggregation). Workers join
(`add_worker`) and leave routing (`remove_worker`, e.g. drained by a planner) as live workers
join and leave discovery; a removed worker's requests in flight keep their bookings until they
finish, and its KV events and load no longer reach the router.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.router.kv_scheduler import KvRouterConfig, KvScheduler
from kvmesh.router.kv_subscriber import sample_from_pb
from kvmesh.router.routing import RouterMode, pick_simple
from kvmesh.runtime import wire
from kvmesh.runtime.kv_events import KvEventKind
from kvmesh.runtime.types import LoadInfo
from kvmesh.sim.config import ReplayConfig
from kvmesh.workers.mocker.config import MockerConfig

__all__ = ["KvPolicy", "Policy", "Route", "SimplePolicy", "make_policy"]


@dataclass(slots=True, frozen=True)
class Route:
    """A policy's choice."""

    worker: int
    """Index of the chosen worker."""
    overlap_blocks: int = 0
    """Leading prompt blocks the router found on it (0 when the policy does not know)."""
    prompt_blocks: int = 0
    """Full blocks in the prompt (0 when the policy does not hash prompts)."""
    score: float = 0.0
    """The policy's score of the chosen worker (KvScheduler's Selection.cost: the ttft policy's
    predicted TTFT in ms while its ITL penalty is off; 0 when the policy does not score)."""


class Policy(Protocol):
    """Picks simulated workers and keeps per-request bookings (kvmesh.router.routing.Router's
    contract, synchronous and in virtual time)."""

    @property
    def kv_aware(self) -> bool:
        """Whether it wants the workers' KV events and load metrics."""
        ...

    def route(
        self,
        request_id: str,
        prompt: list[int],
        now: float,
        *,
        candidates: Sequence[int] | None = None,
        expected_output_tokens: int = 0,
    ) -> Route:
        """Pick a worker among `candidates` (None: all) and book the request on it."""
        ...

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done."""
        ...

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        """The request ended (any reason); free its booking. Idempotent. `output_tokens`: what
        it generated (0: unknown; Router.finished)."""
        ...

    def inflight(self, worker: int) -> int:
        """Requests booked on `worker` and not yet finished."""
        ...

    def kv_events(self, worker: int, kinds: list[KvEventKind]) -> None:
        """Apply KV events `worker` published."""
        ...

    def load(self, worker: int, info: LoadInfo, now: float) -> None:
        """Apply `worker`'s load metrics measured at `now`."""
        ...

    def add_worker(self, worker: int, worker_id: str) -> None:
        """Worker `worker` (the next index) joins routing."""
        ...

    def remove_worker(self, worker: int) -> None:
        """`worker` leaves routing (its bookings stay until freed)."""
        ...


class _Bookings:
    """Which worker each booked request is on, and how many each has in flight."""

    __slots__ = ("counts", "worker_of")

    def __init__(self, workers: int) -> None:
        self.counts = [0] * workers
        self.worker_of: dict[str, int] = {}

    def add(self, worker: int) -> None:
        """Count for one more worker (indices are handed out in order)."""
        if worker != len(self.counts):
            raise ValueError(f"worker {worker} joins out of order")
        self.counts.append(0)

    def book(self, request_id: str, worker: int) -> None:
        self.free(request_id)  # re-booking an id replaces it
        self.counts[worker] += 1
        self.worker_of[request_id] = worker

    def free(self, request_id: str) -> None:
        worker = self.worker_of.pop(request_id, None)
        if worker is not None:
            self.counts[worker] -= 1


class KvPolicy:
    """RouterMode.KV: the live KvScheduler (and its KvIndexer) over the simulated workers."""

    kv_aware = True

    def __init__(self, config: KvRouterConfig, worker_ids: list[str], mocker: MockerConfig) -> None:
        self.sched = KvScheduler(config, router_id="replay")
        self.mocker = mocker
        self.worker_ids: list[str] = []
        self.index_of: dict[str, int] = {}
        self.routed: set[int] = set()
        self.bookings = _Bookings(0)
        for i, wid in enumerate(worker_ids):
            self.add_worker(i, wid)

    def add_worker(self, worker: int, worker_id: str) -> None:
        self.bookings.add(worker)
        self.worker_ids.append(worker_id)
        self.index_of[worker_id] = worker
        self.routed.add(worker)
        mocker = self.mocker
        self.sched.add_worker(
            worker_id,
            block_size=mocker.block_size,
            kv_total_blocks=mocker.num_gpu_blocks,
            kv_events=mocker.enable_prefix_caching,
            max_num_seqs=mocker.max_num_seqs,
        )

    def remove_worker(self, worker: int) -> None:
        self.routed.discard(worker)
        self.sched.remove_worker(self.worker_ids[worker])

    def route(
        self,
        request_id: str,
        prompt: list[int],
        now: float,
        *,
        candidates: Sequence[int] | None = None,
        expected_output_tokens: int = 0,
    ) -> Route:
        ids = None if candidates is None else [self.worker_ids[c] for c in candidates]
        sel = self.sched.select(
            prompt, now, candidates=ids, expected_output_tokens=expected_output_tokens
        )
        self.sched.book(request_id, sel, now, expected_output_tokens=expected_output_tokens)
        worker = self.index_of[sel.worker_id]
        self.bookings.book(request_id, worker)
        return Route(worker, sel.overlap_blocks, sel.prompt_blocks, sel.cost)

    def first_token(self, request_id: str) -> None:
        self.sched.first_token(request_id)

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self.sched.free(request_id, output_tokens=output_tokens)
        self.bookings.free(request_id)

    def inflight(self, worker: int) -> int:
        return self.bookings.counts[worker]

    def kv_events(self, worker: int, kinds: list[KvEventKind]) -> None:
        if worker not in self.routed:
            return
        apply = self.sched.indexer.apply_event
        wid = self.worker_ids[worker]
        for kind in kinds:
            apply(wid, kind)

    def load(self, worker: int, info: LoadInfo, now: float) -> None:
        # The live path: the worker's LoadMetrics message, read as the router's subscriber does.
        metrics = wire.load_to_pb(info, timestamp_ms=int(now * 1e3), draining=False)
        self.sched.update_load(self.worker_ids[worker], sample_from_pb(metrics), now)


class SimplePolicy:
    """Round-robin, random or least-loaded as the live SimpleRouter chooses them
    (`pick_simple`): one counter, a seeded Random, the requests in flight per worker."""

    kv_aware = False

    def __init__(self, mode: RouterMode, workers: int, seed: int) -> None:
        if mode is RouterMode.KV:
            raise ValueError("RouterMode.KV is KvPolicy")
        self.mode = mode
        self.turn = 0
        self.rng = random.Random(seed)
        self.bookings = _Bookings(workers)
        self.routed = list(range(workers))
        """Workers in routing, in the order they joined (the live pool's order)."""

    def add_worker(self, worker: int, worker_id: str) -> None:
        self.bookings.add(worker)
        self.routed.append(worker)

    def remove_worker(self, worker: int) -> None:
        self.routed.remove(worker)

    def route(
        self,
        request_id: str,
        prompt: list[int],
        now: float,
        *,
        candidates: Sequence[int] | None = None,
        expected_output_tokens: int = 0,
    ) -> Route:
        counts = self.bookings.counts
        pool = self.routed if candidates is None else candidates
        index, self.turn = pick_simple(self.mode, [counts[c] for c in pool], self.turn, self.rng)
        self.bookings.book(request_id, pool[index])
        return Route(pool[index])

    def first_token(self, request_id: str) -> None:
        return None

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self.bookings.free(request_id)

    def inflight(self, worker: int) -> int:
        return self.bookings.counts[worker]

    def kv_events(self, worker: int, kinds: list[KvEventKind]) -> None:
        return None

    def load(self, worker: int, info: LoadInfo, now: float) -> None:
        return None


def make_policy(mode: RouterMode, worker_ids: list[str], config: ReplayConfig) -> Policy:
    """The policy of `mode` over the workers `worker_ids`, with the replay's settings."""
    if mode is RouterMode.KV:
        return KvPolicy(config.kv_router(), worker_ids, config.mocker)
    return SimplePolicy(mode, len(worker_ids), config.seed)
