"""`TaskSet`: the background tasks a component holds until they end, and stops."""

from __future__ import annotations

import asyncio
import gc

from kvmesh.runtime.tasks import TaskSet


async def test_a_spawned_task_is_held_until_it_ends() -> None:
    tasks = TaskSet()
    gate = asyncio.Event()
    ran: list[str] = []

    async def job() -> str:
        await gate.wait()
        ran.append("done")
        return "result"

    task = tasks.spawn(job(), name="job")
    del task
    gc.collect()  # the loop's own reference is weak: the set keeps the task alive
    assert len(tasks) == 1 and [t.get_name() for t in tasks] == ["job"]
    gate.set()
    assert await tasks.wait() == set()
    assert ran == ["done"] and len(tasks) == 0 and not tasks


async def test_wait_returns_what_outlived_its_limit_and_cancel_stops_it() -> None:
    tasks = TaskSet()
    stopped: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.append(True)
            raise

    task = tasks.spawn(forever())
    assert await tasks.wait(0.01) == {task}
    assert await tasks.cancel(1.0) == set()
    assert task.cancelled() and stopped == [True] and len(tasks) == 0
    assert await tasks.cancel() == set()  # nothing left: returns at once


async def test_a_task_that_ignores_cancellation_is_reported() -> None:
    tasks = TaskSet()
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallows the cancellation and goes on

    task = tasks.spawn(stubborn())
    await asyncio.sleep(0)
    assert await tasks.cancel(0.05) == {task}
    release.set()
    assert await tasks.wait(1.0) == set()
