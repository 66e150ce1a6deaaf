"""Routing policies: pick a worker for a request.

Every policy implements `Router`: `route` picks a worker and books the request on it;
`first_token` and `finished` update the booking. The KV-aware policy (next issue) plugs in
here with the same interface, fed by the pool's join/leave listener.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.router.pool import WorkerHandle, WorkerPool

from kvmesh.errors import NotFound, Unavailable


class RouterMode(enum.Enum):
    """Routing policies."""

    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


@dataclass(slots=True)
class RouteDecision:
    """The chosen worker and what the router knew when it chose."""

    worker: WorkerHandle
    overlap_blocks: int = 0
    prompt_blocks: int = 0


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
    ) -> RouteDecision:
        """Pick a worker for the request and book it. Raises NotFound / Unavailable."""
        ...

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done."""
        ...

    def finished(self, request_id: str) -> None:
        """The request ended (any reason); free its booking. Idempotent."""
        ...


class SimpleRouter:
    """Round-robin, random or least-loaded (fewest requests in flight from this process).

    Round-robin keeps one cursor per model; ties in least-loaded are broken round-robin so
    idle fleets are not all sent to the first worker.
    """

    def __init__(
        self, pool: WorkerPool, mode: RouterMode = RouterMode.ROUND_ROBIN, seed: int = 0
    ) -> None:
        self.pool = pool
        self.mode = mode
        self._cursor: dict[str, int] = {}
        self._booked: dict[str, WorkerHandle] = {}
        self._rng = random.Random(seed)

    def candidates(self, model: str, exclude: Collection[str]) -> list[WorkerHandle]:
        """Workers serving `model`, minus `exclude`; raises when there are none."""
        workers = self.pool.workers(model)
        if not workers:
            if self.pool.workers():
                raise NotFound(f"no worker serves model {model!r}")
            raise Unavailable("no workers are available")
        if exclude:
            workers = [w for w in workers if w.worker_id not in exclude]
            if not workers:
                raise Unavailable(f"no other worker serves model {model!r}")
        return workers

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        request_id: str,
        *,
        lora_name: str = "",
        exclude: Collection[str] = (),
    ) -> RouteDecision:
        workers = self.candidates(model, exclude)
        if self.mode is RouterMode.RANDOM:
            chosen = self._rng.choice(workers)
        else:
            start = self._cursor.get(model, 0)
            self._cursor[model] = start + 1
            n = len(workers)
            if self.mode is RouterMode.ROUND_ROBIN:
                chosen = workers[start % n]
            else:
                chosen = min((workers[(start + i) % n] for i in range(n)), key=lambda w: w.inflight)
        chosen.inflight += 1
        self._booked[request_id] = chosen
        return RouteDecision(chosen)

    def first_token(self, request_id: str) -> None:
        return None

    def finished(self, request_id: str) -> None:
        worker = self._booked.pop(request_id, None)
        if worker is not None:
            worker.inflight -= 1
