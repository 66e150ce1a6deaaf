"""KvTiers, the shared bookkeeping of the host and disk KV tiers, on a real BlockPool and event
log (no engine): write-through, LRU refresh on device hits, moves to disk with their event order,
the bound on moves in flight, pinning while onboarding, failures, clearing; the config's rules;
the mocker's rule for what is worth onboarding."""

from __future__ import annotations

import pytest

from kvmesh.runtime.kv_events import BlocksRemoved, BlocksStored, KvEventLog, KvTier
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.batching.block_pool import BlockPool, block_hash
from kvmesh.workers.batching.tiers import KvTierConfig, KvTiers, Lane, TierJob, TierOp
from kvmesh.workers.mocker import MockerConfig, MockerScheduler

pytestmark = pytest.mark.unit

BS = 4


def _chain(n: int, base: int = 0) -> tuple[list[int], list[int]]:
    tokens = [base + i for i in range(n * BS)]
    hashes: list[int] = []
    for i in range(n):
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * BS : (i + 1) * BS]))
    return tokens, hashes


class Rig:
    """A pool with tiers; `cache(n, base)` caches a chain of n blocks and releases it."""

    def __init__(self, host: int, disk: int = 0, device: int = 16, limit: int = 0) -> None:
        self.log = KvEventLog()
        self.pool = BlockPool(device, BS, events=self.log)
        self.tiers = KvTiers(
            KvTierConfig(kv_host_blocks=host, kv_disk_blocks=disk),
            self.pool,
            block_bytes=100,
            demote_limit=limit,
        )

    def cache(self, n: int, base: int = 0) -> list[int]:
        tokens, hashes = _chain(n, base)
        blocks = self.pool.allocate(n)
        self.pool.cache_full_blocks(blocks, hashes, 0, n, tokens, "")
        self.pool.release(blocks)
        return hashes

    def run(self, *lanes: Lane) -> list[TierJob]:
        """Take the jobs and complete those on `lanes` (all lanes if none given)."""
        done = []
        for job in self.tiers.take_jobs():
            if not lanes or job.lane in lanes:
                self.tiers.complete(job, len(job))
                done.append(job)
        return done

    def consistent(self) -> None:
        for tier in (KvTier.HOST, KvTier.DISK):
            assert self.log.cached(tier) == self.tiers.cached_blocks(tier), tier


def test_write_through_publishes_when_the_copy_is_done() -> None:
    rig = Rig(host=8)
    hashes = rig.cache(3)
    [job] = rig.tiers.take_jobs()
    assert (job.op, job.lane, job.block_hashes) == (TierOp.OFFLOAD, Lane.D2H, hashes)
    assert all(rig.pool.ref_count(b) == 1 for b in job.device_blocks)  # held by the copy
    assert rig.log.cached(KvTier.HOST) == {}  # not before the copy is done
    rig.tiers.complete(job, len(job))
    assert set(rig.log.cached(KvTier.HOST)) == set(hashes)
    assert rig.pool.num_used == 0
    rig.cache(3)  # cached again after eviction from the device? already on the host: no copy
    assert rig.tiers.take_jobs() == []
    rig.consistent()


def test_device_hits_keep_host_copies_fresh() -> None:
    rig = Rig(host=4)
    old = rig.cache(2, base=0)
    rig.cache(2, base=100)
    rig.run()
    rig.tiers.touch(old)  # a device hit on the older chain
    rig.cache(2, base=200)  # needs 2 host slots: the LRU ones go
    rig.run()
    assert set(old) <= set(rig.tiers.cached_blocks(KvTier.HOST))
    rig.consistent()


def test_a_move_to_disk_is_announced_removed_then_stored() -> None:
    rig = Rig(host=2, disk=8)
    first = rig.cache(2, base=0)
    rig.run()
    start = rig.log.last_event_id
    rig.cache(2, base=100)  # evicts `first` from the host: moved to disk
    jobs = rig.tiers.take_jobs()
    assert {j.op for j in jobs} == {TierOp.OFFLOAD, TierOp.DEMOTE}
    demote = next(j for j in jobs if j.op is TierOp.DEMOTE)
    assert demote.lane is Lane.DISK_WRITE and demote.block_hashes == first
    assert rig.tiers.match(first, 0, 2) == []  # neither readable from host nor yet from disk
    for job in jobs:
        rig.tiers.complete(job, len(job))
    assert rig.tiers.match(first, 0, 2) == [KvTier.DISK, KvTier.DISK]
    kinds = [
        (type(r.kind).__name__, r.kind.tier)
        for r in rig.log.events_since(start) or []
        if isinstance(r.kind, (BlocksStored, BlocksRemoved))
    ]
    assert kinds.index(("BlocksRemoved", KvTier.HOST)) < kinds.index(("BlocksStored", KvTier.DISK))
    rig.consistent()


def test_moves_to_disk_are_bounded() -> None:
    rig = Rig(host=4, disk=16, limit=1)
    rig.cache(4, base=0)
    rig.run()
    rig.cache(2, base=100)  # evicts 2: one is moved, the other dropped (one move in flight)
    assert rig.tiers.dropped_demotes == 1
    rig.run()
    assert len(rig.tiers.cached_blocks(KvTier.DISK)) == 1
    rig.consistent()


def test_onboarding_pins_host_blocks_and_failures_drop_the_bad_block() -> None:
    rig = Rig(host=3, disk=8)
    hashes = rig.cache(3)
    rig.run()
    assert rig.tiers.match(hashes, 0, 3) == [KvTier.HOST] * 3
    dest = rig.pool.allocate(3)
    rec = rig.tiers.onboard("owner", hashes, [KvTier.HOST] * 3, dest)
    [job] = rig.tiers.take_jobs()
    assert job.lane is Lane.H2D and job.host_slots and job.device_blocks == dest
    rig.cache(3, base=100)  # wants the host slots: the pinned blocks are not evicted
    assert rig.tiers.skipped_offloads == 3
    assert rig.tiers.complete(job, 1) is rec  # block 1 could not be read
    assert rec.ok == [True, False, False] and rec.leading_ok() == 1
    assert rig.tiers.counters[KvTier.HOST].errors == 1
    assert hashes[1] not in rig.tiers.cached_blocks(KvTier.HOST)  # the bad block left the tier
    rig.pool.release(dest)
    assert rig.pool.num_used == 0
    rig.consistent()


def test_clear_empties_both_tiers_and_deletes_files() -> None:
    rig = Rig(host=2, disk=8)
    rig.cache(2)
    rig.run()
    rig.cache(2, base=100)  # the first chain moves to disk
    rig.run()
    assert len(rig.tiers.cached_blocks(KvTier.DISK)) == 2
    rig.tiers.clear()
    jobs = rig.tiers.take_jobs()
    assert [j.op for j in jobs] == [TierOp.DROP] and len(jobs[0]) == 2
    assert rig.log.cached(KvTier.HOST) == rig.log.cached(KvTier.DISK) == {}
    rig.consistent()


def test_load_disk_adopts_files_up_to_the_bound() -> None:
    rig = Rig(host=2, disk=2)
    _, hashes = _chain(3)
    kept = rig.tiers.load_disk((h, (None, (h,), "")) for h in hashes)
    assert kept == 2 and set(rig.log.cached(KvTier.DISK)) == set(hashes[1:])
    [drop] = rig.tiers.take_jobs()
    assert drop.op is TierOp.DROP and drop.block_hashes == hashes[:1]  # the oldest file goes


def test_config_rules() -> None:
    assert not KvTierConfig().enabled
    with pytest.raises(ValueError, match="needs a host tier"):
        KvTierConfig(kv_disk_blocks=4)
    with pytest.raises(ValueError, match="needs --kv-disk-blocks"):
        KvTierConfig(kv_host_blocks=4, kv_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match=">= 0"):
        KvTierConfig(kv_host_blocks=-1)
    with pytest.raises(ValueError, match="prefix caching"):
        KvTiers(KvTierConfig(4), BlockPool(4, BS, enable_caching=False), block_bytes=1)


def test_mocker_onboards_only_what_saves_time() -> None:
    """A move slower than the prefill it saves is not made: the prompt is recomputed."""
    for gbps, onboarded in ((1e6, True), (1e-3, False)):
        config = MockerConfig(
            num_gpu_blocks=8, block_size=BS, kv_host_gbps=gbps, kv_tier_latency_ms=0.0
        )
        sched = MockerScheduler(
            config, vocab_size=100, max_model_len=64, events=KvEventLog(), tiers=KvTierConfig(16)
        )
        prompt = list(range(10, 30))
        sched.add(EngineRequest("a", prompt, SamplingParams(temperature=0.0), StopParams(2)))
        while sched.has_work or (sched.tiers is not None and sched.tiers.num_jobs):
            sched.step(0.0)
            for job in sched.take_tier_jobs():
                sched.complete_tier_job(job, len(job))
        sched.pool.clear()  # the device copies go; the host copies stay
        sched.add(EngineRequest("c", prompt, SamplingParams(temperature=0.0), StopParams(2)))
        sched.step(0.0)
        jobs = sched.take_tier_jobs()
        assert any(j.op is TierOp.ONBOARD for j in jobs) is onboarded, gbps
