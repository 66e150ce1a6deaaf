"""A multiplexed GenerateStream to one worker, shared by every request this process sends it.

One gRPC call carries many requests: starts and cancels are batched into one message per
event-loop turn, and the worker batches outputs per engine step. This costs a fraction of a
gRPC call per request, which is what lets a Python gateway keep up with thousands of
requests per second. Semantics per request are those of `Generate`: the same outputs, the
same errors (delivered in-band as status codes), and cancellation when the consumer stops
reading.

If the stream breaks (the worker died, was cut off, or was found hung and abandoned), every
request on it fails with `WorkerLost` (an Unavailable; the backend migrates them) and the next
request opens a new stream. Whether it broke is decided by the status, not its message: a status
without a kvmesh ErrorInfo came from the transport (`grpcutil.transport_failure`).

Flow control: each request buffers at most `max_buffered` outputs its consumer has not taken
yet. When a consumer stops reading (a client that does not read its HTTP stream), the request is
cancelled on the worker, so the worker stops generating for it; a `pausable` request then ends,
once its consumer has taken what was buffered, with `RequestPaused` (the backend resumes it where
it stopped: see kvmesh.router.backend), any other with ResourceExhausted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.runtime import errors
from kvmesh.runtime.grpcutil import error_from_rpc, error_from_status, transport_failure
from kvmesh.runtime.tracing import TraceContext

log = logging.getLogger(__name__)

MAX_BUFFERED_OUTPUTS = 256
"""Default bound of the outputs one request buffers for a consumer that does not keep up."""


class WorkerLost(errors.Unavailable):
    """A request's worker stream ended before the request did, not by the worker's choice.

    `cause`: "stream_lost" (the connection or the stream broke: the worker died or was cut off)
    or "unresponsive" (health checks found the worker hung and the stream was abandoned).
    """

    def __init__(self, message: str, cause: str = "stream_lost") -> None:
        super().__init__(message)
        self.cause = cause


class RequestPaused(Exception):
    """A pausable request's consumer fell `max_buffered` outputs behind: the request was cancelled
    on the worker, and every output produced before that was delivered."""


class _Broken:
    """Queue item: the request ends with `error`."""

    __slots__ = ("error",)

    def __init__(self, error: errors.KvmeshError) -> None:
        self.error = error


_PAUSED = object()
"""Queue item: the request was paused (RequestPaused)."""

_Item = wpb.StreamedGenerateOutput | _Broken | object


class _Pending:
    """One request's outputs not taken by its consumer yet."""

    __slots__ = ("limit", "on_stop", "pausable", "queue")

    def __init__(self, limit: int, pausable: bool, on_stop: Callable[[], None] | None) -> None:
        self.on_stop = on_stop
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.limit = limit
        self.pausable = pausable


class _Stream:
    """One open GenerateStream call with its reader and writer tasks."""

    def __init__(self, stub: wpb_grpc.WorkerServiceAsyncStub, address: str) -> None:
        self.address = address
        self.call: Any = stub.GenerateStream()
        self.requests: dict[str, _Pending] = {}
        self.starts: list[wpb.StreamedGenerate] = []
        self.cancels: list[str] = []
        self.dirty = asyncio.Event()
        self.alive = True
        self.lost: WorkerLost | None = None
        """Set by `abandon`: what the requests on the stream fail with."""
        loop = asyncio.get_running_loop()
        self.last_output = loop.time()
        """Event-loop time the worker last sent something on this stream (or it was opened)."""
        self.reader = loop.create_task(self._read(), name=f"stream-read-{address}")
        self.writer = loop.create_task(self._write(), name=f"stream-write-{address}")

    async def _read(self) -> None:
        error: errors.KvmeshError = WorkerLost(f"worker {self.address}: the stream ended")
        loop = asyncio.get_running_loop()
        try:
            async for msg in self.call:
                self.last_output = loop.time()
                requests = self.requests
                for out in msg.outputs:
                    pending = requests.get(out.request_id)
                    if pending is None:
                        continue  # cancelled or paused meanwhile
                    queue = pending.queue
                    queue.put_nowait(out)
                    if (
                        pending.limit
                        and queue.qsize() >= pending.limit
                        and not (out.error_code or out.response.finish_reason)
                    ):
                        self._overflow(out.request_id, pending)
        except grpc.aio.AioRpcError as exc:
            if self.lost is not None:
                error = self.lost
            elif transport_failure(exc):
                error = WorkerLost(f"worker {self.address}: {exc.details() or exc.code().name}")
            else:
                error = error_from_rpc(exc)
        finally:
            if self.lost is not None:
                error = self.lost
            self.alive = False
            self.writer.cancel()
            for pending in self.requests.values():
                pending.queue.put_nowait(_Broken(error))

    def _overflow(self, request_id: str, pending: _Pending) -> None:
        """The consumer of `request_id` is `limit` outputs behind: stop it on the worker."""
        del self.requests[request_id]
        self.cancel(request_id)
        if pending.on_stop is not None:
            pending.on_stop()
        if pending.pausable:
            pending.queue.put_nowait(_PAUSED)
        else:
            pending.queue.put_nowait(
                _Broken(
                    errors.ResourceExhausted(
                        f"the client fell {pending.limit} outputs behind its stream; the request "
                        "was stopped"
                    )
                )
            )

    async def _write(self) -> None:
        try:
            while True:
                await self.dirty.wait()
                self.dirty.clear()
                msg = wpb.GenerateStreamRequest(start=self.starts, cancel_request_ids=self.cancels)
                self.starts, self.cancels = [], []
                await self.call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("stream to %s stopped writing: %s", self.address, exc)
            self.call.cancel()

    def start(self, request: wpb.GenerateRequest, trace: TraceContext | None) -> None:
        item = wpb.StreamedGenerate(request=request)
        if trace is not None:
            item.traceparent = trace.traceparent
            if trace.tracestate:
                item.tracestate = trace.tracestate
        self.starts.append(item)
        self.dirty.set()

    def cancel(self, request_id: str) -> None:
        if self.alive:
            self.cancels.append(request_id)
            self.dirty.set()

    def abandon(self, error: WorkerLost) -> None:
        """Fail every request on the stream with `error` and drop the call."""
        if self.lost is None:
            self.lost = error
        self.alive = False  # new requests open a new stream
        self.call.cancel()

    async def close(self) -> None:
        self.call.cancel()
        for task in (self.reader, self.writer):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class WorkerSession:
    """Generate over a shared GenerateStream to one worker (see module docstring)."""

    def __init__(self, stub: wpb_grpc.WorkerServiceAsyncStub, address: str) -> None:
        self._stub = stub
        self._address = address
        self._stream: _Stream | None = None

    def _open(self) -> _Stream:
        if self._stream is None or not self._stream.alive:
            self._stream = _Stream(self._stub, self._address)
        return self._stream

    async def generate(
        self,
        request: wpb.GenerateRequest,
        trace: TraceContext | None = None,
        *,
        max_buffered: int = MAX_BUFFERED_OUTPUTS,
        pausable: bool = False,
        on_stop: Callable[[], None] | None = None,
    ) -> AsyncIterator[wpb.GenerateResponse]:
        """Stream the request's outputs; stopping early cancels it on the worker.

        `max_buffered`: outputs the request may hold for a consumer that does not take them
        (0: no bound); past it the request is stopped on the worker and ends with RequestPaused
        (`pausable`) or ResourceExhausted; `on_stop` is called when it is stopped so. A broken
        stream raises WorkerLost.
        """
        stream = self._open()
        rid = request.request_id
        if not rid or rid in stream.requests:
            raise errors.InvalidRequest("request_id must be set and unique per worker")
        pending = _Pending(max_buffered, pausable, on_stop)
        stream.requests[rid] = pending
        stream.start(request, trace)
        queue = pending.queue
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, wpb.StreamedGenerateOutput):
                    if item.error_code:
                        finished = True
                        raise error_from_status(
                            item.error_code, item.error_message, item.error_status
                        )
                    yield item.response
                    if item.response.finish_reason:
                        finished = True
                        return
                elif isinstance(item, _Broken):
                    finished = True
                    raise item.error
                else:  # _PAUSED: the reader already cancelled it on the worker
                    finished = True
                    raise RequestPaused(rid)
        finally:
            if stream.requests.get(rid) is pending:
                del stream.requests[rid]
            if not finished:
                stream.cancel(rid)

    @property
    def inflight(self) -> int:
        """Requests currently running on this session."""
        return len(self._stream.requests) if self._stream is not None else 0

    def idle_for(self, now: float) -> float:
        """Seconds since the worker last sent anything on a stream that has requests in flight
        (0 when nothing is in flight: silence is then expected)."""
        stream = self._stream
        if stream is None or not stream.alive or not stream.requests:
            return 0.0
        return max(0.0, now - stream.last_output)

    def abandon(self, message: str) -> None:
        """The worker stopped answering: fail every request in flight with
        WorkerLost(cause="unresponsive") and drop the stream (the next request opens a new one)."""
        stream = self._stream
        if stream is not None and stream.alive:
            stream.abandon(WorkerLost(f"worker {self._address}: {message}", "unresponsive"))

    async def close(self) -> None:
        """Close the stream (requests on it fail with WorkerLost)."""
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
