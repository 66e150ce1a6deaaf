"""The simulator routes as the live router does: the same sequence of routes and finishes
(with exclusions) through the live SimpleRouter over real workers (a WorkerPool fed by file
discovery) and through the simulator's SimplePolicy picks the same workers, for every simple
mode and for a few seeds."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import RouterMode, SimpleRouter
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.sim.policies import SimplePolicy
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker

from .test_worker_contract import make_engine

pytestmark = pytest.mark.integration

N_WORKERS = 3
SIMPLE_MODES = [RouterMode.ROUND_ROBIN, RouterMode.RANDOM, RouterMode.LEAST_LOADED]


@pytest.fixture
async def pool(tiny_model: Path, tmp_path: Path) -> AsyncIterator[WorkerPool]:
    registry = tmp_path / "registry"
    workers = [
        Worker(
            WorkerConfig(discovery=f"file://{registry}", worker_id=f"w{i}"), make_engine(tiny_model)
        )
        for i in range(N_WORKERS)
    ]
    for w in workers:
        await w.start()
    p = WorkerPool(FileDiscovery(registry, poll_s=0.05))
    await p.start()
    await p.wait_for(N_WORKERS, timeout_s=10)
    yield p
    await p.stop()
    for w in workers:
        await w.stop()


async def live_and_simulated_choices(
    pool: WorkerPool, mode: RouterMode, seed: int
) -> tuple[list[int], list[int]]:
    """Run one scripted sequence (routes, some excluding a worker, and finishes of random
    requests in flight) through both; the workers each picked, as positions in the pool."""
    live = SimpleRouter(pool, mode, seed=seed)
    sim = SimplePolicy(mode, N_WORKERS, seed)
    handles = pool.workers("tiny")
    position = {h.worker_id: i for i, h in enumerate(handles)}
    script = random.Random(seed + 1000)
    inflight: list[str] = []
    live_picks: list[int] = []
    sim_picks: list[int] = []
    for n in range(300):
        if inflight and script.random() < 0.45:
            rid = inflight.pop(script.randrange(len(inflight)))
            live.finished(rid)
            sim.finished(rid)
            continue
        rid = f"r{n}"
        excluded = script.randrange(N_WORKERS) if script.random() < 0.2 else None
        exclude = [handles[excluded].worker_id] if excluded is not None else []
        decision = await live.route("tiny", [1, 2, 3], rid, exclude=exclude)
        live_picks.append(position[decision.worker.worker_id])
        candidates = [i for i in range(N_WORKERS) if i != excluded]
        sim_picks.append(sim.route(rid, [1, 2, 3], 0.0, candidates=candidates).worker)
        inflight.append(rid)
    for rid in inflight:
        live.finished(rid)
        sim.finished(rid)
    assert all(h.inflight == 0 for h in handles)
    return live_picks, sim_picks


@pytest.mark.parametrize("mode", SIMPLE_MODES, ids=lambda m: m.value)
async def test_simulated_simple_policies_pick_as_the_live_router(
    pool: WorkerPool, mode: RouterMode
) -> None:
    for seed in (0, 1, 7):
        live, simulated = await live_and_simulated_choices(pool, mode, seed)
        assert simulated == live
        assert set(live) == set(range(N_WORKERS))  # every worker was picked at some point
