"""Injectable time.

Everything that waits or timestamps goes through a Clock, so the same scheduler and router code
runs against wall time in a server and against virtual time in `kvmesh replay`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """A source of time in seconds and a way to wait."""

    def now(self) -> float:
        """Monotonic time in seconds (origin unspecified)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` (<= 0 still yields once to other tasks)."""
        ...


class RealClock:
    """Wall clock: time.monotonic and asyncio.sleep."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that only moves when told to; sleep advances it instantly.

    For deterministic tests and virtual-time simulation of a single task. `sleep` moves time
    forward by the requested amount and yields once, so code under test sees the passage of time
    without waiting for it.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` (must be >= 0)."""
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)
