"""Background tasks an owner must be able to stop or wait for (`TaskSet`).

asyncio keeps only a weak reference to a running task: one nobody holds can be collected
mid-flight. Every component that starts work in the background (a channel closing, a KV
release, a pull, an engine pump) keeps its tasks in a `TaskSet`, which holds each until it ends
and lets the owner's stop cancel or await what is left."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["TaskSet"]


class TaskSet:
    """The tasks started through `spawn` that have not ended yet."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` as a task on the running loop, held here until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))  # a snapshot: tasks leave the set as they end

    async def wait(self, within_s: float | None = None) -> set[asyncio.Task[Any]]:
        """Wait until the tasks running now have ended (their exceptions are theirs to log), at
        most `within_s` seconds; returns those still running."""
        tasks = list(self._tasks)
        if not tasks:
            return set()
        _, pending = await asyncio.wait(tasks, timeout=within_s)
        return pending

    async def cancel(self, within_s: float | None = None) -> set[asyncio.Task[Any]]:
        """Cancel the tasks running now and wait for them to end (see `wait`)."""
        for task in self._tasks:
            task.cancel()
        return await self.wait(within_s)
