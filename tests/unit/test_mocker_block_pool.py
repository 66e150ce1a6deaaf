"""BlockPool: reference counts, LRU eviction order, prefix hits, dedupe, events, hashing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.runtime.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventLog,
    StoredBlock,
)
from kvmesh.workers.mocker import BlockPool, block_hash

pytestmark = pytest.mark.unit

BS = 4


def chain_hashes(tokens: list[int], lora: str = "") -> list[int]:
    out: list[int] = []
    parent: int | None = None
    for i in range(len(tokens) // BS):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS], lora)
        out.append(parent)
    return out


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate and cache blocks for `tokens` (a multiple of BS) like a request would."""
    n = len(tokens) // BS
    blocks = pool.allocate(n)
    pool.cache_full_blocks(blocks, chain_hashes(tokens), 0, n, tokens, "")
    return blocks


def test_block_hash_is_deterministic_and_chained() -> None:
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, (1, 2, 3, 4))
    assert a != block_hash(None, [1, 2, 3, 5])
    assert a != block_hash(None, [1, 2, 3, 4], "lora")
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert 0 < a < 2**64
    # Same value in another process (Python's hash() is salted per process; this is not).
    code = "from kvmesh.workers.mocker import block_hash; print(block_hash(None, [1, 2, 3, 4]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == a


def test_allocate_and_release_refcounts() -> None:
    pool = BlockPool(8, BS)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_used == 3 and pool.num_free == 5
    assert all(pool.ref_count(b) == 1 for b in a)
    pool.acquire(a[:1])
    assert pool.ref_count(a[0]) == 2
    pool.release(a)
    assert pool.num_used == 1 and pool.ref_count(a[0]) == 1
    pool.release(a[:1])
    assert pool.num_used == 0 and pool.num_free == 8
    with pytest.raises(RuntimeError):
        pool.allocate(9)
    assert pool.allocate(0) == []


def test_uncached_blocks_are_used_before_evicting_cached_ones() -> None:
    log = KvEventLog()
    pool = BlockPool(6, BS, events=log)
    tokens = list(range(8))
    hashes = chain_hashes(tokens)
    pool.release(fill(pool, tokens))  # 2 cached, unreferenced blocks
    assert pool.num_evictable == 2 and pool.num_free == 6
    pool.allocate(4)  # the 4 never-used blocks
    assert pool.num_cached == 2 and log.last_event_id == 1
    pool.allocate(1)  # now one cached block must go: the chain's tail first
    assert set(pool.cached_blocks()) == {hashes[0]}
    (removed,) = log.events_since(1) or []
    assert removed.kind == BlocksRemoved([hashes[1]])
    assert log.cached() == pool.cached_blocks()


def test_lru_eviction_order() -> None:
    log = KvEventLog()
    pool = BlockPool(6, BS, events=log)
    a = fill(pool, list(range(100, 108)))  # A0 A1
    b = fill(pool, list(range(200, 208)))  # B0 B1
    ha, hb = chain_hashes(list(range(100, 108))), chain_hashes(list(range(200, 208)))
    pool.release(a)  # released first: oldest
    pool.release(b)
    assert pool.lru_hashes() == [ha[1], ha[0], hb[1], hb[0]]  # tail of each chain first
    pool.allocate(2)  # two never-used blocks, no eviction
    assert pool.num_cached == 4
    pool.allocate(3)
    assert set(pool.cached_blocks()) == {hb[0]}
    assert log.cached() == pool.cached_blocks()


def test_prefix_hit_takes_blocks_out_of_the_lru() -> None:
    pool = BlockPool(8, BS)
    tokens = list(range(12))
    blocks = fill(pool, tokens)
    hashes = chain_hashes(tokens)
    pool.release(blocks)
    assert pool.num_free == 8
    hit = pool.match_prefix([*hashes[:2], 12345], 10)
    assert hit == blocks[:2]
    assert pool.count_evictable(hit) == 2
    pool.acquire(hit)
    assert pool.num_used == 2 and pool.num_free == 6 and pool.num_evictable == 1
    assert pool.match_prefix(hashes, 1) == blocks[:1]
    pool.acquire(hit[:1])  # a second request sharing the first block
    assert pool.ref_count(hit[0]) == 2 and pool.count_evictable(hit) == 0
    pool.release(hit[:1])
    pool.release(hit)
    assert pool.num_used == 0 and pool.num_evictable == 3


def test_duplicate_hash_shares_the_cached_copy() -> None:
    log = KvEventLog()
    pool = BlockPool(8, BS, events=log)
    tokens = list(range(8))
    first = fill(pool, tokens)
    second = pool.allocate(2)  # another request computed the same blocks privately
    pool.cache_full_blocks(second, chain_hashes(tokens), 0, 2, tokens, "")
    assert second == first  # swapped for the cached copies
    assert all(pool.ref_count(b) == 2 for b in first)
    assert pool.num_used == 2 and pool.num_free == 6
    assert log.last_event_id == 1  # nothing new entered the cache


def test_stored_events_carry_parent_and_tokens() -> None:
    log = KvEventLog()
    pool = BlockPool(8, BS, events=log)
    tokens = list(range(12))
    blocks = pool.allocate(3)
    hashes = chain_hashes(tokens)
    pool.cache_full_blocks(blocks, hashes, 0, 1, tokens, "")
    pool.cache_full_blocks(blocks, hashes, 1, 3, tokens, "")
    assert log.last_event_id == 2
    assert log.cached() == {
        hashes[0]: (None, (0, 1, 2, 3), ""),
        hashes[1]: (hashes[0], (4, 5, 6, 7), ""),
        hashes[2]: (hashes[1], (8, 9, 10, 11), ""),
    }
    assert log.cached() == pool.cached_blocks()
    first, second = log.events_since(0) or []
    assert first.kind == BlocksStored(None, [StoredBlock(hashes[0], (0, 1, 2, 3))])
    assert isinstance(second.kind, BlocksStored) and second.kind.parent_hash == hashes[0]


def test_clear_drops_only_unreferenced_blocks() -> None:
    log = KvEventLog()
    pool = BlockPool(8, BS, events=log)
    keep = fill(pool, list(range(4)))
    drop = fill(pool, list(range(50, 58)))
    pool.release(drop)
    assert pool.clear() == 2
    (ev,) = log.events_since(2) or []
    assert isinstance(ev.kind, BlocksRemoved) and len(ev.kind.block_hashes) == 2
    assert set(pool.cached_blocks()) == set(log.cached()) == {pool.hash_of(keep[0])}
    assert pool.clear() == 0 and log.last_event_id == 3  # idempotent, no empty event
    pool.release(keep)
    assert pool.clear() == 1
    (ev,) = log.events_since(3) or []
    assert isinstance(ev.kind, AllCleared)  # the cache is empty now
    assert log.cached() == {} and pool.cached_blocks() == {} and pool.num_free == 8


def test_caching_disabled_publishes_nothing() -> None:
    log = KvEventLog()
    pool = BlockPool(4, BS, enable_caching=False, events=log)
    tokens = list(range(8))
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, chain_hashes(tokens), 0, 2, tokens, "")
    assert pool.match_prefix(chain_hashes(tokens), 2) == []
    pool.release(blocks)
    assert pool.num_cached == 0 and log.last_event_id == 0 and pool.num_free == 4
