"""Cancel 1,000 streaming requests at random points (before routing, mid-prefill, mid-transfer,
mid-decode), aggregated and disaggregated: every worker's block pool, running count and pinned
disaggregation blocks, the gateway's admission slots and every worker session return to
baseline."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from kvmesh.runtime.types import Role

from ..integration.test_disagg_mesh import Mesh, baseline, prompt, request, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 1000
CONCURRENCY = 100


@pytest.mark.timeout(120)  # about 9 s here (disaggregated), bounded by its own waits
@pytest.mark.parametrize("disaggregated", [False, True], ids=["aggregated", "disaggregated"])
async def test_a_thousand_random_cancellations_leave_nothing_behind(
    tiny_model: Path, tmp_path: Path, disaggregated: bool
) -> None:
    # A long lease: on a loaded 2-core CI machine 100 concurrent streams can hold the event loop
    # past a 3 s lease's heartbeat, and the pool would drop a live worker (seen once).
    mesh = Mesh(tiny_model, tmp_path / "registry", ttl_s=60.0)
    try:
        if disaggregated:
            workers = [
                await mesh.add("p0", Role.PREFILL, speedup_ratio=20.0),
                await mesh.add("d0", Role.DECODE, speedup_ratio=20.0),
            ]
            backend = mesh.backend(disagg_local_prefill_tokens=0)
        else:
            workers = [await mesh.add(f"w{i}", Role.AGGREGATED, speedup_ratio=20.0) for i in (0, 1)]
            backend = mesh.backend()
        rng = random.Random(13)
        slots = asyncio.Semaphore(CONCURRENCY)
        outcomes = {"cancelled": 0, "finished": 0}

        async def one(i: int) -> None:
            req = request(f"c{i}", prompt(32 + rng.randrange(200), salt=i), max_tokens=64)
            stop_after = rng.randrange(-1, 40)  # -1: cancelled before the first token
            async with slots:

                async def consume() -> None:
                    n = 0
                    async for out in backend.generate("tiny", req, None):
                        n += len(out.token_ids)
                        if n > stop_after >= 0:
                            await asyncio.sleep(rng.random() * 0.01)  # mid-flight
                            raise asyncio.CancelledError

                task = asyncio.create_task(consume())
                if stop_after < 0:
                    await asyncio.sleep(rng.random() * 0.02)  # routing, prefill or transfer
                    task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                else:
                    outcomes["finished"] += 1

        # Under the gateway's 60 s remote-prefill timeout: a prefill worker that stalls (its
        # queued requests not woken when pinned blocks are freed) would hit it at the end.
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(REQUESTS))), 50)
        print(f"{REQUESTS} requests: {outcomes}")
        assert outcomes["cancelled"] > REQUESTS * 0.8

        def settled() -> bool:
            loads = [w.engine.load() for w in workers]
            return not any(x.kv_active_blocks or x.kv_pinned_blocks or x.num_running for x in loads)

        # Well under the prefill worker's 30 s pin timeout: blocks left pinned until they
        # expire (a consumer that stopped at the first token, a prefill answered as the caller
        # left) fail here.
        await until(settled, 10)
        baseline(*workers)
        assert backend.admission.running == 0 and backend.admission.queued == 0
        assert all(h.session.inflight == 0 for h in mesh.pool.workers())
        assert all(h.inflight == 0 for h in mesh.pool.workers())
    finally:
        await mesh.close()
