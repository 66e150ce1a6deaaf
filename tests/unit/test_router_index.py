"""The prefix index, the approximate (TTL) index and the event-fed KvIndexer.

Property tests drive them with random operation sequences and compare every answer with a
brute-force model: a worker's score is the number of leading query blocks it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.router.hashing import block_hashes
from kvmesh.router.indexer import ApproxIndex, InflightIndex, PrefixIndex
from kvmesh.router.kv_state import KvIndexer
from kvmesh.runtime import wire
from kvmesh.runtime.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventGap,
    KvEventLog,
    KvEventRecord,
    KvTier,
    SnapshotChunk,
    StoredBlock,
)
from kvmesh.workers.mocker import block_hash as engine_hash

pytestmark = pytest.mark.unit


def brute(held: dict[str, set[int]], query: Sequence[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for w, hs in held.items():
        n = 0
        while n < len(query) and query[n] in hs:
            n += 1
        if n:
            out[w] = n
    return out


# -- PrefixIndex ----------------------------------------------------------------------------


def test_prefix_index_basics() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    assert idx.find_matches([]) == {}
    assert idx.find_matches([1, 2]) == {}
    idx.apply_stored("a", [1, 2, 3])
    idx.apply_stored("b", [1, 2])
    idx.apply_stored("b", [7], parent=2)
    assert idx.find_matches([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.find_matches([1, 2, 7]) == {"a": 2, "b": 3}
    assert idx.find_matches([5, 1]) == {}
    assert len(idx) == 4 and idx.num_blocks("a") == 3 and idx.num_blocks() == 4
    assert idx.holds("b", 7) and not idx.holds("a", 7) and not idx.holds("zz", 1)
    idx.apply_removed("a", [2, 99])  # a keeps 3 below a missing 2: a hole
    assert idx.may_have_holes("a")
    assert idx.find_matches([1, 2, 3]) == {"a": 1, "b": 2}
    idx.apply_removed("nobody", [1])
    idx.remove_worker("b")
    assert idx.find_matches([1, 2, 7]) == {"a": 1}
    assert idx.workers() == ["a"]
    idx.apply_stored("c", [1])  # reuses b's bit
    assert idx.find_matches([1]) == {"a": 1, "c": 1}
    idx.remove_worker("a", held=[1, 3])
    assert idx.find_matches([1, 2, 3]) == {"c": 1} and len(idx) == 1
    idx.clear()
    assert len(idx) == 0 and idx.workers() == []


def test_chain_below_a_missing_parent_is_a_hole_until_cleared() -> None:
    idx: PrefixIndex[int] = PrefixIndex()
    idx.apply_stored(0, [5, 6], parent=4)
    assert idx.may_have_holes(0)
    assert idx.find_matches([3, 4, 5, 6]) == {}
    idx.apply_stored(0, [3, 4])
    idx.set_holes(0, False)  # the caller knows the tree is whole again
    assert idx.find_matches([3, 4, 5, 6, 9]) == {0: 4}
    idx.set_holes(42, True)  # unknown worker: ignored


def test_many_workers_and_stopping_depths() -> None:
    idx: PrefixIndex[int] = PrefixIndex(num_workers=100)
    chain = list(range(1000, 1300))
    for w in range(100):
        idx.apply_stored(w, chain[: 3 * w + 1])
    want = {w: 3 * w + 1 for w in range(100)}
    assert idx.find_matches(chain) == want
    assert idx.find_matches([*chain, 1]) == want


NODES = 10

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"), st.integers(0, 2), st.integers(0, NODES - 1), st.integers(1, 8)
        ),
        st.tuples(
            st.just("remove"), st.integers(0, 2), st.integers(0, NODES - 1), st.integers(1, 3)
        ),
        st.tuples(st.just("drop"), st.integers(0, 2), st.just(0), st.just(0)),
        st.tuples(st.just("find"), st.integers(0, NODES - 1), st.integers(0, 3), st.just(0)),
    ),
    max_size=40,
)


def tree_paths(parents: list[int | None]) -> list[list[int]]:
    """Path from the root to every node (node ids are the hashes, +1 so 0 is never used)."""
    paths: list[list[int]] = []
    for node, p in enumerate(parents):
        paths.append([*(paths[p] if p is not None else []), node + 1])
    return paths


parents_st = st.lists(st.integers(0, 100), min_size=NODES, max_size=NODES).map(
    lambda xs: [None if i == 0 or x % 4 == 0 else x % i for i, x in enumerate(xs)]
)


@given(parents_st, ops, st.booleans())
@settings(max_examples=300, deadline=None)
def test_prefix_index_matches_brute_force(
    parents: list[int | None], operations: list[tuple[str, int, int, int]], exact_holes: bool
) -> None:
    paths = tree_paths(parents)
    idx: PrefixIndex[str] = PrefixIndex()
    held: dict[str, set[int]] = {}
    for op, a, b, c in operations:
        if op == "store":
            w, path = f"w{a}", paths[b]
            start = 0 if c > 2 else max(0, len(path) - c)  # from the root, or below a parent
            idx.apply_stored(w, path[start:], path[start - 1] if start else None)
            held.setdefault(w, set()).update(path[start:])
        elif op == "remove":  # c == 1: a path's last c blocks, else one block the worker holds
            w, mine = f"w{a}", sorted(held.get(f"w{a}", ()))
            gone = paths[b][-c:] if c == 1 or not mine else [mine[b % len(mine)]]
            idx.apply_removed(w, gone)
            held.setdefault(w, set()).difference_update(gone)
        elif op == "drop":
            idx.remove_worker(f"w{a}")
            held.pop(f"w{a}", None)
        else:
            query = paths[a] + [10_000 + i for i in range(b)]
            assert idx.find_matches(query) == brute(held, query)
        if exact_holes:  # what KvIndexer does: tell the index the exact truth
            for w, hs in held.items():
                holes = any(p is not None and p + 1 not in hs for p in (parents[h - 1] for h in hs))
                idx.set_holes(w, holes)
    for path in paths:
        assert idx.find_matches(path) == brute(held, path)


# -- ApproxIndex ----------------------------------------------------------------------------


def test_approx_index_expires_after_ttl_and_refreshes() -> None:
    idx: ApproxIndex[str] = ApproxIndex(ttl_s=10.0)
    idx.insert("a", [1, 2, 3], now=0.0)
    idx.insert("b", [1, 2], now=5.0)
    assert idx.find_matches([1, 2, 3], now=9.0) == {"a": 3, "b": 2}
    idx.insert("a", [1, 2], now=9.0)  # refresh the prefix only
    assert idx.find_matches([1, 2, 3], now=10.0) == {"a": 2, "b": 2}
    assert idx.find_matches([1, 2, 3], now=15.0) == {"a": 2}
    assert idx.find_matches([1, 2, 3], now=19.0) == {}
    assert idx.num_blocks() == 0
    idx.insert("c", [], now=20.0)
    idx.insert("c", [4], now=20.0)
    idx.remove_worker("c")
    assert idx.find_matches([4], now=21.0) == {}
    assert idx.find_matches([4], now=40.0) == {}  # its queued expiry is skipped
    with pytest.raises(ValueError):
        ApproxIndex(ttl_s=0)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, NODES - 1), st.floats(0, 5)),
        min_size=1,
        max_size=40,
    ),
    parents_st,
)
@settings(max_examples=150, deadline=None)
def test_approx_index_matches_a_ttl_model(
    inserts: list[tuple[int, int, float]], parents: list[int | None]
) -> None:
    paths = tree_paths(parents)
    idx: ApproxIndex[str] = ApproxIndex(ttl_s=7.0)
    expiry: dict[str, dict[int, float]] = {}
    now = 0.0
    for w, node, dt in inserts:
        now += dt
        idx.insert(f"w{w}", paths[node], now)
        expiry.setdefault(f"w{w}", {}).update(dict.fromkeys(paths[node], now + 7.0))
        for path in paths:
            held = {k: {h for h, t in v.items() if t > now} for k, v in expiry.items()}
            assert idx.find_matches(path, now) == brute(held, path)


# -- KvIndexer --------------------------------------------------------------------------------

BS = 4


@dataclass
class FakeEngine:
    """Publishes KV events like an engine with prefix caching: runs of new blocks with their
    parent; per-block eviction (children may stay); clears."""

    log: KvEventLog = field(default_factory=lambda: KvEventLog(backlog=64))
    cached: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Engine hash -> the prompt prefix (tokens) up to and including the block."""

    def store(self, tokens: list[int], lora: str = "") -> None:
        run: list[StoredBlock] = []
        run_parent: int | None = None
        parent: int | None = None
        for i in range(len(tokens) // BS):
            block = tuple(tokens[i * BS : (i + 1) * BS])
            h = engine_hash(parent, block, lora)
            if h in self.cached:
                if run:
                    self.log.publish(BlocksStored(run_parent, run, lora))
                    run = []
            else:
                if not run:
                    run_parent = parent
                run.append(StoredBlock(h, block))
                self.cached[h] = tuple(tokens[: (i + 1) * BS])
            parent = h
        if run:
            self.log.publish(BlocksStored(run_parent, run, lora))

    def evict(self, hashes: list[int]) -> None:
        gone = [h for h in hashes if h in self.cached]
        for h in gone:
            del self.cached[h]
        if gone:
            self.log.publish(BlocksRemoved(gone))

    def clear(self) -> None:
        self.cached.clear()
        self.log.publish(AllCleared())


def expected(engines: dict[str, FakeEngine], query_tokens: list[int]) -> dict[str, int]:
    held = {
        w: {block_hashes(list(prefix), BS)[-1] for prefix in e.cached.values()}
        for w, e in engines.items()
    }
    return brute(held, block_hashes(query_tokens, BS))


def feed_all(indexer: KvIndexer, worker: str, log: KvEventLog, after: int) -> int:
    """Apply the log's events after `after` (as the stream would deliver them)."""
    events = log.events_since(after)
    assert events is not None
    for rec in events:
        indexer.apply(worker, rec)
    return log.last_event_id


def feed_snapshot(indexer: KvIndexer, worker: str, log: KvEventLog) -> int:
    for chunk in log.snapshot():
        indexer.apply(worker, chunk, log.log_id)
    return log.last_event_id


prompts_st = st.tuples(
    st.lists(st.integers(0, 3), min_size=28, max_size=28),
    st.lists(st.tuples(st.integers(0, 28), st.integers(0, 12)), min_size=3, max_size=6),
).map(lambda t: [t[0][:cut] + [100 + i] * extra for i, (cut, extra) in enumerate(t[1])])
"""Prompts that share prefixes of a common base (up to 7 blocks), then diverge."""

engine_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "evict", "evict", "evict_tail", "query"]),
        st.integers(0, 2),
        st.integers(0, 5),
        st.integers(0, 6),
    ),
    max_size=50,
)


@given(prompts_st, engine_ops, st.integers(0, 50))
@settings(max_examples=200, deadline=None)
def test_kv_indexer_matches_the_engines_caches(
    prompts: list[list[int]], operations: list[tuple[str, int, int, int]], join_at: int
) -> None:
    engines = {f"w{i}": FakeEngine() for i in range(3)}
    live = KvIndexer()  # subscribed from the start
    late = KvIndexer()  # subscribes (snapshot) after `join_at` operations
    seen = dict.fromkeys(engines, 0)
    late_seen: dict[str, int] = {}
    for w, e in engines.items():
        live.add_worker(w, BS)
        seen[w] = feed_snapshot(live, w, e.log)
        late.add_worker(w, BS)
    late_snapshot_whole = True
    for step, (op, wi, pi, k) in enumerate(operations):
        w = f"w{wi}"
        engine = engines[w]
        prompt = prompts[pi % len(prompts)]
        if op == "store":
            engine.store(prompt)
        elif op in ("evict", "evict_tail"):
            hashes = list(engine.cached)
            if hashes:
                pick = (
                    hashes[k % len(hashes) :] if op == "evict_tail" else [hashes[k % len(hashes)]]
                )
                engine.evict(pick)
        elif op == "clear":
            engine.clear()
        for name, e in engines.items():
            seen[name] = feed_all(live, name, e.log, seen[name])
        if step == join_at:
            for name, e in engines.items():
                late_seen[name] = feed_snapshot(late, name, e.log)
                # A chain whose parent was evicted before the late subscriber joined cannot be
                # hashed by it (it never saw the parent's tokens).
                prefixes = set(e.cached.values())
                late_snapshot_whole &= all(len(p) == BS or p[:-BS] in prefixes for p in prefixes)
        elif late_seen:
            for name, e in engines.items():
                late_seen[name] = feed_all(late, name, e.log, late_seen[name])
        if op == "query":
            want = expected(engines, prompt)
            assert live.find_matches(block_hashes(prompt, BS)) == want
    for prompt in prompts:
        want = expected(engines, prompt)
        query = block_hashes(prompt, BS)
        assert live.find_matches(query) == want
        if late_seen and late_snapshot_whole:
            assert late.find_matches(query) == want
    for w, e in engines.items():
        stats = live.stats(w)
        assert stats.blocks == len(e.cached)
        assert stats.holes == live.index.may_have_holes(w) or not stats.blocks


def test_kv_indexer_stream_bookkeeping_and_gaps() -> None:
    eng = FakeEngine()
    idx = KvIndexer()
    idx.add_worker("w", BS)
    assert idx.resume_point("w") is None
    eng.store(list(range(12)))
    with pytest.raises(KvEventGap):  # an event before any snapshot
        idx.apply("w", KvEventRecord(1, AllCleared()))
    chunks = eng.log.snapshot()
    idx.apply("w", chunks[0], eng.log.log_id)
    assert idx.resume_point("w") == (1, eng.log.log_id)
    assert idx.find_matches(block_hashes(list(range(12)), BS)) == {"w": 3}
    eng.store(list(range(16)))
    eng.store([7] * 8)
    with pytest.raises(KvEventGap):  # skips event 2
        idx.apply("w", eng.log.events_since(2)[0])  # type: ignore[index]
    idx.reset_stream("w")
    assert idx.resume_point("w") is None
    # The old entries stay until the resync's snapshot replaces them.
    assert idx.find_matches(block_hashes(list(range(12)), BS)) == {"w": 3}
    with pytest.raises(KvEventGap):  # a continuation chunk without its first chunk
        idx.apply("w", SnapshotChunk(3, [], first=False, last=True))
    idx.apply("w", SnapshotChunk(3, [], first=True, last=False), eng.log.log_id)
    assert idx.resume_point("w") is None  # half a snapshot
    with pytest.raises(KvEventGap):  # an event inside a snapshot
        idx.apply("w", KvEventRecord(4, AllCleared()))
    idx.reset_stream("w")
    feed_snapshot(idx, "w", eng.log)
    assert idx.find_matches(block_hashes(list(range(16)), BS)) == {"w": 4}
    assert idx.find_matches(block_hashes([7] * 8, BS)) == {"w": 2}
    assert idx.stats("w").snapshots == 2 and idx.num_blocks("w") == 6
    idx.clear_worker("w")
    assert idx.find_matches(block_hashes(list(range(16)), BS)) == {}
    assert idx.resume_point("w") is None and idx.has_worker("w")
    idx.remove_worker("w")
    assert not idx.has_worker("w") and idx.worker_ids() == [] and idx.num_blocks("w") == 0
    with pytest.raises(KeyError):
        idx.apply("w", chunks[0])


def test_kv_indexer_direct_feed_lora_and_block_size_change() -> None:
    idx = KvIndexer()
    idx.add_worker("w", BS)
    idx.add_worker("w", BS)  # same size: kept
    assert idx.block_size("w") == BS
    tokens = list(range(8))
    b0 = tuple(tokens[:4])
    b1 = tuple(tokens[4:])
    e0 = engine_hash(None, b0, "lo")
    e1 = engine_hash(e0, b1, "lo")
    idx.apply_event("w", BlocksStored(None, [StoredBlock(e0, b0), StoredBlock(e1, b1)], "lo"))
    assert idx.find_matches(block_hashes(tokens, BS, "lo")) == {"w": 2}
    assert idx.find_matches(block_hashes(tokens, BS)) == {}
    # A child stored after its parent was evicted is still hashed (the mapping is retained).
    idx.apply_event("w", BlocksRemoved([e0]))
    e2 = engine_hash(e1, (9, 9, 9, 9), "lo")
    idx.apply_event("w", BlocksStored(e1, [StoredBlock(e2, (9, 9, 9, 9))], "lo"))
    idx.apply_event("w", BlocksStored(None, [StoredBlock(e0, b0)], "lo"))
    assert idx.find_matches(block_hashes([*tokens, 9, 9, 9, 9], BS, "lo")) == {"w": 3}
    # Malformed blocks are tracked but not indexed; an unknown parent cannot be hashed.
    idx.apply_event("w", BlocksStored(None, [StoredBlock(5, (1, 2))], ""))
    idx.apply_event("w", BlocksStored(12345, [StoredBlock(6, (1, 2, 3, 4))], ""))
    assert idx.stats("w").blocks == 5 and idx.stats("w").indexed_blocks == 3
    assert idx.stats("w").holes
    idx.add_worker("w", 8)  # another block size: a fresh start
    assert idx.find_matches(block_hashes([*tokens, 9, 9, 9, 9], BS, "lo")) == {}
    with pytest.raises(ValueError):
        idx.add_worker("x", 0)


def test_kv_indexer_keeps_presence_per_tier_and_credits_by_tier() -> None:
    """HOST/DISK blocks are kept per tier, apart from device blocks: a stored event on the host
    tier adds nothing to the device index, a removed event on the disk tier does not evict the
    device copy; `find_credits` counts a device block 1, then host and disk blocks by their
    weights. Tiers and kinds this version does not know are skipped (the stream stays in
    sequence, an unknown kind never clears the worker)."""
    tokens = list(range(16))
    blocks = [tuple(tokens[i : i + BS]) for i in range(0, 16, BS)]
    e: list[int] = []
    for b in blocks:
        e.append(engine_hash(e[-1] if e else None, b))

    def stored(i: int, tier: cpb.KvTier.ValueType) -> cpb.KvBlocksStored:
        msg = cpb.KvBlocksStored(blocks=[cpb.KvBlock(block_hash=e[i], token_ids=blocks[i])])
        msg.tier = tier
        if i:
            msg.parent_block_hash = e[i - 1]
        return msg

    snap = wpb.SubscribeKvEventsResponse(
        snapshot=wpb.KvSnapshotChunk(
            as_of_event_id=1,
            chains=[
                stored(0, cpb.KV_TIER_UNSPECIFIED),  # unspecified: the device
                stored(0, cpb.KV_TIER_HOST),
                stored(1, cpb.KV_TIER_HOST),
                stored(2, 9),  # a tier this version does not know
            ],
            first=True,
            last=True,
            log_id="L",
        )
    )
    chunk = wire.kv_item_from_pb(snap)
    assert isinstance(chunk, SnapshotChunk) and len(chunk.chains) == 3
    idx = KvIndexer(host_hit_weight=0.5, disk_hit_weight=0.25)
    idx.add_worker("w", BS)
    idx.apply("w", chunk, "L")
    query = block_hashes(tokens, BS)
    assert idx.find_matches(query) == {"w": 1}  # the device tier only
    assert idx.find_credits(query) == {"w": 1.5}  # + block 1 on the host

    def event(event_id: int, **kind: object) -> wpb.SubscribeKvEventsResponse:
        return wpb.SubscribeKvEventsResponse(event=cpb.KvEvent(event_id=event_id, **kind))  # type: ignore[arg-type]

    items = [
        wire.kv_item_from_pb(event(2, stored=stored(2, cpb.KV_TIER_DISK))),
        wire.kv_item_from_pb(
            event(3, removed=cpb.KvBlocksRemoved(block_hashes=[e[0]], tier=cpb.KV_TIER_DISK))
        ),
        wire.kv_item_from_pb(event(4, stored=stored(3, 7))),
        wire.kv_item_from_pb(wpb.SubscribeKvEventsResponse(event=cpb.KvEvent(event_id=5))),
    ]
    assert [i.reason for i in items if isinstance(i, wire.SkippedKvEvent)] == [
        "stored on tier 7",
        "unknown event kind",
    ]
    for item in items:
        idx.apply("w", item)
    assert idx.find_matches(query) == {"w": 1}
    assert idx.find_credits(query) == {"w": 1.75}  # device, host, disk
    assert idx.resume_point("w") == (5, "L")
    stats = idx.stats("w")
    assert (stats.skipped, stats.events, stats.blocks) == (2, 2, 1)
    assert (stats.host_blocks, stats.disk_blocks) == (2, 1)
    # The host copy of block 1 goes: the walk stops there (block 2 on disk is not reached).
    removed = cpb.KvBlocksRemoved(block_hashes=[e[1]], tier=cpb.KV_TIER_HOST)
    idx.apply("w", wire.kv_item_from_pb(event(6, removed=removed)))
    assert idx.find_credits(query) == {"w": 1.0}
    # Block 1 reaches the device (an onboarding): device 2, then disk block 2.
    idx.apply("w", wire.kv_item_from_pb(event(7, stored=stored(1, cpb.KV_TIER_DEVICE))))
    assert idx.find_matches(query) == {"w": 2}
    assert idx.find_credits(query) == {"w": 2.25}
    # A worker holding the prefix on its host tier only is credited too.
    idx.add_worker("h", BS)
    idx.apply_event("h", BlocksStored(None, [StoredBlock(e[0], blocks[0])], "", KvTier.HOST))
    assert idx.find_credits(query) == {"w": 2.25, "h": 0.5}
    # Clearing empties every tier.
    idx.apply("w", wire.kv_item_from_pb(event(8, cleared=cpb.KvAllCleared())))
    assert idx.find_credits(query) == {"h": 0.5}
    assert (idx.stats("w").host_blocks, idx.stats("w").disk_blocks) == (0, 0)
    idx.remove_worker("h")
    assert idx.find_credits(query) == {}


def test_kv_indexer_lower_tier_block_hashed_late() -> None:
    """A block stored on the host tier while its parent is unknown (no router hash), then on the
    disk tier once the parent is known: removing it from the host tier later must not touch the
    disk tier's count (replay hit a KeyError here), and the disk copy stays credited."""
    tokens = list(range(8))
    b0, b1 = tuple(tokens[:BS]), tuple(tokens[BS:])
    e0 = engine_hash(None, b0)
    e1 = engine_hash(e0, b1)
    idx = KvIndexer(host_hit_weight=0.5, disk_hit_weight=0.25)
    idx.add_worker("w", BS)
    idx.apply_event("w", BlocksStored(e0, [StoredBlock(e1, b1)], "", KvTier.HOST))
    idx.apply_event("w", BlocksStored(None, [StoredBlock(e0, b0)], "", KvTier.DISK))
    idx.apply_event("w", BlocksStored(e0, [StoredBlock(e1, b1)], "", KvTier.DISK))
    query = block_hashes(tokens, BS)
    assert idx.find_credits(query) == {"w": 0.5}
    idx.apply_event("w", BlocksRemoved([e1], KvTier.HOST))
    assert idx.find_credits(query) == {"w": 0.5}
    idx.apply_event("w", BlocksRemoved([e1], KvTier.DISK))
    assert idx.find_credits(query) == {"w": 0.25}
    assert (idx.stats("w").host_blocks, idx.stats("w").disk_blocks) == (0, 1)


def test_inflight_index_counts_blocks_per_worker_and_extends_matches() -> None:
    idx: InflightIndex[str] = InflightIndex()
    assert idx.extend("a", [1, 2, 3], 0) == 0 and len(idx) == 0
    idx.add("a", [1, 2, 3])
    idx.add("a", [1, 2])  # a second request computing the first two blocks too
    idx.add("b", [2, 3])  # b holds block 1 already
    assert [idx.extend("a", [1, 2, 3, 4], 0), idx.extend("b", [1, 2, 3, 4], 0)] == [3, 0]
    assert idx.extend("b", [1, 2, 3, 4], 1) == 3  # continues the KV index's match of 1
    assert idx.extend("a", [1, 2, 3], 3) == 3  # nothing past the end
    idx.remove("a", [1, 2, 3])  # the longer one's prefill ended: the shared part stays
    assert idx.extend("a", [1, 2, 3, 4], 0) == 2
    idx.remove("a", [1, 2])
    idx.remove("a", [1, 2])  # more removes than adds are ignored
    assert idx.extend("a", [1, 2, 3], 0) == 0 and len(idx) == 1
    idx.remove_worker("b")
    assert idx.extend("b", [1, 2], 1) == 1 and len(idx) == 0
