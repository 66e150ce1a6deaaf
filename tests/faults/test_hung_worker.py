"""A hung worker (SIGSTOP: its process keeps its sockets open and answers nothing) under load:
health checks eject it within seconds, its streams migrate and complete, new requests never wait
for it, and it is readmitted once it answers again (SIGCONT).

Two mocker workers as real `kvmesh worker` processes (file registry); the gateway side is an
in-process WorkerPool + MeshBackend, as a frontend builds it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.router.backend import MeshBackend, MigrationReason
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.pool import HealthConfig, WorkerPool
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.runtime.types import EngineRequest, FinishReason, SamplingParams, StopParams
from tests.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OUTPUT = 300
HEALTH = HealthConfig(health_check_interval_s=0.5, health_check_timeout_s=1.0)
"""Ejection after 2 failed checks: within about 0.5 + 2 x 1.5 s of the hang."""


@pytest.fixture
def workers(tiny_model: Path, tmp_path: Path) -> Iterator[list[Proc]]:
    procs = [
        Proc(
            f"w{i}",
            [
                "worker",
                "--model",
                str(tiny_model),
                "--discovery",
                f"file://{tmp_path / 'registry'}",
                "--worker-id",
                f"w{i}",
                "--speedup-ratio",
                "0.5",
            ],
            tmp_path,
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    yield procs
    for p in procs:
        if p.popen is not None and p.popen.poll() is None:
            os.kill(p.popen.pid, signal.SIGCONT)
        p.kill()


def request(i: int) -> EngineRequest:
    return EngineRequest(
        f"r{i}",
        [(5 + i * 97 + j * 31) % 3000 + 10 for j in range(30)],
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=OUTPUT, ignore_eos=True),
    )


async def run(backend: MeshBackend, req: EngineRequest) -> tuple[int, float]:
    """(tokens, seconds) of one request."""
    start = time.monotonic()
    n = 0
    async for out in backend.generate("tiny-llama", req, None):
        n += len(out.token_ids)
        if out.finish_reason is not None:
            assert out.finish_reason is FinishReason.LENGTH
    return n, time.monotonic() - start


async def test_a_hung_worker_is_ejected_and_its_streams_migrate(
    workers: list[Proc], tmp_path: Path
) -> None:
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", ttl_s=60.0, poll_s=0.05), health=HEALTH)
    await pool.start()
    try:
        await pool.wait_for(2, timeout_s=60)
        backend = MeshBackend(pool, KvRouter(pool))
        tasks = [asyncio.create_task(run(backend, request(i))) for i in range(20)]
        handles = {h.worker_id: h for h in pool.workers()}
        async with asyncio.timeout(30):
            while not all(h.session.inflight for h in handles.values()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # mid-stream
        victim = workers[0]
        assert victim.popen is not None
        os.kill(victim.popen.pid, signal.SIGSTOP)
        stopped = time.monotonic()

        async with asyncio.timeout(15):
            while handles["w0"].available:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        ejected_s = time.monotonic() - stopped
        # New requests never wait for the hung worker.
        late = await asyncio.wait_for(
            asyncio.gather(*(run(backend, request(100 + i)) for i in range(5))), 60
        )
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        print(
            f"ejected {ejected_s:.1f} s after SIGSTOP; migrated "
            f"{backend.stats.migrations[MigrationReason.UNRESPONSIVE]}; slowest stream "
            f"{max(s for _, s in results):.1f} s, slowest late request "
            f"{max(s for _, s in late):.1f} s"
        )
        assert ejected_s < 6
        assert all(n == OUTPUT for n, _ in results + late)
        assert backend.stats.migrations[MigrationReason.UNRESPONSIVE] >= 1
        assert pool.ejections == 1

        os.kill(victim.popen.pid, signal.SIGCONT)  # it answers again: readmitted
        async with asyncio.timeout(15):
            while not handles["w0"].available:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert backend.admission.running == 0
    finally:
        await pool.stop()
