"""The router's global prefix index: chained block hash -> the workers holding that block.

`PrefixIndex` answers "how many leading blocks of this request does each worker hold?"
(`find_matches`). Because a block hash is chained (it covers every token before the block, see
kvmesh.router.hashing), a hash identifies a whole prefix, so the index is a flat map from hash to
the set of workers holding it, with the set stored as an int bitmask (worker -> bit). That keeps
the prefix-tree semantics of a radix tree (a hash's parent is implied by the hash) at the cost of
one dict entry per distinct block, and each update touches one entry per block.

Queries are sub-linear in the prompt length. A worker "has holes" when it holds a block without
holding the block's parent (an engine may evict a parent and keep the child). A worker without
holes holds, with each block, the block's whole prefix; so along a query the set of such workers
holding block k only shrinks as k grows, and the depth at which each of them stops is found by
binary search: a few dict lookups per distinct stopping depth instead of one per block. Workers
that may have holes are walked block by block, which is exact for them.

Whether a worker may have holes is tracked conservatively: storing a chain below a parent the
worker lacks, or removing blocks without the caller's word that they were leaves, flags it; the
caller, which knows the worker's block tree (kvmesh.router.kv_state keeps it per worker), clears
the flag with `set_holes(worker, False)`. A wrong flag never makes answers wrong, only slower;
clearing it while the worker does have holes does.

Pure standard library and no kvmesh imports: the benchmark harness of the peer comparison loads
this file on its own (see tests/benchmarks/bench_indexer.py).

Complexities (B = blocks in the call, D = distinct stopping depths of the answer):
  apply_stored O(B), apply_removed O(B), remove_worker O(blocks it holds) when they are given,
  find_matches O(D log B) for workers without holes plus O(matched blocks) for the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from itertools import islice
from typing import Generic, TypeVar

__all__ = ["ApproxIndex", "InflightIndex", "PrefixIndex"]

W = TypeVar("W", bound=Hashable)


class PrefixIndex(Generic[W]):
    """Block hash -> workers that hold the block (exact, fed by KV events).

    Contract:
      * `apply_stored(worker, hashes, parent)`: `worker` now holds `hashes`, a chain (each block's
        parent is the previous one; the first one's parent is `parent`, None when the chain
        starts at the root). Storing an already held hash is a no-op. Hashes must be chained
        (a hash determines its parent), as kvmesh.router.hashing makes them.
      * `apply_removed(worker, hashes, leaves=False)`: `worker` no longer holds `hashes` (unknown
        ones are ignored). Children it still holds stay (unreachable for it: holes). With
        `leaves=True` the caller promises that, after the call, the worker holds no block whose
        parent it lacks (only then does the worker stay "without holes").
      * `set_holes(worker, flag)`: the caller's exact knowledge of whether the worker has holes.
      * `remove_worker(worker)`: forget everything about `worker`.
      * `find_matches(hashes)` -> {worker: n}: n >= 1 is the number of leading blocks of the query
        chain `hashes` the worker holds; the count stops at the first block it lacks. Workers
        with no leading block are absent.

    Worker ids are any hashable values; each live worker takes one bit of the masks (bits are
    reused after `remove_worker`). Not thread-safe: use it from one thread (the event loop).
    """

    name = "kvmesh-prefix-index"
    """Label for the peer benchmark harness (radix_bench.py)."""

    __slots__ = ("_dirty", "_free", "_masks", "_slot", "_workers")

    def __init__(self, num_workers: int = 0) -> None:
        """`num_workers` is a capacity hint only (the benchmark harness passes it)."""
        self._masks: dict[int, int] = {}
        """Block hash -> bitmask of the workers holding it (never 0: empty entries are deleted)."""
        self._slot: dict[W, int] = {}
        self._workers: list[W] = []
        """Bit position -> worker (stale for freed positions, whose bits are all clear)."""
        self._dirty = 0
        """Bitmask of the workers that may have holes (walked block by block)."""
        self._free: list[int] = []

    # -- membership -------------------------------------------------------------------------

    def _register(self, worker: W) -> int:
        if self._free:
            slot = self._free.pop()
            self._workers[slot] = worker
        else:
            slot = len(self._workers)
            self._workers.append(worker)
        self._slot[worker] = slot
        return slot

    def workers(self) -> list[W]:
        """Workers that stored a block and were not removed since."""
        return list(self._slot)

    def num_blocks(self, worker: W | None = None) -> int:
        """Distinct hashes held by anyone (worker None: O(1)), or by `worker` (a full scan)."""
        if worker is None:
            return len(self._masks)
        slot = self._slot.get(worker)
        if slot is None:
            return 0
        bit = 1 << slot
        return sum(1 for m in self._masks.values() if m & bit)

    def holds(self, worker: W, block_hash: int) -> bool:
        """Whether `worker` holds `block_hash`."""
        slot = self._slot.get(worker)
        return slot is not None and bool(self._masks.get(block_hash, 0) >> slot & 1)

    def may_have_holes(self, worker: W) -> bool:
        """Whether `worker` is walked block by block (see the module doc)."""
        slot = self._slot.get(worker)
        return slot is not None and bool(self._dirty >> slot & 1)

    def __len__(self) -> int:
        return len(self._masks)

    # -- updates ----------------------------------------------------------------------------

    def apply_stored(
        self, worker: W, block_hashes: Sequence[int], parent: int | None = None
    ) -> None:
        """`worker` now holds the chain `block_hashes`, whose first block follows `parent`."""
        slot = self._slot.get(worker)
        if slot is None:
            slot = self._register(worker)
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        if parent is not None and not get(parent, 0) & bit:
            self._dirty |= bit  # the chain hangs below a block the worker lacks: a hole
        for h in block_hashes:  # one touch per entry: faster than C-level multi-pass variants
            masks[h] = get(h, 0) | bit

    def apply_removed(
        self, worker: W, block_hashes: Iterable[int], *, leaves: bool = False
    ) -> None:
        """`worker` no longer holds `block_hashes`; hashes it does not hold are ignored."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        for h in block_hashes:
            m = get(h, 0)
            if m & bit:
                m ^= bit
                if m:
                    masks[h] = m
                else:
                    del masks[h]
        if not leaves:
            self._dirty |= bit

    def set_holes(self, worker: W, holes: bool) -> None:
        """Record whether `worker` has holes (False is a promise: see the module doc)."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        if holes:
            self._dirty |= 1 << slot
        else:
            self._dirty &= ~(1 << slot)

    def remove_worker(self, worker: W, held: Iterable[int] | None = None) -> None:
        """Forget `worker` and every block it holds.

        `held`: the hashes the worker holds, when the caller knows them (then this costs
        O(len(held)) instead of a scan of the whole index).
        """
        slot = self._slot.pop(worker, None)
        if slot is None:
            return
        bit = 1 << slot
        masks = self._masks
        if held is None:
            held = [h for h, m in masks.items() if m & bit]
        get = masks.get
        for h in held:
            m = get(h, 0)
            if m & bit:
                m ^= bit
                if m:
                    masks[h] = m
                else:
                    del masks[h]
        self._dirty &= ~bit
        self._free.append(slot)

    def clear(self) -> None:
        """Forget every worker."""
        self._masks.clear()
        self._slot.clear()
        self._workers.clear()
        self._dirty = 0
        self._free.clear()

    # -- queries ----------------------------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int]) -> dict[W, int]:
        """{worker: leading blocks of the chain `block_hashes` it holds} (see the class doc)."""
        n = len(block_hashes)
        if n == 0:
            return {}
        get = self._masks.get
        active = get(block_hashes[0], 0)
        if not active:
            return {}
        workers = self._workers
        scores: dict[W, int] = {}
        dirty = active & self._dirty
        if dirty:  # workers with holes: walk block by block
            active ^= dirty
            depth = 1
            for h in islice(block_hashes, 1, None):
                nxt = dirty & get(h, 0)
                if nxt != dirty:
                    gone = dirty ^ nxt
                    while gone:
                        low = gone & -gone
                        scores[workers[low.bit_length() - 1]] = depth
                        gone ^= low
                    dirty = nxt
                    if not dirty:
                        break
                depth += 1
            while dirty:
                low = dirty & -dirty
                scores[workers[low.bit_length() - 1]] = n
                dirty ^= low
        # Workers without holes: the set holding block k shrinks with k; binary-search each
        # depth where it shrinks. Invariant: every worker in `active` holds block lo - 1.
        lo = 1
        while active:
            if get(block_hashes[n - 1], 0) & active == active:
                depth, gone, active = n, active, 0
            else:
                hi = n  # some worker in `active` lacks block hi - 1
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if get(block_hashes[mid - 1], 0) & active == active:
                        lo = mid
                    else:
                        hi = mid
                nxt = get(block_hashes[hi - 1], 0) & active
                depth, gone, active = lo, active ^ nxt, nxt
                lo = hi
            while gone:
                low = gone & -gone
                scores[workers[low.bit_length() - 1]] = depth
                gone ^= low
        return scores


class ApproxIndex(Generic[W]):
    """A PrefixIndex fed by the router's own decisions, each entry forgotten after `ttl_s`.

    For workers whose engine publishes no KV events ("approximate mode", like Dynamo's
    `--no-kv-events` with its 120 s TTL): `insert(worker, hashes, now)` records that the worker
    was sent the prompt whose block hashes (from the root) are `hashes`; a later insert of the
    same hash refreshes it. `now` is any monotonic time in seconds (wall or virtual) and must
    never decrease between calls.
    """

    __slots__ = ("_expiry", "_queue", "index", "ttl_s")

    def __init__(self, ttl_s: float = 120.0) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self.index: PrefixIndex[W] = PrefixIndex()
        self._expiry: dict[W, dict[int, float]] = {}
        self._queue: deque[tuple[float, W, Sequence[int]]] = deque()

    def insert(self, worker: W, block_hashes: Sequence[int], now: float) -> None:
        """`worker` was sent a prompt with these block hashes (a chain from the root) at `now`."""
        self.expire(now)
        if not block_hashes:
            return
        until = now + self.ttl_s
        expiry = self._expiry.get(worker)
        if expiry is None:
            expiry = self._expiry[worker] = {}
        expiry.update(dict.fromkeys(block_hashes, until))
        self.index.apply_stored(worker, block_hashes, None)
        self._queue.append((until, worker, block_hashes))

    def expire(self, now: float) -> None:
        """Drop entries whose TTL ended at or before `now`."""
        queue = self._queue
        if not queue or queue[0][0] > now:
            return
        dead: dict[W, list[int]] = {}
        while queue and queue[0][0] <= now:
            until, worker, hashes = queue.popleft()
            expiry = self._expiry.get(worker)
            if expiry is None:
                continue
            gone = [h for h in hashes if expiry.get(h) == until]
            for h in gone:
                del expiry[h]
            dead.setdefault(worker, []).extend(gone)
        # A block is refreshed with every prompt that contains it, so it never expires before
        # its descendants: once all expired entries are gone, no worker has holes.
        for worker, gone in dead.items():
            self.index.apply_removed(worker, gone, leaves=True)

    def find_matches(self, block_hashes: Sequence[int], now: float) -> dict[W, int]:
        """Like PrefixIndex.find_matches over the entries still alive at `now`."""
        self.expire(now)
        return self.index.find_matches(block_hashes)

    def remove_worker(self, worker: W) -> None:
        """Forget `worker` (its queued expiries are skipped later)."""
        self._expiry.pop(worker, None)
        self.index.remove_worker(worker)

    def num_blocks(self, worker: W | None = None) -> int:
        """Distinct hashes (worker None), or `worker`'s entries (a scan; see num_live)."""
        return self.index.num_blocks(worker)

    def num_live(self, worker: W) -> int:
        """`worker`'s entries not expired as of the last call that took `now` (O(1))."""
        expiry = self._expiry.get(worker)
        return 0 if expiry is None else len(expiry)


class InflightIndex(Generic[W]):
    """Per worker, the prompt blocks that requests routed there will compute and have not yet:
    block hash -> how many such requests.

    A worker publishes a prompt's blocks only once it has computed them, so a request arriving
    while an earlier one with the same prefix still waits or prefills there (the next turn of a
    tool loop, the rest of a burst sharing a new system prompt) finds no cached prefix anywhere;
    KvScheduler credits the prefix the worker is computing already. `add(worker, hashes)` with
    the blocks a booked request will compute there (its prompt's chain after the prefix the
    worker holds), `remove` with the same hashes at its first token (or when it ends first).
    `extend(worker, hashes, start)` continues a prefix match found in the KV index (`start`
    leading blocks) through the blocks being computed: one lookup when there are none, so the
    routing cost per request stays flat.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[W, dict[int, int]] = {}

    def add(self, worker: W, block_hashes: Sequence[int]) -> None:
        """A request booked on `worker` will compute these blocks."""
        if not block_hashes:
            return
        counts = self._counts.get(worker)
        if counts is None:
            counts = self._counts[worker] = {}
        get = counts.get
        for h in block_hashes:
            counts[h] = get(h, 0) + 1

    def remove(self, worker: W, block_hashes: Sequence[int]) -> None:
        """The request that added these blocks on `worker` left prefill."""
        counts = self._counts.get(worker)
        if counts is None:
            return
        get = counts.get
        for h in block_hashes:
            n = get(h, 0)
            if n > 1:
                counts[h] = n - 1
            elif n:
                del counts[h]
        if not counts:
            del self._counts[worker]

    def extend(self, worker: W, block_hashes: Sequence[int], start: int) -> int:
        """`start` plus the blocks of `block_hashes` from index `start` on, in order, that
        requests on `worker` are computing."""
        counts = self._counts.get(worker)
        if counts is None:
            return start
        n = len(block_hashes)
        depth = start
        while depth < n and block_hashes[depth] in counts:
            depth += 1
        return depth

    def remove_worker(self, worker: W) -> None:
        """Forget `worker`."""
        self._counts.pop(worker, None)

    def __len__(self) -> int:
        """Workers with blocks being computed."""
        return len(self._counts)
