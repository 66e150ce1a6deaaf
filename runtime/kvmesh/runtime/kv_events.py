"""The engine-agnostic KV event log: one numbered stream of cache changes per worker.

An engine publishes every change of its prefix cache here (blocks stored, blocks removed, all
cleared). The log numbers the events (ids start at 1 and only grow), keeps the cache state they
imply, keeps a bounded backlog of recent events, and fans events out to subscribers. So the
worker server can offer "snapshot, then deltas, resumable by event id" without the engine's help.

Tiers: a stored or removed event names the tier it happened on (`KvTier`: the device pool, the
host-memory tier, the disk tier; DEVICE by default), and the implied state is one map per tier,
so a block can be cached on several tiers at once. A move between tiers is a removed event on one
tier and a stored event on the other. AllCleared empties every tier.

Concurrency: the log is meant for one asyncio event loop thread. `publish` is synchronous and never
blocks, so engines (or a virtual-time simulator with no event loop at all) can call it from
synchronous code; subscribers are async iterators on the loop.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = [
    "AllCleared",
    "BlocksRemoved",
    "BlocksStored",
    "CachedBlock",
    "KvEventGap",
    "KvEventKind",
    "KvEventLog",
    "KvEventRecord",
    "KvStateMirror",
    "KvTier",
    "SnapshotChunk",
    "StoredBlock",
    "TieredState",
    "apply_event",
    "empty_state",
]


class KvTier(enum.IntEnum):
    """Where a cached KV block lives (the values of kvmesh.api.common.v1.KvTier)."""

    DEVICE = 1
    """The engine's KV pool (accelerator memory, or the primary pool on CPU)."""
    HOST = 2
    """The host-memory tier below the device pool."""
    DISK = 3
    """The disk tier below the host tier."""

    @property
    def label(self) -> str:
        """Lower-case name, as metrics label it (`tier="device|host|disk"`)."""
        return self.name.lower()


@dataclass(slots=True, frozen=True)
class StoredBlock:
    """One full KV block: its chained hash and the token ids it holds."""

    block_hash: int
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class BlocksStored:
    """Blocks that entered the cache, as a chain: each block's parent is the previous one.

    `parent_hash` is the parent of the first block (None: the chain starts at the root).
    """

    parent_hash: int | None
    blocks: list[StoredBlock]
    lora_name: str = ""
    tier: KvTier = KvTier.DEVICE
    """The tier the blocks entered."""


@dataclass(slots=True)
class BlocksRemoved:
    """Blocks that left a tier of the cache. Removal is per block: children of a removed block
    stay, and so do copies of the block on other tiers."""

    block_hashes: list[int]
    tier: KvTier = KvTier.DEVICE
    """The tier the blocks left."""


@dataclass(slots=True)
class AllCleared:
    """The whole cache was dropped, on every tier."""


KvEventKind = BlocksStored | BlocksRemoved | AllCleared

CachedBlock = tuple[int | None, tuple[int, ...], str]
"""What the log knows about a cached block: (parent_hash, token_ids, lora_name)."""

TieredState = dict[KvTier, dict[int, CachedBlock]]
"""A cache state per tier: tier -> block_hash -> (parent_hash, token_ids, lora_name)."""


def empty_state() -> TieredState:
    """A TieredState with every tier empty."""
    return {tier: {} for tier in KvTier}


@dataclass(slots=True)
class KvEventRecord:
    """An event with its id (1, 2, 3, ... in publication order)."""

    event_id: int
    kind: KvEventKind


@dataclass(slots=True)
class SnapshotChunk:
    """Part of a snapshot of the cache as of event `as_of_event_id`.

    A snapshot is one or more chunks, `first` on the first and `last` on the last; chains are in
    parent-before-child order across the whole snapshot. A subscriber that receives a chunk with
    `first=True` discards what it knew and rebuilds from the chunks, then applies the events that
    follow (all with ids greater than `as_of_event_id`).
    """

    as_of_event_id: int
    chains: list[BlocksStored]
    first: bool
    last: bool


def apply_event(state: TieredState, kind: KvEventKind) -> None:
    """Apply one event to a per-tier cache state."""
    if isinstance(kind, BlocksStored):
        tier = state[kind.tier]
        parent = kind.parent_hash
        lora = kind.lora_name
        for block in kind.blocks:
            tier[block.block_hash] = (parent, block.token_ids, lora)
            parent = block.block_hash
    elif isinstance(kind, BlocksRemoved):
        tier = state[kind.tier]
        for h in kind.block_hashes:
            tier.pop(h, None)
    else:
        for tier in state.values():
            tier.clear()


def _chains(state: dict[int, CachedBlock], tier: KvTier) -> list[BlocksStored]:
    """Decompose one tier's state into maximal chains, every parent emitted before its
    children."""
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for h, (parent, _, _) in state.items():
        if parent is not None and parent in state and parent != h:
            children.setdefault(parent, []).append(h)
        else:
            roots.append(h)
    chains: list[BlocksStored] = []
    seen: set[int] = set()

    def walk(start: int) -> None:
        stack = [start]
        while stack:
            h = stack.pop()
            if h in seen:
                continue
            parent, tokens, lora = state[h]
            chain = BlocksStored(parent, [StoredBlock(h, tokens)], lora, tier)
            seen.add(h)
            cur = h
            while True:
                kids = [k for k in children.get(cur, ()) if k not in seen]
                if not kids:
                    break
                nxt = kids[0]
                stack.extend(reversed(kids[1:]))
                _, ntokens, nlora = state[nxt]
                if nlora != lora:
                    stack.append(nxt)  # different adapter: its own chain
                    break
                chain.blocks.append(StoredBlock(nxt, ntokens))
                seen.add(nxt)
                cur = nxt
            chains.append(chain)

    for root in roots:
        walk(root)
    if len(seen) < len(state):  # only possible with a parent cycle (hash collisions)
        for h in state:
            if h not in seen:
                walk(h)
    return chains


class KvEventGap(Exception):
    """A subscriber saw an event id that does not follow the previous one."""


class KvStateMirror:
    """The subscriber side: rebuilds a worker's cache state from what `subscribe` yields.

    A chunk with `first=True` starts a new snapshot (the old state is dropped when its last chunk
    arrives); an event must carry the id right after the previous event or snapshot
    (`last_event_id`), else KvEventGap. Before any snapshot, `resume_from(states, event_id)`
    seeds the mirror for a resumed subscription. `states` holds every tier, `state` the device's.
    """

    __slots__ = ("_pending", "last_event_id", "states")

    def __init__(self) -> None:
        self.states: TieredState = empty_state()
        self.last_event_id: int | None = None
        self._pending: TieredState | None = None

    @property
    def state(self) -> dict[int, CachedBlock]:
        """The device tier's blocks."""
        return self.states[KvTier.DEVICE]

    def resume_from(self, states: TieredState, last_event_id: int) -> None:
        """Start from a state known to be current as of `last_event_id`."""
        self.states = {tier: dict(states.get(tier, {})) for tier in KvTier}
        self.last_event_id = last_event_id
        self._pending = None

    def apply(self, item: SnapshotChunk | KvEventRecord) -> None:
        """Apply one item of a subscription."""
        if isinstance(item, SnapshotChunk):
            if item.first:
                self._pending = empty_state()
            elif self._pending is None:
                raise KvEventGap("snapshot chunk without the first chunk")
            for chain in item.chains:
                apply_event(self._pending, chain)
            if item.last:
                self.states = self._pending
                self._pending = None
                self.last_event_id = item.as_of_event_id
            return
        if self._pending is not None:
            raise KvEventGap(f"event {item.event_id} inside a snapshot")
        if self.last_event_id is not None and item.event_id != self.last_event_id + 1:
            raise KvEventGap(f"event {item.event_id} after {self.last_event_id}")
        apply_event(self.states, item.kind)
        self.last_event_id = item.event_id


class _Subscriber:
    """Per-subscriber buffer. `resync` means: next, send a fresh snapshot (queue is void)."""

    __slots__ = ("limit", "queue", "resync", "waiter")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queue: deque[KvEventRecord] = deque()
        self.resync = False
        self.waiter: asyncio.Future[None] | None = None

    def push(self, record: KvEventRecord) -> None:
        if self.resync:
            return  # the snapshot that comes next will include this event
        if len(self.queue) >= self.limit:
            # Too slow: drop the queued deltas and send a fresh snapshot instead.
            self.queue.clear()
            self.resync = True
        else:
            self.queue.append(record)
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class KvEventLog:
    """Numbered KV cache events, the cache state they imply, a backlog and subscribers.

    Contract:
      * `publish` assigns the next id (ids start at 1, strictly increasing), applies the event to
        the implied state, appends it to a backlog of at most `backlog` events and hands it to
        every subscriber without blocking. It costs O(blocks in the event) plus O(subscribers).
      * `cached(tier)` is a tier's cache state implied by all events so far: BlocksStored on the
        tier adds (or overwrites) each block with its parent and tokens, BlocksRemoved on it drops
        each hash (children stay), AllCleared empties every tier.
      * `subscribe(resume_after)` yields either the backlog events after `resume_after` (when the
        backlog still holds all of them, or `resume_after == last_event_id`) or a fresh snapshot,
        then live events; nothing is lost or duplicated. A subscriber that falls more than
        `subscriber_queue_limit` events behind gets a fresh snapshot instead of a gap.
    """

    def __init__(
        self,
        backlog: int = 65536,
        snapshot_chunk_blocks: int = 1024,
        subscriber_queue_limit: int = 65536,
    ) -> None:
        if backlog < 0 or snapshot_chunk_blocks < 1 or subscriber_queue_limit < 1:
            raise ValueError(
                "backlog must be >= 0, snapshot_chunk_blocks and subscriber_queue_limit >= 1"
            )
        self._last_id = 0
        self.log_id = uuid.uuid4().hex
        """Identifies this log (one per engine process): event ids are only comparable, and
        resumable, within one log."""
        self._backlog: deque[KvEventRecord] = deque(maxlen=backlog)
        self._state: TieredState = empty_state()
        self._subscribers: set[_Subscriber] = set()
        self._chunk_blocks = snapshot_chunk_blocks
        self._queue_limit = subscriber_queue_limit

    @property
    def last_event_id(self) -> int:
        """Id of the latest event; 0 before any."""
        return self._last_id

    @property
    def num_subscribers(self) -> int:
        """How many subscribers are registered now."""
        return len(self._subscribers)

    def publish(self, kind: KvEventKind) -> int:
        """Record `kind` as the next event and return its id."""
        self._last_id += 1
        record = KvEventRecord(self._last_id, kind)
        apply_event(self._state, kind)
        self._backlog.append(record)
        for sub in self._subscribers:
            sub.push(record)
        return self._last_id

    def cached(self, tier: KvTier = KvTier.DEVICE) -> dict[int, CachedBlock]:
        """A copy of the implied cache state of `tier`: block_hash -> (parent_hash, token_ids,
        lora)."""
        return dict(self._state[tier])

    def block(self, block_hash: int, tier: KvTier = KvTier.DEVICE) -> CachedBlock | None:
        """One block of the implied cache state of `tier` (None: not cached there)."""
        return self._state[tier].get(block_hash)

    def __len__(self) -> int:
        """Number of blocks in the implied cache state of the device tier."""
        return len(self._state[KvTier.DEVICE])

    def snapshot(self) -> list[SnapshotChunk]:
        """The implied state as chains in parent-before-child order (the device tier's chains
        first, then the host's, then the disk's; each chain names its tier), in chunks of at most
        `snapshot_chunk_blocks` blocks. An empty cache gives one empty chunk (first and last)."""
        as_of = self._last_id
        chunks: list[SnapshotChunk] = []
        current: list[BlocksStored] = []
        room = self._chunk_blocks
        chains = [c for tier in KvTier for c in _chains(self._state[tier], tier)]
        for chain in chains:
            blocks = chain.blocks
            parent = chain.parent_hash
            while blocks:
                if room == 0:
                    chunks.append(SnapshotChunk(as_of, current, first=not chunks, last=False))
                    current = []
                    room = self._chunk_blocks
                part, blocks = blocks[:room], blocks[room:]
                current.append(BlocksStored(parent, part, chain.lora_name, chain.tier))
                parent = part[-1].block_hash
                room -= len(part)
        chunks.append(SnapshotChunk(as_of, current, first=not chunks, last=True))
        return chunks

    def events_since(self, after: int) -> list[KvEventRecord] | None:
        """The events with ids greater than `after`, or None when the backlog no longer holds
        all of them (or `after` is not an id this log has reached)."""
        last = self._last_id
        if after == last:
            return []
        backlog = self._backlog
        if after < 0 or after > last or not backlog or backlog[0].event_id > after + 1:
            return None
        return list(itertools.islice(backlog, after + 1 - backlog[0].event_id, None))

    async def subscribe(
        self, resume_after: int | None
    ) -> AsyncIterator[SnapshotChunk | KvEventRecord]:
        """Events after `resume_after` (or a snapshot when they are gone), then live events.

        Registration and the choice between replay and snapshot happen atomically on the first
        iteration. Closing the iterator (aclose, or the consuming task ending) unregisters it.
        """
        sub = _Subscriber(self._queue_limit)
        replay = self.events_since(resume_after) if resume_after is not None else None
        if replay is None:
            sub.resync = True
        else:
            sub.queue.extend(replay)
        self._subscribers.add(sub)
        try:
            while True:
                if sub.resync:
                    sub.resync = False
                    sub.queue.clear()
                    for chunk in self.snapshot():
                        yield chunk
                        if sub.resync:
                            break  # overflowed again while sending: start over
                    continue
                if sub.queue:
                    yield sub.queue.popleft()
                    continue
                sub.waiter = asyncio.get_running_loop().create_future()
                try:
                    await sub.waiter
                finally:
                    sub.waiter = None
        finally:
            self._subscribers.discard(sub)
