"""Which workers leave a pool that shrinks: one rule for the local supervisor (`kvmesh up`) and
the simulator.

Workers still starting go first (newest first: they hold nothing and serve nobody). Among
serving workers, the one with the least cached value goes: the fewest KV blocks in its prefix
cache (what the router would lose), then the fewest requests in flight (what has to finish
before it can exit), then the newest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DrainCandidate", "drain_order"]


@dataclass(frozen=True, slots=True)
class DrainCandidate:
    """A worker that could leave, and what it holds."""

    worker_id: str
    started: float
    """When it was started (any clock that only goes forward)."""
    serving: bool = True
    """False while it is still starting."""
    cached_blocks: int = 0
    """Blocks in its device prefix cache (LoadMetrics.kv_tiers, device tier)."""
    inflight: int = 0
    """Requests it is serving."""


def drain_order(candidates: Sequence[DrainCandidate]) -> list[DrainCandidate]:
    """`candidates` in the order they should leave (see the module doc)."""
    return sorted(
        candidates,
        key=lambda c: (c.serving, c.cached_blocks, c.inflight, -c.started, c.worker_id),
    )
