"""Tiered KV cache below the device pool: a host-memory tier and a disk tier, shared by the
mocker and the torch engine (and simulated by `kvmesh replay` with this same code).

`KvTiers` is the synchronous bookkeeping (no asyncio, no clock, no I/O), owned by the
BatchScheduler; it decides what moves and emits `TierJob`s that the engine executes
(BatchingEngine `_move_kv`: the mocker waits a modelled transfer time, the torch engine copies KV
tensors and block files, the replay advances virtual time) and reports back with
`BatchScheduler.complete_tier_job(job, done)`.

Policy
  * Write-through offload: every block the device pool caches is copied to the host tier unless
    the host tier holds it already (then it only becomes most recently used there). The copy is
    an OFFLOAD job, off the decode path; the device block holds one more reference until it is
    done, so it is neither evicted nor overwritten meanwhile. A device hit refreshes the block's
    host copy too, so blocks hot on the device keep their host copies.
  * The host tier holds `kv_host_blocks` blocks in LRU order. A block it evicts moves to the
    disk tier (a DEMOTE job writes it from its host slot, which is reused once written) unless
    the disk holds it already or there is no disk tier; at most `demote_limit` such moves are
    in flight (beyond that, evicted blocks are dropped: the disk cannot keep up). The host
    memory has `host_slots` = kv_host_blocks + demote_limit slots (with a disk tier), so blocks
    being written to disk never hold back an offload.
  * The disk tier holds `kv_disk_blocks` blocks in LRU order; evicting one deletes its file (a
    DROP job). Blocks found on disk at start (the torch engine's block files) are loaded.
  * Onboarding: where a waiting request's cached device prefix ends, `match` finds the blocks
    that follow on the host tier (preferred) or the disk tier, up to the first block on
    neither (only blocks whose copy into the tier is done count). The scheduler allocates
    device blocks and an ONBOARD job per source tier copies them in; the request waits (others
    run) and then prefills the rest. A block that cannot be read (a corrupted or missing file)
    ends the onboarded run there; it is dropped from its tier and the rest of the prompt is
    recomputed. Host blocks being onboarded are pinned: the host tier does not evict them.
  * Events: a block entering the host or disk tier is published (BlocksStored on that tier)
    once its copy is done; leaving it, at once (BlocksRemoved). A move down is therefore a
    stored event on the lower tier and a removed event on the upper one.

Lanes: jobs run on four lanes, side by side, each strictly in order (`Lane`): device to host
(OFFLOAD), host to device (ONBOARD from the host tier), disk writes (DEMOTE, DROP) and disk reads
(ONBOARD from the disk tier), like a GPU's two copy engines and an NVMe queue per direction, so
an onboarding never waits behind offloads or writes to disk. What makes that safe without locks:
  * a device block a job reads or writes holds a reference of the job until it completes;
  * a host slot is reused only when nothing will read it: its block was never onboarded or
    moved to disk (then only a later OFFLOAD, on the same lane as the one that was writing it,
    rewrites it), or after the DEMOTE reading it finished, or once the onboardings pinning its
    block finished; readers only read blocks whose OFFLOAD finished;
  * block files are named by block hash, so a file always holds that block's KV (written under a
    temporary name, renamed into place): a read racing a rewrite reads the same bytes, one racing
    a deletion finds no file and the block is recomputed. Reads only read blocks whose DEMOTE
    finished.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.runtime.config import opt
from kvmesh.runtime.kv_events import (
    BlocksRemoved,
    BlocksStored,
    CachedBlock,
    KvEventLog,
    KvTier,
    StoredBlock,
)
from kvmesh.runtime.types import KvTierStats
from kvmesh.workers.batching.block_pool import BlockPool

__all__ = ["KvTierConfig", "KvTiers", "Lane", "Onboarding", "TierJob", "TierOp"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KvTierConfig:
    """KV cache tiers below the device pool (the mocker and the torch engine; see
    kvmesh.workers.batching.tiers). None set: no tiers, the device pool only."""

    kv_host_blocks: int = opt(
        0, "host-memory KV tier below the device pool: how many blocks it holds (0: no host tier)"
    )
    kv_disk_dir: str = opt(
        "",
        "disk KV tier: the directory of its block files (the torch engine; the mocker simulates "
        "its disk and writes nothing)",
    )
    kv_disk_blocks: int = opt(
        0,
        "disk KV tier below the host tier: how many blocks it holds (0: no disk tier; needs "
        "--kv-host-blocks)",
    )

    def __post_init__(self) -> None:
        if self.kv_host_blocks < 0 or self.kv_disk_blocks < 0:
            raise ValueError("kv_host_blocks and kv_disk_blocks must be >= 0")
        if self.kv_disk_blocks and not self.kv_host_blocks:
            raise ValueError(
                "a disk KV tier (--kv-disk-blocks) needs a host tier (--kv-host-blocks)"
            )
        if self.kv_disk_dir and not self.kv_disk_blocks:
            raise ValueError(
                "--kv-disk-dir needs --kv-disk-blocks (the disk tier's size in blocks)"
            )

    @property
    def enabled(self) -> bool:
        """Whether there is any tier below the device pool."""
        return self.kv_host_blocks > 0


class TierOp(enum.Enum):
    """What a TierJob moves."""

    OFFLOAD = "offload"
    """device blocks -> host slots"""
    DEMOTE = "demote"
    """host slots -> disk block files"""
    ONBOARD = "onboard"
    """host slots (source HOST) or disk block files (source DISK) -> device blocks"""
    DROP = "drop"
    """delete disk block files"""


class Lane(enum.Enum):
    """Where a TierJob runs: each lane runs its jobs one at a time, in order."""

    D2H = "d2h"
    """device -> host: OFFLOAD"""
    H2D = "h2d"
    """host -> device: ONBOARD from the host tier"""
    DISK_WRITE = "disk-write"
    """host -> disk: DEMOTE, and DROP"""
    DISK_READ = "disk-read"
    """disk -> device: ONBOARD from the disk tier"""

    @property
    def tier(self) -> KvTier:
        """The lower tier the lane moves bytes to or from."""
        return KvTier.HOST if self in (Lane.D2H, Lane.H2D) else KvTier.DISK


class _Entry:
    """A block on the host or disk tier."""

    __slots__ = ("block_hash", "live", "meta", "pins", "ready", "slot")

    def __init__(self, block_hash: int, meta: CachedBlock, slot: int = -1) -> None:
        self.block_hash = block_hash
        self.meta = meta
        self.slot = slot
        """Host slot (host tier); -1 on the disk tier (files are named by hash)."""
        self.ready = False
        """Its copy into the tier is done (and was published)."""
        self.live = True
        """Still in its tier's map (False once evicted, dropped or cleared)."""
        self.pins = 0
        """Onboardings reading it (host tier): not evicted, its slot not reused meanwhile."""


@dataclass(slots=True, eq=False)
class TierJob:
    """One batch of blocks to move, for the engine to execute in its lane's order.

    Per block i: `block_hashes[i]` and `metas[i]` (parent, tokens, LoRA: what a block file's
    header records) and, by op: OFFLOAD copies device block `device_blocks[i]` to host slot
    `host_slots[i]`; DEMOTE writes host slot `host_slots[i]` to the file of `block_hashes[i]`;
    ONBOARD copies host slot `host_slots[i]` (source HOST) or the file of `block_hashes[i]`
    (source DISK) into device block `device_blocks[i]`; DROP deletes the files. The engine
    reports how many leading blocks it moved (`done`): the rest failed.
    """

    op: TierOp
    lane: Lane
    """Where it runs."""
    source: KvTier
    """The tier the bytes come from."""
    block_hashes: list[int]
    metas: list[CachedBlock] = field(default_factory=list)
    device_blocks: list[int] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)
    nbytes: int = 0
    """Bytes it moves (0 for DROP)."""
    entries: list[_Entry] = field(default_factory=list, repr=False)
    onboarding: Onboarding | None = field(default=None, repr=False)
    indices: list[int] = field(default_factory=list, repr=False)
    """ONBOARD: position of each block in its Onboarding."""

    def __len__(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True, eq=False)
class Onboarding:
    """A request's run of blocks coming back from the host/disk tiers into `device_blocks`."""

    owner: object
    """Whoever asked (the scheduler's Seq)."""
    device_blocks: list[int]
    sources: list[KvTier]
    """Per block, the tier it comes from."""
    ok: list[bool]
    """Per block, whether it arrived (set as its job completes)."""
    pending: int = 0
    """Jobs still running."""

    def leading_ok(self) -> int:
        """How many leading blocks arrived."""
        n = 0
        for ok in self.ok:
            if not ok:
                break
            n += 1
        return n


@dataclass(slots=True)
class _Counters:
    hit_tokens: int = 0
    offload_blocks: int = 0
    offload_bytes: int = 0
    onboard_blocks: int = 0
    onboard_bytes: int = 0
    errors: int = 0


class KvTiers:
    """The host and disk tiers of one engine (see the module docstring).

    `pool`: the device pool (its BlocksStored hook feeds the offloads; its events log gets the
    tier events); `block_bytes`: bytes of one block (job sizes, metrics); `demote_limit`: DEMOTE
    moves in flight at most (default: a sixteenth of the host tier, at least 64 blocks, at most
    the host tier's size); `host_slots`: the blocks of host memory an engine allocates.
    """

    def __init__(
        self,
        config: KvTierConfig,
        pool: BlockPool,
        *,
        block_bytes: int,
        demote_limit: int = 0,
    ) -> None:
        if not config.enabled:
            raise ValueError("KvTiers needs a host tier (kv_host_blocks > 0)")
        if not pool.enable_caching:
            raise ValueError("KV tiers need prefix caching (the tiers hold cached blocks)")
        self.pool = pool
        self.events: KvEventLog | None = pool.events
        self.block_bytes = block_bytes
        self.host_capacity = config.kv_host_blocks
        self.disk_capacity = config.kv_disk_blocks
        self.demote_limit = demote_limit or min(
            self.host_capacity, max(64, self.host_capacity // 16)
        )
        self.host_slots = self.host_capacity + (self.demote_limit if self.has_disk else 0)
        """Host memory slots: the tier's blocks plus those being written to disk."""
        self._host: OrderedDict[int, _Entry] = OrderedDict()
        self._free_slots = list(range(self.host_slots - 1, -1, -1))
        self._disk: OrderedDict[int, _Entry] = OrderedDict()
        self._demoting = 0
        """DEMOTE moves in flight (their host slots are busy until they finish)."""
        self._jobs: list[TierJob] = []
        """Jobs created and not yet taken by the engine."""
        self._taken: set[TierJob] = set()
        """Jobs taken and not yet completed."""
        self._to_demote: list[_Entry] = []
        self._to_drop: list[int] = []
        self._removed: dict[KvTier, list[int]] = {KvTier.HOST: [], KvTier.DISK: []}
        """Published blocks that left a tier, to announce at the next flush."""
        self._ready = {KvTier.HOST: 0, KvTier.DISK: 0}
        """Published blocks per tier."""
        self.counters = {KvTier.HOST: _Counters(), KvTier.DISK: _Counters()}
        self.skipped_offloads = 0
        """Blocks not written through to the host tier (every host block was being
        onboarded)."""
        self.dropped_demotes = 0
        """Blocks the host tier evicted without moving them to disk (too many moves queued)."""
        pool.on_cached = self.device_stored

    # -- inspection ----------------------------------------------------------------------------

    @property
    def has_disk(self) -> bool:
        return self.disk_capacity > 0

    def cached_blocks(self, tier: KvTier) -> dict[int, CachedBlock]:
        """The blocks `tier` (HOST or DISK) holds whose copy is done, in the shape of
        KvEventLog.cached(tier)."""
        entries = self._host if tier is KvTier.HOST else self._disk
        return {h: e.meta for h, e in entries.items() if e.ready}

    def holds(self, tier: KvTier, block_hash: int) -> bool:
        """Whether `tier` has `block_hash` (its copy done or under way)."""
        return block_hash in (self._host if tier is KvTier.HOST else self._disk)

    def stats(self) -> tuple[KvTierStats, ...]:
        """The host (and disk) tier's counters."""
        out = []
        for tier, cap in ((KvTier.HOST, self.host_capacity), (KvTier.DISK, self.disk_capacity)):
            if not cap:
                continue
            c = self.counters[tier]
            out.append(
                KvTierStats(
                    tier=tier,
                    blocks=self._ready[tier],
                    capacity_blocks=cap,
                    hit_tokens=c.hit_tokens,
                    offload_blocks=c.offload_blocks,
                    offload_bytes=c.offload_bytes,
                    onboard_blocks=c.onboard_blocks,
                    onboard_bytes=c.onboard_bytes,
                    errors=c.errors,
                )
            )
        return tuple(out)

    def held_device_blocks(self) -> list[int]:
        """Device blocks the jobs not yet completed hold a reference to (check_invariants)."""
        held: list[int] = []
        for job in (*self._jobs, *self._taken):
            if job.op in (TierOp.OFFLOAD, TierOp.ONBOARD):
                held.extend(job.device_blocks)
        return held

    @property
    def num_jobs(self) -> int:
        """Jobs created and not completed."""
        return len(self._jobs) + len(self._taken)

    # -- the engine's side ---------------------------------------------------------------------

    def take_jobs(self) -> list[TierJob]:
        """The jobs created since the last call, in creation order (run each lane's in order)."""
        self._flush()
        jobs, self._jobs = self._jobs, []
        self._taken.update(jobs)
        return jobs

    def complete(self, job: TierJob, done: int) -> Onboarding | None:
        """`job` ended having moved its `done` leading blocks (the rest failed). Returns the
        Onboarding it finished (all of its jobs complete), if any."""
        self._taken.discard(job)
        self._jobs = [j for j in self._jobs if j is not job]
        done = max(0, min(done, len(job)))
        finished = None
        if job.op is TierOp.OFFLOAD:
            self.pool.release(job.device_blocks)
            self._offloaded(job, done)
        elif job.op is TierOp.DEMOTE:
            self._demoted(job, done)
        elif job.op is TierOp.ONBOARD:
            self.pool.release(job.device_blocks)
            finished = self._onboarded(job, done)
        self._flush()
        return finished

    def abandon(self) -> list[Onboarding]:
        """Forget every job not completed (the engine stopped running them): their device
        blocks are released, their moves count as failed without being errors. Returns the
        Onboardings that will never finish."""
        onboardings: list[Onboarding] = []
        for job in [*self._taken, *self._jobs]:
            self._taken.discard(job)
            if job.op in (TierOp.OFFLOAD, TierOp.ONBOARD):
                self.pool.release(job.device_blocks)
            if job.op is TierOp.OFFLOAD:
                for e in job.entries:
                    self._forget(self._host, e)
            elif job.op is TierOp.DEMOTE:
                self._demoting -= len(job)
                self._free_slots.extend(job.host_slots)
                for e in job.entries:
                    self._forget(self._disk, e)
            elif job.op is TierOp.ONBOARD:
                if job.source is KvTier.HOST:
                    self._unpin(job.entries)
                if job.onboarding is not None and job.onboarding not in onboardings:
                    onboardings.append(job.onboarding)
        self._jobs = []
        self._to_demote = []
        self._flush()
        return onboardings

    # -- device pool hook ----------------------------------------------------------------------

    def device_stored(self, block_ids: Sequence[int]) -> None:
        """The device pool cached `block_ids` under new hashes: write them through to the host
        tier (BlockPool.on_cached)."""
        pool, host = self.pool, self._host
        blocks: list[int] = []
        entries: list[_Entry] = []
        for bid in block_ids:
            h = pool.hash_of(bid)
            if h is None:  # pragma: no cover - the pool calls with cached blocks only
                continue
            have = host.get(h)
            if have is not None:
                host.move_to_end(h)
                continue
            slot = self._take_slot()
            if slot is None:
                self.skipped_offloads += 1
                continue
            e = _Entry(h, pool.meta_of(h), slot)
            host[h] = e
            blocks.append(bid)
            entries.append(e)
        if blocks:
            pool.acquire(blocks)
            self._jobs.append(
                TierJob(
                    TierOp.OFFLOAD,
                    Lane.D2H,
                    KvTier.DEVICE,
                    [e.block_hash for e in entries],
                    [e.meta for e in entries],
                    device_blocks=blocks,
                    host_slots=[e.slot for e in entries],
                    nbytes=len(blocks) * self.block_bytes,
                    entries=entries,
                )
            )
        self._flush()

    def touch(self, block_hashes: Iterable[int]) -> None:
        """Device hits: their host copies become most recently used."""
        host = self._host
        for h in block_hashes:
            if h in host:
                host.move_to_end(h)

    # -- onboarding ----------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int], start: int, end: int) -> list[KvTier]:
        """Where blocks `start`, `start + 1`, ... (before `end`) of a request sit below the
        device: HOST or DISK per block (the host preferred), up to the first on neither (a
        block counts once its copy into the tier is done)."""
        host, disk = self._host, self._disk
        found: list[KvTier] = []
        for i in range(start, end):
            h = block_hashes[i]
            e = host.get(h)
            if e is not None and e.ready:
                found.append(KvTier.HOST)
                continue
            e = disk.get(h)
            if e is not None and e.ready:
                found.append(KvTier.DISK)
                continue
            break
        return found

    def onboard(
        self,
        owner: object,
        block_hashes: Sequence[int],
        sources: list[KvTier],
        device_blocks: list[int],
    ) -> Onboarding:
        """Copy the blocks `block_hashes` (found by `match`, on `sources`) into `device_blocks`
        (fresh, referenced by the caller; the jobs take one more reference each)."""
        rec = Onboarding(owner, device_blocks, sources, [False] * len(sources))
        jobs: dict[KvTier, TierJob] = {}
        for i, (h, tier) in enumerate(zip(block_hashes, sources, strict=True)):
            entries = self._host if tier is KvTier.HOST else self._disk
            e = entries[h]
            entries.move_to_end(h)
            if tier is KvTier.HOST:
                e.pins += 1
            job = jobs.get(tier)
            if job is None:
                lane = Lane.H2D if tier is KvTier.HOST else Lane.DISK_READ
                job = jobs[tier] = TierJob(TierOp.ONBOARD, lane, tier, [], onboarding=rec)
            job.block_hashes.append(h)
            job.metas.append(e.meta)
            job.device_blocks.append(device_blocks[i])
            job.host_slots.append(e.slot)
            job.entries.append(e)
            job.indices.append(i)
            job.nbytes += self.block_bytes
        self.pool.acquire(device_blocks)
        rec.pending = len(jobs)
        self._jobs.extend(jobs.values())
        return rec

    def count_hits(self, rec: Onboarding, arrived: int, block_size: int) -> None:
        """Count the tokens of the `arrived` leading blocks of `rec` as hits of their tiers."""
        for tier in rec.sources[:arrived]:
            self.counters[tier].hit_tokens += block_size

    # -- clearing ------------------------------------------------------------------------------

    def clear(self) -> int:
        """Drop every block of both tiers (their files are deleted); returns how many."""
        n = 0
        for tier, entries in ((KvTier.HOST, self._host), (KvTier.DISK, self._disk)):
            for e in entries.values():
                e.live = False
                n += 1
                if e.ready:
                    self._removed[tier].append(e.block_hash)
                if tier is KvTier.DISK:
                    self._to_drop.append(e.block_hash)
                elif not e.pins:  # a pinned slot frees when its onboardings end
                    self._free_slots.append(e.slot)
            entries.clear()
        self._flush()
        return n

    def load_disk(self, blocks: Iterable[tuple[int, CachedBlock]]) -> int:
        """Adopt blocks found in the disk tier's files (oldest first), as stored; beyond the
        tier's size the oldest go (their files are deleted). Returns how many were kept."""
        disk = self._disk
        stored: list[_Entry] = []
        for h, meta in blocks:
            if h in disk:
                continue
            self._evict_disk()
            e = _Entry(h, meta)
            e.ready = True
            disk[h] = e
            stored.append(e)
        self._publish_stored(KvTier.DISK, [e for e in stored if e.live])
        self._flush()
        return len(disk)

    # -- internals -----------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A free host slot for one more block, evicting the host tier's LRU block when it is
        full (see the module docstring); None when every block is being onboarded."""
        free = self._free_slots
        host = self._host
        if len(host) >= self.host_capacity:
            e = next((e for e in host.values() if not e.pins), None)
            if e is None:
                return None
            del host[e.block_hash]
            e.live = False
            if not e.ready:  # its offload has not finished: nothing to announce or move
                free.append(e.slot)
            else:
                self._removed[KvTier.HOST].append(e.block_hash)
                if self.has_disk and e.block_hash not in self._disk:
                    if self._demoting < self.demote_limit:
                        self._demoting += 1
                        self._to_demote.append(e)  # its slot frees when the move is done
                    else:
                        self.dropped_demotes += 1
                        free.append(e.slot)
                else:
                    free.append(e.slot)
        return free.pop() if free else None

    def _evict_disk(self) -> None:
        disk = self._disk
        while len(disk) >= self.disk_capacity:
            _, old = disk.popitem(last=False)
            old.live = False
            if old.ready:
                self._removed[KvTier.DISK].append(old.block_hash)
            self._to_drop.append(old.block_hash)

    def _flush(self) -> None:
        """Turn what the last operation decided into jobs and events, in order: removals are
        published, then the moves to disk and the file deletions are queued."""
        self._announce_removed()
        if self._to_drop:
            hashes, self._to_drop = self._to_drop, []
            self._jobs.append(TierJob(TierOp.DROP, Lane.DISK_WRITE, KvTier.DISK, hashes))
        if self._to_demote:
            moving, self._to_demote = self._to_demote, []
            disk = self._disk
            entries: list[_Entry] = []
            for e in moving:
                self._evict_disk()
                d = _Entry(e.block_hash, e.meta, e.slot)
                disk[e.block_hash] = d
                entries.append(d)
            if self._to_drop:  # evictions to make room: delete before writing
                hashes, self._to_drop = self._to_drop, []
                self._jobs.append(TierJob(TierOp.DROP, Lane.DISK_WRITE, KvTier.DISK, hashes))
            self._jobs.append(
                TierJob(
                    TierOp.DEMOTE,
                    Lane.DISK_WRITE,
                    KvTier.HOST,
                    [e.block_hash for e in entries],
                    [e.meta for e in entries],
                    host_slots=[e.slot for e in entries],
                    nbytes=len(entries) * self.block_bytes,
                    entries=entries,
                )
            )
            self._announce_removed()  # the disk evictions that made room

    def _announce_removed(self) -> None:
        for tier, hashes in self._removed.items():
            if hashes:
                self._ready[tier] -= len(hashes)
                if self.events is not None:
                    self.events.publish(BlocksRemoved(hashes, tier))
                self._removed[tier] = []

    def _publish_stored(self, tier: KvTier, entries: list[_Entry]) -> None:
        """Publish newly ready blocks of `tier`, one event per run of parent-child blocks."""
        self._ready[tier] += len(entries)
        events = self.events
        if events is None or not entries:
            return
        run: list[StoredBlock] = []
        parent: int | None = None
        lora = ""
        for e in entries:
            p, tokens, elora = e.meta
            if run and (p != run[-1].block_hash or elora != lora):
                events.publish(BlocksStored(parent, run, lora, tier))
                run = []
            if not run:
                parent, lora = p, elora
            run.append(StoredBlock(e.block_hash, tokens))
        events.publish(BlocksStored(parent, run, lora, tier))

    def _unpin(self, entries: list[_Entry]) -> None:
        """Onboardings of these host blocks ended: a block dropped meanwhile frees its slot."""
        for e in entries:
            e.pins -= 1
            if not e.pins and not e.live:
                self._free_slots.append(e.slot)

    def _forget(self, entries: OrderedDict[int, _Entry], e: _Entry) -> None:
        """Drop an entry whose copy will not happen (it was never published)."""
        if e.live and entries.get(e.block_hash) is e:
            del entries[e.block_hash]
            e.live = False
            if entries is self._host:
                self._free_slots.append(e.slot)

    def _offloaded(self, job: TierJob, done: int) -> None:
        ready = []
        for i, e in enumerate(job.entries):
            if i < done:
                if e.live:
                    e.ready = True
                    ready.append(e)
            else:
                self._forget(self._host, e)
        c = self.counters[KvTier.HOST]
        c.offload_blocks += done
        c.offload_bytes += done * self.block_bytes
        c.errors += len(job) - done
        self._publish_stored(KvTier.HOST, ready)

    def _demoted(self, job: TierJob, done: int) -> None:
        self._demoting -= len(job)
        self._free_slots.extend(job.host_slots)
        ready = []
        for i, e in enumerate(job.entries):
            if i < done:
                if e.live:
                    e.ready = True
                    ready.append(e)
            elif e.live and self._disk.get(e.block_hash) is e:
                del self._disk[e.block_hash]
                e.live = False
                self._to_drop.append(e.block_hash)  # whatever part of it was written
        c = self.counters[KvTier.DISK]
        c.offload_blocks += done
        c.offload_bytes += done * self.block_bytes
        c.errors += len(job) - done
        self._publish_stored(KvTier.DISK, ready)

    def _onboarded(self, job: TierJob, done: int) -> Onboarding | None:
        c = self.counters[job.source]
        c.onboard_blocks += done
        c.onboard_bytes += done * self.block_bytes
        host = job.source is KvTier.HOST
        if done < len(job):  # that block could not be read: it leaves its tier
            c.errors += 1
            e = job.entries[done]
            entries = self._host if host else self._disk
            if e.live and entries.get(e.block_hash) is e:
                del entries[e.block_hash]
                e.live = False
                self._removed[job.source].append(e.block_hash)
                if not host:
                    self._to_drop.append(e.block_hash)
        if host:
            self._unpin(job.entries)
        rec = job.onboarding
        if rec is None:  # pragma: no cover - ONBOARD jobs always belong to one
            return None
        for j, i in enumerate(job.indices):
            rec.ok[i] = j < done
        rec.pending -= 1
        return rec if rec.pending == 0 else None
