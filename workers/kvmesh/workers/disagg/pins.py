"""Pinned remote-prefill transfers: transfer id -> what to release, with an expiry timer.

A prefill engine pins a finished prefill's blocks (keeps their references) and hands out a
transfer id. `release(transfer_id)` (ReleaseKvBlocks), `release_request(request_id)` (the
same, by the PrefillRemote request's id, for a caller that left before it saw the transfer id)
or the expiry (nobody released them in time: the decode worker died, the gateway went away)
calls the engine's release function exactly once. Runs on the event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PinnedTransfers"]

log = logging.getLogger(__name__)

K = TypeVar("K")


class PinnedTransfers(Generic[K]):
    """Transfers pinned by one engine. `release_fn(key)` frees what `pin(key)` pinned."""

    def __init__(self, release_fn: Callable[[K], object], default_ttl_s: float = 30.0) -> None:
        if not default_ttl_s > 0:
            raise ValueError("default_ttl_s must be > 0")
        self._release_fn = release_fn
        self.default_ttl_s = default_ttl_s
        self._pins: dict[str, tuple[K, asyncio.TimerHandle, str]] = {}
        """transfer id -> (key, expiry timer, request id)"""
        self._by_request: dict[str, set[str]] = {}
        """request id -> the transfers pinned under it (a set: request ids are the caller's)"""
        self.num_expired = 0
        """Transfers freed by their expiry rather than by release()."""

    @staticmethod
    def new_id() -> str:
        """A fresh transfer id."""
        return uuid.uuid4().hex

    def pin(
        self, transfer_id: str, key: K, ttl_s: float | None = None, request_id: str = ""
    ) -> int:
        """Register a pinned transfer (a fresh id, see new_id), for the PrefillRemote request
        `request_id` (`release_request`); returns its expiry in ms."""
        if transfer_id in self._pins:
            raise ValueError(f"transfer {transfer_id} is already pinned")
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        timer = asyncio.get_running_loop().call_later(ttl, self._expire, transfer_id)
        self._pins[transfer_id] = (key, timer, request_id)
        if request_id:
            self._by_request.setdefault(request_id, set()).add(transfer_id)
        return max(1, round(ttl * 1000))

    def release(self, transfer_id: str) -> bool:
        """Free a transfer's blocks; False if unknown, already released or expired."""
        entry = self._pins.pop(transfer_id, None)
        if entry is None:
            return False
        key, timer, request_id = entry
        timer.cancel()
        if request_id:
            pinned = self._by_request[request_id]
            pinned.discard(transfer_id)
            if not pinned:
                del self._by_request[request_id]
        self._release_fn(key)
        return True

    def release_request(self, request_id: str) -> bool:
        """Free every transfer pinned for the PrefillRemote request `request_id`; False if
        none is (unknown, released, expired, or the prefill was aborted before it pinned)."""
        released = False
        for transfer_id in list(self._by_request.get(request_id, ())):
            released = self.release(transfer_id) or released
        return released

    def _expire(self, transfer_id: str) -> None:
        if transfer_id in self._pins:
            log.warning("remote prefill transfer %s expired unreleased; freeing it", transfer_id)
            self.num_expired += 1
            self.release(transfer_id)

    def release_all(self) -> int:
        """Free every pinned transfer (engine stop); returns how many."""
        ids = list(self._pins)
        for tid in ids:
            self.release(tid)
        return len(ids)

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._pins
