"""A multiplexed GenerateStream to one worker, shared by every request this process sends it.

One gRPC call carries many requests: starts and cancels are batched into one message per
event-loop turn, and the worker batches outputs per engine step. This costs a fraction of a
gRPC call per request, which is what lets a Python gateway keep up with thousands of
requests per second. Semantics per request are those of `Generate`: the same outputs, the
same errors (delivered in-band as status codes), and cancellation when the consumer stops
reading.

If the stream breaks, every request on it fails with UNAVAILABLE and the next request opens a
new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.runtime import errors
from kvmesh.runtime.grpcutil import error_from_rpc, error_from_status
from kvmesh.runtime.tracing import TraceContext

log = logging.getLogger(__name__)


class _Broken(Exception):
    """The stream a request was on ended before the request finished."""

    def __init__(self, error: errors.KvmeshError) -> None:
        super().__init__(error.message)
        self.error = error


class _Stream:
    """One open GenerateStream call with its reader and writer tasks."""

    def __init__(self, stub: wpb_grpc.WorkerServiceAsyncStub, address: str) -> None:
        self.address = address
        self.call: Any = stub.GenerateStream()
        self.queues: dict[str, asyncio.Queue[wpb.StreamedGenerateOutput | _Broken]] = {}
        self.starts: list[wpb.StreamedGenerate] = []
        self.cancels: list[str] = []
        self.dirty = asyncio.Event()
        self.alive = True
        loop = asyncio.get_running_loop()
        self.reader = loop.create_task(self._read(), name=f"stream-read-{address}")
        self.writer = loop.create_task(self._write(), name=f"stream-write-{address}")

    async def _read(self) -> None:
        error: errors.KvmeshError = errors.Unavailable(f"worker {self.address}: stream closed")
        try:
            async for msg in self.call:
                for out in msg.outputs:
                    queue = self.queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc)
            error = (
                errors.Unavailable(f"worker {self.address}: {err.message}")
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                else err
            )
        finally:
            self.alive = False
            self.writer.cancel()
            for queue in self.queues.values():
                queue.put_nowait(_Broken(error))

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
        self, request: wpb.GenerateRequest, trace: TraceContext | None = None
    ) -> AsyncIterator[wpb.GenerateResponse]:
        """Stream the request's outputs; stopping early cancels it on the worker."""
        stream = self._open()
        rid = request.request_id
        if not rid or rid in stream.queues:
            raise errors.InvalidRequest("request_id must be set and unique per worker")
        queue: asyncio.Queue[wpb.StreamedGenerateOutput | _Broken] = asyncio.Queue()
        stream.queues[rid] = queue
        stream.start(request, trace)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Broken):
                    finished = True
                    raise item.error
                if item.error_code:
                    finished = True
                    raise error_from_status(item.error_code, item.error_message, item.error_status)
                yield item.response
                if item.response.finish_reason:
                    finished = True
                    return
        finally:
            stream.queues.pop(rid, None)
            if not finished:
                stream.cancel(rid)

    @property
    def inflight(self) -> int:
        """Requests currently running on this session."""
        return len(self._stream.queues) if self._stream is not None else 0

    async def close(self) -> None:
        """Close the stream (requests on it fail with UNAVAILABLE)."""
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
