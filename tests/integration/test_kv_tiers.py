"""The router's KV event intake over real gRPC: a worker that reports blocks on the HOST and
DISK tiers (kvmesh workers do not yet; an engine with offload would) never has them taken for
device blocks. They are left out of the index, counted and logged once; the device blocks of
the same stream are indexed and the stream stays in sequence."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_scheduler import KvScheduler
from kvmesh.router.kv_subscriber import KvSubscriber
from kvmesh.router.pool import WorkerHandle
from kvmesh.router.session import WorkerSession
from kvmesh.runtime.grpcutil import GrpcServer, insecure_channel
from kvmesh.runtime.types import ModelInfo
from kvmesh.workers.mocker import block_hash as engine_hash
from kvmesh.workers.server import WORKER_SERVICE

pytestmark = pytest.mark.integration

BS = 4
TOKENS = list(range(12))
BLOCKS = [tuple(TOKENS[i : i + BS]) for i in range(0, len(TOKENS), BS)]


def _chain() -> list[int]:
    hashes: list[int] = []
    parent = None
    for block in BLOCKS:
        parent = engine_hash(parent, block)
        hashes.append(parent)
    return hashes


def _stored(i: int, tier: cpb.KvTier.ValueType) -> cpb.KvBlocksStored:
    hashes = _chain()
    msg = cpb.KvBlocksStored(
        blocks=[cpb.KvBlock(block_hash=hashes[i], token_ids=BLOCKS[i])], tier=tier
    )
    if i:
        msg.parent_block_hash = hashes[i - 1]
    return msg


class TieredWorker(wpb_grpc.WorkerServiceServicer):
    """A worker whose cache spans tiers: block 0 on the device and the host, block 1 on the
    host only, block 2 on the disk, then block 1 reaches the device and block 0's host copy is
    evicted."""

    async def SubscribeKvEvents(
        self, request: wpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[wpb.SubscribeKvEventsResponse]:
        yield wpb.SubscribeKvEventsResponse(
            snapshot=wpb.KvSnapshotChunk(
                as_of_event_id=0,
                chains=[_stored(0, cpb.KV_TIER_DEVICE), _stored(0, cpb.KV_TIER_HOST)],
                first=True,
                last=True,
                log_id="tiers",
            )
        )
        events = [
            cpb.KvEvent(event_id=1, stored=_stored(1, cpb.KV_TIER_HOST)),
            cpb.KvEvent(event_id=2, stored=_stored(2, cpb.KV_TIER_DISK)),
            cpb.KvEvent(event_id=3, stored=_stored(1, cpb.KV_TIER_DEVICE)),
            cpb.KvEvent(
                event_id=4,
                removed=cpb.KvBlocksRemoved(block_hashes=_chain()[:1], tier=cpb.KV_TIER_HOST),
            ),
        ]
        for event in events:
            yield wpb.SubscribeKvEventsResponse(event=event)
        await asyncio.Event().wait()  # the stream stays open, as a worker's does

    async def StreamLoadMetrics(
        self, request: wpb.StreamLoadMetricsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[wpb.StreamLoadMetricsResponse]:
        yield wpb.StreamLoadMetricsResponse(metrics=cpb.LoadMetrics(kv_total_blocks=64))
        await asyncio.Event().wait()


async def test_host_and_disk_tier_events_stay_out_of_the_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = GrpcServer()
    server.add(wpb_grpc.add_WorkerServiceServicer_to_server, TieredWorker(), WORKER_SERVICE)
    await server.start()
    channel = insecure_channel(server.address)
    stub = wpb_grpc.WorkerServiceStub(channel)
    info = ModelInfo("m", "tiered", BS, 64, 1024, capabilities=("KV_EVENTS",))
    handle = WorkerHandle(
        "i", "w", server.address, info, channel, stub, WorkerSession(stub, server.address)
    )
    scheduler = KvScheduler()
    subscriber = KvSubscriber(scheduler)
    caplog.set_level(logging.DEBUG, logger="kvmesh.router.kv_subscriber")
    try:
        subscriber.add(handle)
        indexer = scheduler.indexer
        for _ in range(500):
            if indexer.resume_point("w") == (4, "tiers"):
                break
            await asyncio.sleep(0.01)
        assert indexer.resume_point("w") == (4, "tiers"), "the stream did not stay in sequence"
        # Device blocks 0 and 1 are indexed; the host/disk-only block 2 is not, and evicting
        # block 0's host copy did not evict its device copy.
        assert indexer.find_matches(block_hashes(TOKENS, BS)) == {"w": 2}
        stats = indexer.stats("w")
        assert (stats.events, stats.skipped, stats.blocks) == (1, 3, 2)
        assert dict(subscriber.skipped) == {
            ("w", "snapshot chain on another tier"): 1,
            ("w", "stored on tier KV_TIER_HOST"): 1,
            ("w", "stored on tier KV_TIER_DISK"): 1,
            ("w", "removed from tier KV_TIER_HOST"): 1,
        }
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 4 and all("device tier only" in r.getMessage() for r in warnings)
    finally:
        await subscriber.close()
        await channel.close()
        await server.stop(0)
