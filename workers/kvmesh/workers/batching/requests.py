"""Per-request bookkeeping of the async engine core (kvmesh.workers.batching.engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineOutput
from kvmesh.workers.engine import OutputSink


class SubmittedRequest:
    """A submitted request: where its outputs go, what was delivered, and its timeline (engine
    clock readings, for the worker's metrics and spans)."""

    __slots__ = (
        "admitted",
        "arrived",
        "delivered",
        "fallback",
        "first_at",
        "kv_bytes",
        "prompt_tokens",
        "remote",
        "sink",
        "trace",
    )

    def __init__(
        self,
        sink: OutputSink,
        prompt_tokens: int,
        arrived: float = 0.0,
        trace: TraceContext | None = None,
    ) -> None:
        self.sink = sink
        self.prompt_tokens = prompt_tokens
        self.delivered = 0
        self.kv_bytes = 0
        self.fallback = False
        self.arrived = arrived
        """When the request reached the scheduler's queue."""
        self.admitted: float | None = None
        """When the scheduler first admitted it (the step that did started then)."""
        self.first_at: float | None = None
        """When its first output was delivered."""
        self.remote = False
        """Continues a remote prefill (its first token came from the prefill worker)."""
        self.trace = trace
        """The caller's span: the parent of this request's engine spans."""


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
