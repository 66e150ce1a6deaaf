"""Admission control: how many generations a gateway runs, and a bounded queue for the rest.

A generation is admitted when this process runs fewer than `max_concurrent_requests` of them
and the router finds a worker below its in-flight limit (`HealthConfig.max_inflight_per_worker`:
the router raises `Saturated` when every worker is full). Otherwise it waits in a FIFO queue of
at most `max_queued_requests`; only the head of the queue tries again, when a generation ends or a
worker frees a slot (and every `RETRY_S`, for limits this process does not see released, such as a
standalone router's). A request that finds the queue full, or waits longer than
`queue_timeout_s`, is refused with ResourceExhausted: HTTP 429 with `Retry-After`, gRPC
RESOURCE_EXHAUSTED. This is the SGLang router's `--max-concurrent-requests` / `--queue-size` /
`--queue-timeout-secs` and Envoy's circuit breakers, applied per gateway: what is not admitted
waits here, bounded in count and time, instead of in unbounded worker queues.

A generation that migrates (kvmesh.router.backend) keeps its slot and re-routes at the head of
the queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvmesh.runtime.config import opt
from kvmesh.runtime.errors import ResourceExhausted

T = TypeVar("T")

RETRY_S = 0.25
"""How often the head of the queue retries without being woken."""


@dataclass
class AdmissionConfig:
    """Admission control of a gateway (frontend, or router proxy)."""

    max_concurrent_requests: int = opt(
        0, "generations this process runs at once; more wait in the queue (0: no limit)"
    )
    max_queued_requests: int = opt(
        1024,
        "generations that may wait for a slot (this process's limit or a worker's); more are "
        "refused at once with 429 and Retry-After",
    )
    queue_timeout_s: float = opt(
        5.0, "a generation that waited this long for a slot is refused with 429 and Retry-After"
    )

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 0 or self.max_queued_requests < 0:
            raise ValueError("max_concurrent_requests and max_queued_requests must be >= 0")
        if not self.queue_timeout_s >= 0:
            raise ValueError("queue_timeout_s must be >= 0")

    @property
    def retry_after_s(self) -> int:
        """What a refusal tells the client to wait (whole seconds, at least 1)."""
        return max(1, math.ceil(self.queue_timeout_s))


class QueueFull(ResourceExhausted):
    """Refused at once: the admission queue is full."""


class QueueTimeout(ResourceExhausted):
    """Refused after waiting `queue_timeout_s` in the admission queue."""


class _Full(Exception):
    """No slot now (internal)."""


class Admission:
    """Admission control for one process (see the module docstring). One event loop."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self.running = 0
        """Generations admitted and not finished."""
        self.rejected_full = 0
        self.rejected_timeout = 0
        self.queued_total = 0
        """Generations that had to wait (admitted later or refused)."""
        self._waiters: collections.deque[asyncio.Event] = collections.deque()

    @property
    def queued(self) -> int:
        """Generations waiting now."""
        return len(self._waiters)

    async def admit(
        self, route: Callable[[], Awaitable[T]], *, new: bool = True, urgent: bool = False
    ) -> T:
        """Run `route` (it books a worker; ResourceExhausted: every worker is full) once there is
        room. `new`: the generation takes a slot of `max_concurrent_requests` (release it with
        `finished()`); False for one that already holds it (a migration). `urgent`: wait at the
        head of the queue. Raises QueueFull / QueueTimeout, or what `route` raises."""
        if not self._waiters:
            with contextlib.suppress(_Full):
                return await self._try(route, new)
        cfg = self.config
        if len(self._waiters) >= cfg.max_queued_requests and not urgent:
            self.rejected_full += 1
            full = QueueFull(
                f"the server is overloaded ({len(self._waiters)} requests queued); retry after "
                f"{cfg.retry_after_s} s",
            )
            full.retry_after_s = cfg.retry_after_s
            raise full
        self.queued_total += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.queue_timeout_s
        me = asyncio.Event()
        if urgent:
            self._waiters.appendleft(me)
        else:
            self._waiters.append(me)
        self.wake()  # the head may fit now
        try:
            while True:
                if self._waiters[0] is me:
                    with contextlib.suppress(_Full):
                        return await self._try(route, new)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.rejected_timeout += 1
                    timeout = QueueTimeout(
                        f"the server is overloaded: no capacity within {cfg.queue_timeout_s:g} s; "
                        f"retry after {cfg.retry_after_s} s"
                    )
                    timeout.retry_after_s = cfg.retry_after_s
                    raise timeout
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(remaining, RETRY_S))
        finally:
            self._waiters.remove(me)
            self.wake()  # the next one may fit too

    async def _try(self, route: Callable[[], Awaitable[T]], new: bool) -> T:
        limit = self.config.max_concurrent_requests
        if new and limit and self.running >= limit:
            raise _Full
        try:
            result = await route()
        except ResourceExhausted:
            raise _Full from None
        if new:
            self.running += 1
        return result

    def finished(self) -> None:
        """A generation admitted with `new` ended: free its slot."""
        self.running -= 1
        self.wake()

    def wake(self) -> None:
        """Capacity may have freed (a generation ended, a worker slot or worker appeared)."""
        if self._waiters:
            self._waiters[0].set()
