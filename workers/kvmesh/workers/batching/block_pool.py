"""Paged KV block pool with reference counts, prefix caching and KV events.

Blocks are numbered 0..num_blocks-1. A block is
  * referenced (ref > 0): held by one or more running requests;
  * free and uncached: never used, or released without a hash; allocated first;
  * free and cached: released with a hash; kept in LRU order (oldest release first) so a later
    request with the same prefix can reuse it, and evicted only when no uncached free block is
    left.

A full block is cached under its chained hash (`block_hash`), which covers the block's tokens,
its parent's hash and (at the root) the LoRA adapter name, so equal prefixes hash equally in every
process. The pool holds at most one block per hash: when a request fills a block whose hash is
already cached, it drops its private copy and shares the cached one (like SGLang's radix cache;
vLLM keeps both copies). So every cache change is exactly one event:
  * a hash enters the cache -> BlocksStored (published per contiguous run, with parent + tokens);
  * a cached block is evicted or cleared -> BlocksRemoved / AllCleared.

Releasing a request's blocks pushes them to the LRU tail child-first, so a chain's tail is evicted
before its head, and a parent is never evicted while a cached child of it is referenced.

`on_cached`, when set, hears of every block cached under a new hash (after its BlocksStored):
the KV tiers below the pool (kvmesh.workers.batching.tiers) write them through to host memory.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from hashlib import blake2b

from kvmesh.runtime.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    CachedBlock,
    KvEventLog,
    StoredBlock,
)

__all__ = ["BlockPool", "block_hash"]

_MASK64 = (1 << 64) - 1
_BIG_ENDIAN = sys.byteorder == "big"


def block_hash(parent: int | None, tokens: Sequence[int], lora_name: str = "") -> int:
    """Chained, process-independent 64-bit hash of a full block (never 0).

    blake2b-64 over a tag, the parent hash (or the LoRA name at the root) and the token ids as
    little-endian int64.
    """
    h = blake2b(digest_size=8)
    if parent is None:
        h.update(b"R")
        h.update(lora_name.encode())
        h.update(b"\0")
    else:
        h.update(b"C")
        h.update((parent & _MASK64).to_bytes(8, "little"))
    tok = array("q", tokens)
    if _BIG_ENDIAN:  # pragma: no cover - hashes must not depend on the machine
        tok.byteswap()
    h.update(tok.tobytes())
    return int.from_bytes(h.digest(), "little") or 1


class BlockPool:
    """The KV block pool of one simulated engine (see the module docstring for the contract).

    `events`: where cache changes are published; None publishes nothing. With
    `enable_caching=False` nothing is ever cached and no event is published.
    """

    __slots__ = (
        "_cached",
        "_free",
        "_hash",
        "_lru",
        "_meta",
        "_num_used",
        "_ref",
        "block_size",
        "enable_caching",
        "events",
        "num_blocks",
        "on_cached",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        events: KvEventLog | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events = events if enable_caching else None
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> block, oldest first
        self._cached: dict[int, int] = {}  # hash -> block, referenced or not
        self._meta: dict[int, CachedBlock] = {}  # hash -> (parent, tokens, lora)
        self._num_used = 0
        self.on_cached: Callable[[list[int]], None] | None = None
        """Called with the block ids each cache_full_blocks call cached under new hashes."""

    # -- accounting ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (uncached free + evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached hash (referenced or in the LRU)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody references (the LRU)."""
        return len(self._lru)

    def ref_count(self, block_id: int) -> int:
        """References to `block_id`."""
        return self._ref[block_id]

    def hash_of(self, block_id: int) -> int | None:
        """The hash `block_id` is cached under, if any."""
        return self._hash[block_id]

    def meta_of(self, block_hash: int) -> CachedBlock:
        """(parent_hash, token_ids, lora_name) of a cached hash (KeyError if not cached)."""
        return self._meta[block_hash]

    def lru_hashes(self) -> list[int]:
        """Hashes of the evictable blocks, next to be evicted first."""
        return list(self._lru)

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """Every cached block: hash -> (parent_hash, token_ids, lora_name); same shape as
        KvEventLog.cached()."""
        return dict(self._meta)

    # -- prefix lookup -------------------------------------------------------------------------

    def match_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (at most `max_blocks`)."""
        if not self.enable_caching:
            return []
        cached = self._cached
        found: list[int] = []
        for h in hashes[:max_blocks]:
            bid = cached.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    def count_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` sit in the LRU (acquiring them lowers num_free)."""
        ref = self._ref
        return sum(1 for b in block_ids if ref[b] == 0)

    # -- allocation ----------------------------------------------------------------------------

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each of `block_ids` (cached blocks from match_prefix)."""
        ref, hashes, lru = self._ref, self._hash, self._lru
        for bid in block_ids:
            if ref[bid] == 0:
                h = hashes[bid]
                if h is not None:
                    del lru[h]
                self._num_used += 1
            ref[bid] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with one reference each: uncached free blocks first, then the
        least recently released cached blocks (each eviction publishes BlocksRemoved)."""
        if n > self.num_free:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free} free")
        if n <= 0:
            return []
        free, ref = self._free, self._ref
        out: list[int] = []
        evicted: list[int] = []
        take = min(n, len(free))
        if take:
            out = free[-take:]
            del free[-take:]
            out.reverse()
        if take < n:
            lru, cached, meta, hashes = self._lru, self._cached, self._meta, self._hash
            for _ in range(n - take):
                h, bid = lru.popitem(last=False)
                del cached[h]
                del meta[h]
                hashes[bid] = None
                evicted.append(h)
                out.append(bid)
        for bid in out:
            ref[bid] = 1
        self._num_used += n
        if evicted and self.events is not None:
            self.events.publish(BlocksRemoved(evicted))
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each of `block_ids`; blocks nobody references any more go to
        the LRU tail (cached, last block first) or back to the uncached free list."""
        ref, hashes, lru, free = self._ref, self._hash, self._lru, self._free
        for bid in reversed(block_ids):
            r = ref[bid] - 1
            ref[bid] = r
            if r == 0:
                self._num_used -= 1
                h = hashes[bid]
                if h is None:
                    free.append(bid)
                else:
                    lru[h] = bid
            elif r < 0:  # pragma: no cover - a bookkeeping bug, never expected
                raise RuntimeError(f"block {bid} released more often than referenced")

    def cache_full_blocks(
        self,
        blocks: list[int],
        hashes: Sequence[int],
        start: int,
        end: int,
        tokens: Sequence[int],
        lora_name: str,
    ) -> None:
        """Cache `blocks[start:end]`, now full, under `hashes[start:end]`.

        `tokens` is the request's whole token list (block i holds tokens[i*bs:(i+1)*bs]). A block
        whose hash is already cached is swapped, in `blocks`, for the cached copy. New hashes are
        published as BlocksStored, one event per contiguous run.
        """
        if not self.enable_caching or start >= end:
            return
        bs = self.block_size
        ref, bhash, cached, meta, lru = self._ref, self._hash, self._cached, self._meta, self._lru
        events = self.events
        run: list[StoredBlock] = []
        run_parent: int | None = None
        new: list[int] = []
        for i in range(start, end):
            h = hashes[i]
            bid = blocks[i]
            parent = hashes[i - 1] if i > 0 else None
            other = cached.get(h)
            if other is not None:
                if other != bid:
                    # Share the cached copy; our private block goes back to the free list.
                    if ref[bid] == 1 and bhash[bid] is None:
                        ref[bid] = 0
                        self._free.append(bid)
                        self._num_used -= 1
                    else:  # pragma: no cover - blocks reaching here are always private
                        self.release((bid,))
                    if ref[other] == 0:
                        del lru[h]
                        self._num_used += 1
                    ref[other] += 1
                    blocks[i] = other
                if run:
                    if events is not None:
                        events.publish(BlocksStored(run_parent, run, lora_name))
                    run = []
                continue
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            cached[h] = bid
            bhash[bid] = h
            meta[h] = (parent, toks, lora_name)
            new.append(bid)
            if not run:
                run_parent = parent
            run.append(StoredBlock(h, toks))
        if run and events is not None:
            events.publish(BlocksStored(run_parent, run, lora_name))
        if new and self.on_cached is not None:
            self.on_cached(new)

    def clear(self) -> int:
        """Drop every unreferenced cached block; returns how many. Publishes AllCleared when
        that empties the cache, else BlocksRemoved for the dropped hashes (nothing if none)."""
        if not self._lru:
            return 0
        dropped = list(self._lru)
        hashes, cached, meta, free = self._hash, self._cached, self._meta, self._free
        for h, bid in self._lru.items():
            del cached[h]
            del meta[h]
            hashes[bid] = None
            free.append(bid)
        self._lru.clear()
        if self.events is not None:
            self.events.publish(AllCleared() if not cached else BlocksRemoved(dropped))
        return len(dropped)
