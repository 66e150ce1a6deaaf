"""Per-request bookkeeping of the async engine core (kvmesh.workers.batching.engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvmesh.runtime.types import EngineOutput
from kvmesh.workers.engine import OutputSink


class SubmittedRequest:
    """A submitted request: where its outputs go and what was delivered."""

    __slots__ = ("delivered", "fallback", "kv_bytes", "prompt_tokens", "sink")

    def __init__(self, sink: OutputSink, prompt_tokens: int) -> None:
        self.sink = sink
        self.prompt_tokens = prompt_tokens
        self.delivered = 0
        self.kv_bytes = 0
        self.fallback = False


class FirstOutput:
    """OutputSink of a PrefillRemote request: its one output resolves a future."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()

    def output(self, out: EngineOutput) -> None:
        if not self.future.done():
            self.future.set_result(out)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class CancelHandle:
    """RequestHandle that cancels by request id through the engine's cancel function."""

    __slots__ = ("_cancel", "request_id")

    def __init__(self, cancel: Callable[[str], None], request_id: str) -> None:
        self._cancel = cancel
        self.request_id = request_id

    def cancel(self) -> None:
        self._cancel(self.request_id)
