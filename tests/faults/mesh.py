"""In-process meshes the fault tests share: mocker workers registered in a file registry, and a
WorkerPool that sees them."""

from __future__ import annotations

from pathlib import Path

from kvmesh.router.pool import HealthConfig, WorkerPool
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker

from ..integration.test_worker_contract import make_engine


def mocker_workers(tiny_model: Path, registry: Path, n: int, **engine: object) -> list[Worker]:
    """`n` mocker workers w0.. (MockerConfig `engine` settings) registering in `registry`."""
    return [
        Worker(
            WorkerConfig(discovery=f"file://{registry}", worker_id=f"w{i}"),
            make_engine(tiny_model, **engine),
        )
        for i in range(n)
    ]


async def start_pool(
    workers: list[Worker], registry: Path, health: HealthConfig | None = None
) -> WorkerPool:
    """Start `workers` (not started yet) and a pool over `registry` once it sees them all."""
    for w in workers:
        await w.start()
    pool = WorkerPool(FileDiscovery(registry, ttl_s=60.0, poll_s=0.05), health=health)
    await pool.start()
    await pool.wait_for(len(workers), timeout_s=20)
    return pool
