"""KvEventLog: ids, implied state, snapshots, subscriptions (replay, resume, overflow)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.runtime.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventGap,
    KvEventLog,
    KvEventRecord,
    KvStateMirror,
    SnapshotChunk,
    StoredBlock,
)

pytestmark = pytest.mark.unit

Item = SnapshotChunk | KvEventRecord


def chain(parent: int | None, *hashes: int, lora: str = "") -> BlocksStored:
    return BlocksStored(parent, [StoredBlock(h, (h, h + 1)) for h in hashes], lora)


async def take(it: AsyncIterator[Item], n: int) -> list[Item]:
    return [await asyncio.wait_for(anext(it), 1.0) for _ in range(n)]


async def nothing_pending(it: AsyncIterator[Item]) -> bool:
    try:
        await asyncio.wait_for(anext(it), 0.01)
    except TimeoutError:
        return True
    return False


def test_ids_start_at_one_and_increase() -> None:
    log = KvEventLog()
    assert log.last_event_id == 0
    assert log.publish(chain(None, 1)) == 1
    assert log.publish(BlocksRemoved([1])) == 2
    assert log.publish(AllCleared()) == 3
    assert log.last_event_id == 3


def test_implied_state() -> None:
    log = KvEventLog()
    log.publish(chain(None, 1, 2, 3, lora="a"))
    assert log.cached() == {1: (None, (1, 2), "a"), 2: (1, (2, 3), "a"), 3: (2, (3, 4), "a")}
    log.publish(BlocksRemoved([2, 99]))  # unknown hashes are ignored; children stay
    assert set(log.cached()) == {1, 3}
    assert log.cached()[3] == (2, (3, 4), "a")
    log.publish(AllCleared())
    assert log.cached() == {}
    assert len(log) == 0


def test_cached_returns_a_copy() -> None:
    log = KvEventLog()
    log.publish(chain(None, 1))
    log.cached().clear()
    assert set(log.cached()) == {1}


def test_empty_snapshot_is_one_chunk() -> None:
    log = KvEventLog()
    assert log.snapshot() == [SnapshotChunk(0, [], first=True, last=True)]
    log.publish(chain(None, 1))
    log.publish(AllCleared())
    assert log.snapshot() == [SnapshotChunk(2, [], first=True, last=True)]


def _order_ok(chunks: list[SnapshotChunk]) -> None:
    seen: set[int] = set()
    for c in chunks:
        for ch in c.chains:
            if ch.parent_hash is not None:
                assert ch.parent_hash in seen
            for b in ch.blocks:
                seen.add(b.block_hash)


def test_snapshot_parent_before_child_and_chunked() -> None:
    log = KvEventLog(snapshot_chunk_blocks=3)
    log.publish(chain(None, 1, 2, 3, 4, 5, 6, 7))  # one long chain, split over chunks
    log.publish(chain(3, 30, 31))  # a branch
    log.publish(chain(None, 100, lora="x"))
    log.publish(chain(100, 101, lora="y"))  # other adapter: own chain
    log.publish(BlocksRemoved([1]))
    log.publish(chain(None, 1))  # parent re-stored after its children: order is topological
    chunks = log.snapshot()
    assert chunks[0].first and chunks[-1].last
    assert all(not c.first for c in chunks[1:]) and all(not c.last for c in chunks[:-1])
    assert all(c.as_of_event_id == 6 for c in chunks)
    assert all(sum(len(ch.blocks) for ch in c.chains) <= 3 for c in chunks)
    assert sum(len(ch.blocks) for c in chunks for ch in c.chains) == len(log)
    _order_ok(chunks)
    mirror = KvStateMirror()
    for c in chunks:
        mirror.apply(c)
    assert mirror.state == log.cached()
    assert mirror.last_event_id == 6


def test_snapshot_survives_parent_cycles() -> None:
    log = KvEventLog()
    log.publish(chain(2, 1))
    log.publish(chain(1, 2))  # 1 -> 2 -> 1: only possible with hash collisions
    chunks = log.snapshot()
    mirror = KvStateMirror()
    for c in chunks:
        mirror.apply(c)
    assert mirror.state == log.cached()


async def test_subscribe_fresh_gets_snapshot_then_deltas() -> None:
    log = KvEventLog()
    log.publish(chain(None, 1, 2))
    it = log.subscribe(None)
    (snap,) = await take(it, 1)
    assert isinstance(snap, SnapshotChunk) and snap.first and snap.last and snap.as_of_event_id == 1
    assert log.num_subscribers == 1
    log.publish(chain(2, 3))
    log.publish(BlocksRemoved([1]))
    ev = await take(it, 2)
    assert [e.event_id for e in ev if isinstance(e, KvEventRecord)] == [2, 3]
    assert await nothing_pending(it)
    await it.aclose()  # type: ignore[attr-defined]
    assert log.num_subscribers == 0


async def test_resume_within_backlog_replays_without_snapshot() -> None:
    log = KvEventLog(backlog=10)
    for h in range(1, 6):
        log.publish(chain(None, h))
    it = log.subscribe(2)
    items = await take(it, 3)
    assert [i.event_id for i in items if isinstance(i, KvEventRecord)] == [3, 4, 5]
    log.publish(BlocksRemoved([5]))
    (live,) = await take(it, 1)
    assert isinstance(live, KvEventRecord) and live.event_id == 6
    await it.aclose()  # type: ignore[attr-defined]


async def test_resume_at_last_id_gets_only_live_events() -> None:
    log = KvEventLog()
    log.publish(chain(None, 1))
    it = log.subscribe(1)
    task = asyncio.ensure_future(anext(it))
    await asyncio.sleep(0)
    assert not task.done()
    log.publish(chain(1, 2))
    item = await asyncio.wait_for(task, 1.0)
    assert isinstance(item, KvEventRecord) and item.event_id == 2
    await it.aclose()  # type: ignore[attr-defined]


async def test_resume_at_zero_on_empty_log() -> None:
    log = KvEventLog()
    it = log.subscribe(0)
    log.publish(chain(None, 1))  # registration happens on the first iteration
    (item,) = await take(it, 1)
    assert isinstance(item, KvEventRecord) and item.event_id == 1
    await it.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize("resume_after", [1, 9, -1])
async def test_resume_too_old_or_in_the_future_gets_snapshot(resume_after: int) -> None:
    log = KvEventLog(backlog=3)
    for h in range(1, 7):
        log.publish(chain(None, h))
    it = log.subscribe(resume_after)
    (snap,) = await take(it, 1)
    assert isinstance(snap, SnapshotChunk) and snap.as_of_event_id == 6
    mirror = KvStateMirror()
    mirror.apply(snap)
    assert mirror.state == log.cached()
    await it.aclose()  # type: ignore[attr-defined]


async def test_resume_exactly_at_backlog_start() -> None:
    log = KvEventLog(backlog=3)
    for h in range(1, 7):
        log.publish(chain(None, h))  # backlog holds events 4, 5, 6
    it = log.subscribe(3)
    items = await take(it, 3)
    assert [i.event_id for i in items if isinstance(i, KvEventRecord)] == [4, 5, 6]
    await it.aclose()  # type: ignore[attr-defined]


async def test_slow_subscriber_gets_fresh_snapshot() -> None:
    log = KvEventLog(subscriber_queue_limit=4)
    it = log.subscribe(None)
    mirror = KvStateMirror()
    mirror.apply((await take(it, 1))[0])
    for h in range(1, 11):  # overflows the queue of 4
        log.publish(chain(None, h))
    (snap,) = await take(it, 1)
    assert isinstance(snap, SnapshotChunk) and snap.first and snap.as_of_event_id == 10
    mirror.apply(snap)
    log.publish(BlocksRemoved([3]))
    (ev,) = await take(it, 1)
    mirror.apply(ev)
    assert mirror.state == log.cached() and mirror.last_event_id == 11
    await it.aclose()  # type: ignore[attr-defined]


async def test_overflow_during_snapshot_restarts_it() -> None:
    log = KvEventLog(snapshot_chunk_blocks=1, subscriber_queue_limit=2)
    for h in range(1, 4):
        log.publish(chain(None, h))
    it = log.subscribe(None)
    mirror = KvStateMirror()
    first = (await take(it, 1))[0]
    assert isinstance(first, SnapshotChunk) and first.first and not first.last
    mirror.apply(first)
    for h in range(10, 14):  # overflow while the snapshot is being sent
        log.publish(chain(None, h))
    while mirror.last_event_id != log.last_event_id:
        mirror.apply((await take(it, 1))[0])
    assert mirror.state == log.cached()
    await it.aclose()  # type: ignore[attr-defined]


async def test_cancelled_consumer_unregisters() -> None:
    log = KvEventLog()

    async def consume() -> None:
        async for _ in log.subscribe(None):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    assert log.num_subscribers == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log.num_subscribers == 0


async def test_many_subscribers_see_the_same_stream() -> None:
    log = KvEventLog()
    its = [log.subscribe(None) for _ in range(3)]
    mirrors = [KvStateMirror() for _ in its]
    for it, m in zip(its, mirrors, strict=True):
        m.apply((await take(it, 1))[0])
    log.publish(chain(None, 1, 2))
    log.publish(BlocksRemoved([2]))
    for it, m in zip(its, mirrors, strict=True):
        for item in await take(it, 2):
            m.apply(item)
        assert m.state == log.cached()
        await it.aclose()  # type: ignore[attr-defined]
    assert log.num_subscribers == 0


def test_mirror_detects_gaps() -> None:
    m = KvStateMirror()
    m.resume_from({}, 5)
    m.apply(KvEventRecord(6, AllCleared()))
    with pytest.raises(KvEventGap):
        m.apply(KvEventRecord(8, AllCleared()))
    with pytest.raises(KvEventGap):
        KvStateMirror().apply(SnapshotChunk(1, [], first=False, last=True))


def test_zero_backlog_still_works() -> None:
    log = KvEventLog(backlog=0)
    log.publish(chain(None, 1))
    assert log.cached() == {1: (None, (1, 2), "")}
    with pytest.raises(ValueError):
        KvEventLog(snapshot_chunk_blocks=0)


def test_events_since() -> None:
    log = KvEventLog(backlog=2)
    assert log.events_since(0) == []
    for h in range(1, 5):
        log.publish(chain(None, h))
    assert [r.event_id for r in log.events_since(2) or []] == [3, 4]
    assert log.events_since(4) == []
    assert log.events_since(1) is None  # event 2 is gone
    assert log.events_since(5) is None
