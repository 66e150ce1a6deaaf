"""Every worker's KV cache as the router sees it: KV events -> router block hashes -> the index.

Workers publish KV events with their own (engine) block hashes, the token ids of each block and
the parent's engine hash (kvmesh.runtime.kv_events). `KvIndexer` re-hashes every block with the
router's function (kvmesh.router.hashing), keeps per worker a map engine hash -> router hash, and
feeds the global `PrefixIndex` with router hashes, so request-side and event-side hashes agree
whatever the engine hashes with.

It also keeps each worker's block tree (parent, number of held children), so it knows exactly
whether the worker holds a block whose parent it lacks ("holes") and tells the index, which
then answers queries for hole-free workers by binary search (see kvmesh.router.indexer).

Streams: `apply(worker, item, log_id)` takes the items of a SubscribeKvEvents stream (as
kvmesh.runtime.wire converts them: the device tier only). A snapshot (chunks `first` .. `last`)
is built aside and swapped in atomically when its last chunk arrives; events must carry
consecutive ids after it, else `KvEventGap` is raised and the caller resubscribes for a fresh
snapshot. A `SkippedKvEvent` (blocks on the HOST or DISK tier, which the index does not model
yet, or an unknown kind) only advances the stream position and is counted in the worker's stats.
`resume_point(worker)` gives (last event id, log id) for a resumed subscription.
`apply_event(worker, kind)` applies an event with no id (a simulator that owns the engines, like
`kvmesh replay`, calls it directly from KvEventLog publications).

Synchronous, no clock, no I/O; one thread (the event loop).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.router.hashing import chain_hashes
from kvmesh.router.indexer import PrefixIndex
from kvmesh.runtime.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventGap,
    KvEventKind,
    KvEventRecord,
    SnapshotChunk,
)
from kvmesh.runtime.wire import SkippedKvEvent

__all__ = ["KvIndexer", "WorkerKvStats"]

log = logging.getLogger(__name__)

_RETAIN_MIN = 4096


class _Block:
    """A block a worker holds: its router hash (None: not computable, parent never seen),
    its engine parent hash and how many of its children the worker holds."""

    __slots__ = ("kids", "parent", "router")

    def __init__(self, router: int | None, parent: int | None) -> None:
        self.router = router
        self.parent = parent
        self.kids = 0


class _Tree:
    """One worker's cached blocks keyed by engine hash, with router hashes and hole accounting."""

    __slots__ = ("blocks", "orphans", "refs", "retained")

    def __init__(self, retained: dict[int, int] | None = None) -> None:
        self.blocks: dict[int, _Block] = {}
        self.refs: dict[int, int] = {}
        """Router hash -> number of held engine blocks with that router hash (normally 1)."""
        self.orphans: dict[int, int] = {}
        """Engine hash NOT held -> number of held blocks whose parent it is (holes)."""
        self.retained: dict[int, int] = retained if retained is not None else {}
        """Engine -> router hash of blocks no longer held, so a child stored after its parent
        was evicted can still be hashed. Bounded."""

    def router_of(self, engine_hash: int) -> int | None:
        blk = self.blocks.get(engine_hash)
        if blk is not None:
            return blk.router
        return self.retained.get(engine_hash)

    def store(self, ev: BlocksStored, block_size: int) -> tuple[list[int], int | None] | None:
        """Add a stored chain; returns (router hashes, router parent) to index, or None when
        the chain cannot be hashed (unknown parent or malformed blocks)."""
        parent = ev.parent_hash
        routers: list[int] | None = None
        router_parent: int | None = None
        if ev.blocks:
            known = parent is None or (router_parent := self.router_of(parent)) is not None
            if known:
                try:
                    routers = chain_hashes(
                        router_parent, [b.token_ids for b in ev.blocks], block_size, ev.lora_name
                    )
                except ValueError as exc:
                    log.warning("KV event with malformed blocks ignored for indexing: %s", exc)
        blocks, refs, orphans = self.blocks, self.refs, self.orphans
        prev = parent
        for i, b in enumerate(ev.blocks):
            e = b.block_hash
            if e in blocks:  # already held (a duplicate store): nothing changes
                prev = e
                continue
            r = routers[i] if routers is not None else None
            blk = _Block(r, prev)
            if prev is not None:
                pb = blocks.get(prev)
                if pb is not None:
                    pb.kids += 1
                else:
                    orphans[prev] = orphans.get(prev, 0) + 1
            if orphans:
                blk.kids = orphans.pop(e, 0)
            blocks[e] = blk
            if r is not None:
                refs[r] = refs.get(r, 0) + 1
            prev = e
        return None if routers is None else (routers, router_parent)

    def remove(self, engine_hashes: Sequence[int]) -> list[int]:
        """Drop blocks; returns the router hashes no longer held."""
        blocks, refs, orphans, retained = self.blocks, self.refs, self.orphans, self.retained
        gone: list[int] = []
        for e in engine_hashes:
            blk = blocks.pop(e, None)
            if blk is None:
                continue
            p = blk.parent
            if p is not None:
                pb = blocks.get(p)
                if pb is not None:
                    pb.kids -= 1
                else:
                    c = orphans[p] - 1
                    if c:
                        orphans[p] = c
                    else:
                        del orphans[p]
            if blk.kids:
                orphans[e] = blk.kids
            r = blk.router
            if r is not None:
                retained[e] = r
                c = refs[r] - 1
                if c:
                    refs[r] = c
                else:
                    del refs[r]
                    gone.append(r)
        if len(retained) > max(_RETAIN_MIN, 2 * len(blocks)):
            retained.clear()
        return gone

    def forget_all(self) -> list[int]:
        """Drop every block (keeping their hashes in `retained`); returns the router hashes."""
        held = list(self.refs)
        retained = self.retained
        for e, blk in self.blocks.items():
            if blk.router is not None:
                retained[e] = blk.router
        if len(retained) > max(_RETAIN_MIN, 2 * len(self.blocks)):
            retained.clear()
        self.blocks = {}
        self.refs = {}
        self.orphans = {}
        return held


@dataclass(slots=True)
class WorkerKvStats:
    """What the router knows about one worker's cache."""

    block_size: int
    blocks: int = 0
    """Blocks the worker holds (engine view)."""
    indexed_blocks: int = 0
    """Distinct router hashes of those blocks in the index."""
    holes: bool = False
    """Whether it holds blocks whose parent it lacks."""
    last_event_id: int | None = None
    log_id: str = ""
    snapshots: int = 0
    """Snapshots applied since the worker was added."""
    events: int = 0
    """Events applied since the worker was added."""
    skipped: int = 0
    """Events left out since the worker was added (SkippedKvEvent: other tiers, unknown kinds)."""


@dataclass(slots=True)
class _Worker:
    block_size: int
    tree: _Tree = field(default_factory=_Tree)
    last_event_id: int | None = None
    log_id: str = ""
    pending: _Tree | None = None
    pending_chains: list[tuple[list[int], int | None]] = field(default_factory=list)
    pending_log_id: str = ""
    snapshots: int = 0
    events: int = 0
    skipped: int = 0


class KvIndexer:
    """Per-worker KV state fed by KV events, and the global PrefixIndex built from it.

    Usage: `add_worker(id, block_size)`, then `apply(id, item, log_id)` for each stream item (or
    `apply_event(id, kind)`), `find_matches(router_hashes)` to score a request, and
    `remove_worker(id)` when the worker leaves. Worker ids are strings (WorkerHandle.worker_id).
    """

    def __init__(self, index: PrefixIndex[str] | None = None) -> None:
        self.index: PrefixIndex[str] = index if index is not None else PrefixIndex()
        self._workers: dict[str, _Worker] = {}

    # -- workers ----------------------------------------------------------------------------

    def add_worker(self, worker_id: str, block_size: int) -> None:
        """Start tracking `worker_id` (its KV blocks hold `block_size` tokens). Re-adding a
        known worker with the same block size keeps its state; another size resets it."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        w = self._workers.get(worker_id)
        if w is not None and w.block_size == block_size:
            return
        if w is not None:
            self.remove_worker(worker_id)
        self._workers[worker_id] = _Worker(block_size)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and drop it from the index."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self.index.remove_worker(worker_id, list(w.tree.refs))

    def has_worker(self, worker_id: str) -> bool:
        """Whether the worker is tracked."""
        return worker_id in self._workers

    def worker_ids(self) -> list[str]:
        """Tracked workers."""
        return list(self._workers)

    def block_size(self, worker_id: str) -> int:
        """The block size the worker was added with (KeyError if unknown)."""
        return self._workers[worker_id].block_size

    def stats(self, worker_id: str) -> WorkerKvStats:
        """What is known about the worker's cache (KeyError if unknown)."""
        w = self._workers[worker_id]
        return WorkerKvStats(
            block_size=w.block_size,
            blocks=len(w.tree.blocks),
            indexed_blocks=len(w.tree.refs),
            holes=bool(w.tree.orphans),
            last_event_id=w.last_event_id,
            log_id=w.log_id,
            snapshots=w.snapshots,
            events=w.events,
            skipped=w.skipped,
        )

    def resume_point(self, worker_id: str) -> tuple[int, str] | None:
        """(last event id, log id) to resume the worker's stream from; None: start with a
        snapshot (nothing seen yet, or a snapshot is half received)."""
        w = self._workers.get(worker_id)
        if w is None or w.last_event_id is None or w.pending is not None:
            return None
        return w.last_event_id, w.log_id

    def clear_worker(self, worker_id: str) -> None:
        """Drop the worker's blocks from the index and its stream position (it stays tracked;
        its next snapshot rebuilds it). For a stream that looks dead."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        self.index.remove_worker(worker_id, w.tree.forget_all())
        w.last_event_id = None
        w.pending = None
        w.pending_chains = []

    def reset_stream(self, worker_id: str) -> None:
        """Forget the stream position (after a gap): the next item must start a snapshot. The
        indexed blocks stay until that snapshot replaces them."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.last_event_id = None
            w.pending = None
            w.pending_chains = []

    # -- events -----------------------------------------------------------------------------

    def apply(
        self, worker_id: str, item: SnapshotChunk | KvEventRecord | SkippedKvEvent, log_id: str = ""
    ) -> None:
        """Apply one stream item. `log_id` comes with snapshot chunks (KvSnapshotChunk.log_id).

        Raises KeyError for an unknown worker, KvEventGap when an event does not directly
        follow the previous event or snapshot (or arrives in the middle of a snapshot, or
        before any), after which the caller must resubscribe without a resume point.
        """
        w = self._workers[worker_id]
        if isinstance(item, SnapshotChunk):
            self._snapshot_chunk(worker_id, w, item, log_id)
            return
        if w.pending is not None:
            raise KvEventGap(f"event {item.event_id} inside a snapshot")
        if w.last_event_id is None:
            raise KvEventGap(f"event {item.event_id} before any snapshot")
        if item.event_id != w.last_event_id + 1:
            raise KvEventGap(f"event {item.event_id} after {w.last_event_id}")
        w.last_event_id = item.event_id
        if isinstance(item, SkippedKvEvent):
            w.skipped += 1
            return
        self._apply_kind(worker_id, w, item.kind)
        w.events += 1

    def apply_event(self, worker_id: str, kind: KvEventKind) -> None:
        """Apply one event without stream bookkeeping (direct feeds, e.g. simulation)."""
        w = self._workers[worker_id]
        self._apply_kind(worker_id, w, kind)
        w.events += 1

    def _apply_kind(self, worker_id: str, w: _Worker, kind: KvEventKind) -> None:
        tree = w.tree
        index = self.index
        if isinstance(kind, BlocksStored):
            chain = tree.store(kind, w.block_size)
            if chain is not None:
                index.apply_stored(worker_id, chain[0], chain[1])
        elif isinstance(kind, BlocksRemoved):
            index.apply_removed(worker_id, tree.remove(kind.block_hashes), leaves=True)
        elif isinstance(kind, AllCleared):
            index.remove_worker(worker_id, tree.forget_all())
        index.set_holes(worker_id, bool(tree.orphans))

    def _snapshot_chunk(
        self, worker_id: str, w: _Worker, chunk: SnapshotChunk, log_id: str
    ) -> None:
        if chunk.first:
            # Engine hashes are only comparable within one log: keep the old mapping only then.
            retained: dict[int, int] = {}
            if log_id and log_id == w.log_id:
                retained = dict(w.tree.retained)
                retained.update(
                    (e, b.router) for e, b in w.tree.blocks.items() if b.router is not None
                )
            w.pending = _Tree(retained)
            w.pending_chains = []
            w.pending_log_id = log_id
        elif w.pending is None:
            raise KvEventGap("snapshot chunk without its first chunk")
        pending = w.pending
        for ev in chunk.chains:
            chain = pending.store(ev, w.block_size)
            if chain is not None:
                w.pending_chains.append(chain)
        if not chunk.last:
            return
        # Swap atomically (no await in between): queries never see a half-built worker.
        index = self.index
        index.remove_worker(worker_id, list(w.tree.refs))
        for hashes, parent in w.pending_chains:
            index.apply_stored(worker_id, hashes, parent)
        index.set_holes(worker_id, bool(pending.orphans))
        w.tree = pending
        w.pending = None
        w.pending_chains = []
        w.log_id = w.pending_log_id or log_id
        w.last_event_id = chunk.as_of_event_id
        w.snapshots += 1

    # -- queries ----------------------------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """{worker: leading blocks of the request it holds} (see PrefixIndex.find_matches)."""
        return self.index.find_matches(block_hashes)

    def num_blocks(self, worker_id: str) -> int:
        """Distinct router hashes the worker holds (0 if unknown)."""
        w = self._workers.get(worker_id)
        return 0 if w is None else len(w.tree.refs)
