"""Every worker's KV cache as the router sees it: KV events -> router block hashes -> the index.

Workers publish KV events with their own (engine) block hashes, the token ids of each block and
the parent's engine hash (kvmesh.runtime.kv_events). `KvIndexer` re-hashes every block with the
router's function (kvmesh.router.hashing), keeps per worker a map engine hash -> router hash, and
feeds the global `PrefixIndex` with router hashes, so request-side and event-side hashes agree
whatever the engine hashes with.

It also keeps each worker's block tree (parent, number of held children), so it knows exactly
whether the worker holds a block whose parent it lacks ("holes") and tells the index, which
then answers queries for hole-free workers by binary search (see kvmesh.router.indexer).

Tiers: device blocks feed `index`; blocks a worker holds on its host or disk tier feed one more
PrefixIndex per tier (`lower[KvTier.HOST]`, `lower[KvTier.DISK]`), so presence is kept per tier
(a block can be on several). `find_credits(hashes)` is what a cost function uses: per worker,
its leading device blocks count 1 each; from where they stop, the following blocks it holds on
the host tier count `host_hit_weight` each and those only on disk `disk_hit_weight` (the worker
onboards them instead of computing them, at a cost), up to the first block it holds nowhere.

Streams: `apply(worker, item, log_id)` takes the items of a SubscribeKvEvents stream (as
kvmesh.runtime.wire converts them). A snapshot (chunks `first` .. `last`) is built aside and
swapped in atomically when its last chunk arrives; events must carry consecutive ids after it,
else `KvEventGap` is raised and the caller resubscribes for a fresh snapshot. A
`SkippedKvEvent` (a tier or kind this version does not know) only advances the stream position
and is counted in the worker's stats.
`resume_point(worker)` gives (last event id, log id) for a resumed subscription.
`apply_event(worker, kind)` applies an event with no id (a simulator that owns the engines, like
`kvmesh replay`, calls it directly from KvEventLog publications).

Synchronous, no clock, no I/O; one thread (the event loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
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
    KvTier,
    SnapshotChunk,
)
from kvmesh.runtime.wire import SkippedKvEvent

__all__ = ["DISK_HIT_WEIGHT", "HOST_HIT_WEIGHT", "KvIndexer", "WorkerKvStats"]

HOST_HIT_WEIGHT = 0.75
"""Default credit of a prompt block found on a worker's host tier (a device block counts 1): what
onboarding it over a PCIe-class link saves against recomputing it, for a Llama-8B-class model."""
DISK_HIT_WEIGHT = 0.25
"""Default credit of a prompt block found only on a worker's disk tier (an NVMe read saves less)."""

_LOWER = (KvTier.HOST, KvTier.DISK)

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

    def store(
        self, ev: BlocksStored, block_size: int, resolve: Callable[[int], int | None] | None = None
    ) -> tuple[list[int], int | None] | None:
        """Add a stored chain; returns (router hashes, router parent) to index, or None when
        the chain cannot be hashed (unknown parent or malformed blocks). `resolve`: where else
        to look up a parent's router hash (the worker's other tiers)."""
        parent = ev.parent_hash
        router_parent = None
        if parent is not None:
            router_parent = self.router_of(parent)
            if router_parent is None and resolve is not None:
                router_parent = resolve(parent)
        routers = _router_chain(ev, block_size, parent, router_parent)
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


def _router_chain(
    ev: BlocksStored, block_size: int, parent: int | None, router_parent: int | None
) -> list[int] | None:
    """Router hashes of a stored chain; None when its parent is unknown or a block malformed."""
    if not ev.blocks or (parent is not None and router_parent is None):
        return None
    try:
        return chain_hashes(
            router_parent, [b.token_ids for b in ev.blocks], block_size, ev.lora_name
        )
    except ValueError as exc:
        log.warning("KV event with malformed blocks ignored for indexing: %s", exc)
        return None


class _LowBlock:
    """A block a worker holds on its host and/or disk tier: its router hash (None: not
    computable), the tiers holding it (bitmask of 1 << tier) and the tiers whose reference
    counts include it (a block stored on one tier before its router hash was known, then on
    another after, counts on the second only)."""

    __slots__ = ("counted", "router", "tiers")

    def __init__(self, router: int | None) -> None:
        self.router = router
        self.tiers = 0
        self.counted = 0


class _Lower:
    """One worker's blocks on its host and disk tiers, keyed by engine hash, and per tier how
    many held engine blocks carry each router hash."""

    __slots__ = ("blocks", "refs")

    def __init__(self) -> None:
        self.blocks: dict[int, _LowBlock] = {}
        self.refs: dict[KvTier, dict[int, int]] = {t: {} for t in _LOWER}

    def router_of(self, engine_hash: int) -> int | None:
        blk = self.blocks.get(engine_hash)
        return None if blk is None else blk.router

    def store(self, ev: BlocksStored, block_size: int, router_parent: int | None) -> list[int]:
        """Add a chain stored on ev.tier; returns the router hashes the tier now holds that it
        did not."""
        routers = _router_chain(ev, block_size, ev.parent_hash, router_parent)
        bit = 1 << ev.tier
        refs = self.refs[ev.tier]
        blocks = self.blocks
        new: list[int] = []
        for i, b in enumerate(ev.blocks):
            blk = blocks.get(b.block_hash)
            if blk is None:
                blk = blocks[b.block_hash] = _LowBlock(None)
            if blk.router is None and routers is not None:
                blk.router = routers[i]
            if blk.tiers & bit:
                continue
            blk.tiers |= bit
            r = blk.router
            if r is not None:
                blk.counted |= bit
                c = refs.get(r, 0)
                refs[r] = c + 1
                if not c:
                    new.append(r)
        return new

    def remove(
        self, tier: KvTier, engine_hashes: Sequence[int], retained: dict[int, int]
    ) -> list[int]:
        """Drop blocks from `tier`; returns the router hashes the tier no longer holds. Blocks no
        tier holds any more keep their router hash in `retained` (for their children)."""
        bit = 1 << tier
        refs = self.refs[tier]
        gone: list[int] = []
        for e in engine_hashes:
            blk = self.blocks.get(e)
            if blk is None or not blk.tiers & bit:
                continue
            blk.tiers &= ~bit
            r = blk.router
            if r is not None and blk.counted & bit:
                blk.counted &= ~bit
                c = refs[r] - 1
                if c:
                    refs[r] = c
                else:
                    del refs[r]
                    gone.append(r)
            if not blk.tiers:
                del self.blocks[e]
                if r is not None:
                    retained[e] = r
        return gone

    def held(self, tier: KvTier) -> list[int]:
        """Router hashes `tier` holds."""
        return list(self.refs[tier])


@dataclass(slots=True)
class WorkerKvStats:
    """What the router knows about one worker's cache."""

    block_size: int
    blocks: int = 0
    """Blocks the worker holds on its device tier (engine view)."""
    indexed_blocks: int = 0
    """Distinct router hashes of those blocks in the index."""
    host_blocks: int = 0
    """Distinct router hashes the worker holds on its host tier."""
    disk_blocks: int = 0
    """Distinct router hashes the worker holds on its disk tier."""
    holes: bool = False
    """Whether it holds blocks whose parent it lacks."""
    last_event_id: int | None = None
    log_id: str = ""
    snapshots: int = 0
    """Snapshots applied since the worker was added."""
    events: int = 0
    """Events applied since the worker was added."""
    skipped: int = 0
    """Events left out since the worker was added (SkippedKvEvent: unknown tiers or kinds)."""


@dataclass(slots=True)
class _Worker:
    block_size: int
    tree: _Tree = field(default_factory=_Tree)
    lower: _Lower = field(default_factory=_Lower)
    last_event_id: int | None = None
    log_id: str = ""
    pending: _Tree | None = None
    pending_chains: list[tuple[list[int], int | None]] = field(default_factory=list)
    pending_lower: _Lower | None = None
    pending_log_id: str = ""
    snapshots: int = 0
    events: int = 0
    skipped: int = 0


class KvIndexer:
    """Per-worker KV state fed by KV events, and the global PrefixIndex built from it.

    Usage: `add_worker(id, block_size)`, then `apply(id, item, log_id)` for each stream item (or
    `apply_event(id, kind)`), `find_credits(router_hashes)` (or `find_matches`, the device tier
    only) to score a request, and `remove_worker(id)` when the worker leaves. Worker ids are
    strings (WorkerHandle.worker_id). `host_hit_weight` / `disk_hit_weight`: what a block found
    on a worker's host / disk tier counts for in `find_credits`, a device block counting 1.
    """

    def __init__(
        self,
        index: PrefixIndex[str] | None = None,
        *,
        host_hit_weight: float = HOST_HIT_WEIGHT,
        disk_hit_weight: float = DISK_HIT_WEIGHT,
    ) -> None:
        self.index: PrefixIndex[str] = index if index is not None else PrefixIndex()
        self.lower: dict[KvTier, PrefixIndex[str]] = {t: PrefixIndex() for t in _LOWER}
        """Router hash -> workers holding it on the host tier / the disk tier."""
        self.host_hit_weight = host_hit_weight
        self.disk_hit_weight = disk_hit_weight
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
            for tier, index in self.lower.items():
                index.remove_worker(worker_id, w.lower.held(tier))

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
            host_blocks=len(w.lower.refs[KvTier.HOST]),
            disk_blocks=len(w.lower.refs[KvTier.DISK]),
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
        self._forget_lower(worker_id, w)
        w.last_event_id = None
        w.pending = None
        w.pending_chains = []
        w.pending_lower = None

    def reset_stream(self, worker_id: str) -> None:
        """Forget the stream position (after a gap): the next item must start a snapshot. The
        indexed blocks stay until that snapshot replaces them."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.last_event_id = None
            w.pending = None
            w.pending_chains = []
            w.pending_lower = None

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
            if kind.tier is not KvTier.DEVICE:
                self._store_lower(worker_id, w, w.lower, tree, kind)
                return
            chain = tree.store(kind, w.block_size, w.lower.router_of)
            if chain is not None:
                index.apply_stored(worker_id, chain[0], chain[1])
        elif isinstance(kind, BlocksRemoved):
            if kind.tier is not KvTier.DEVICE:
                gone = w.lower.remove(kind.tier, kind.block_hashes, tree.retained)
                self.lower[kind.tier].apply_removed(worker_id, gone, leaves=True)
                return
            index.apply_removed(worker_id, tree.remove(kind.block_hashes), leaves=True)
        elif isinstance(kind, AllCleared):
            index.remove_worker(worker_id, tree.forget_all())
            self._forget_lower(worker_id, w)
        index.set_holes(worker_id, bool(tree.orphans))

    def _store_lower(
        self, worker_id: str, w: _Worker, lower: _Lower, tree: _Tree, ev: BlocksStored
    ) -> list[int]:
        """Add a chain stored on a host/disk tier to `lower` (the worker's, or a snapshot's being
        built, then not indexed yet); returns the router hashes new on that tier."""
        parent = ev.parent_hash
        router_parent = None
        if parent is not None:
            router_parent = lower.router_of(parent)
            if router_parent is None:
                router_parent = tree.router_of(parent)
        new = lower.store(ev, w.block_size, router_parent)
        if lower is w.lower and new:
            self.lower[ev.tier].apply_stored(worker_id, new)
        return new

    def _forget_lower(self, worker_id: str, w: _Worker) -> None:
        lower, w.lower = w.lower, _Lower()
        retained = w.tree.retained
        for e, blk in lower.blocks.items():
            if blk.router is not None:
                retained[e] = blk.router
        for tier, index in self.lower.items():
            index.remove_worker(worker_id, lower.held(tier))

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
            w.pending_lower = _Lower()
            w.pending_log_id = log_id
        elif w.pending is None:
            raise KvEventGap("snapshot chunk without its first chunk")
        pending = w.pending
        pending_lower = w.pending_lower
        assert pending_lower is not None
        for ev in chunk.chains:
            if ev.tier is not KvTier.DEVICE:
                self._store_lower(worker_id, w, pending_lower, pending, ev)
                continue
            chain = pending.store(ev, w.block_size, pending_lower.router_of)
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
        for tier, lower_index in self.lower.items():
            lower_index.remove_worker(worker_id, w.lower.held(tier))
            held = pending_lower.held(tier)
            if held:
                lower_index.apply_stored(worker_id, held)
        w.tree = pending
        w.lower = pending_lower
        w.pending = None
        w.pending_lower = None
        w.pending_chains = []
        w.log_id = w.pending_log_id or log_id
        w.last_event_id = chunk.as_of_event_id
        w.snapshots += 1

    # -- queries ----------------------------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """{worker: leading blocks of the request it holds on its device tier} (see
        PrefixIndex.find_matches)."""
        return self.index.find_matches(block_hashes)

    def find_credits(self, block_hashes: Sequence[int]) -> Mapping[str, float]:
        """{worker: the request's leading cached blocks, tier-weighted}: its leading device
        blocks count 1 each; from there, each next block it holds on its host tier counts
        `host_hit_weight`, one it holds only on disk `disk_hit_weight`, up to the first block it
        holds on no tier. Without host/disk blocks anywhere, this is find_matches."""
        matches = self.index.find_matches(block_hashes)
        host, disk = self.lower[KvTier.HOST], self.lower[KvTier.DISK]
        if not len(host) and not len(disk):
            return matches
        credits: dict[str, float] = dict(matches)
        n = len(block_hashes)
        wh, wd = self.host_hit_weight, self.disk_hit_weight
        for wid in {*host.workers(), *disk.workers()}:
            k = matches.get(wid, 0)
            credit = float(k)
            while k < n:
                h = block_hashes[k]
                if host.holds(wid, h):
                    credit += wh
                elif disk.holds(wid, h):
                    credit += wd
                else:
                    break
                k += 1
            if credit > 0:
                credits[wid] = credit
        return credits

    def num_blocks(self, worker_id: str) -> int:
        """Distinct router hashes the worker holds (0 if unknown)."""
        w = self._workers.get(worker_id)
        return 0 if w is None else len(w.tree.refs)
