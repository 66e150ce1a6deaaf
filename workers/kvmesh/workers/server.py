"""The worker process: one engine behind WorkerService, with health, reflection and discovery.

Thin transport: each RPC converts protobuf to the engine's typed messages (runtime.wire),
calls one engine method and converts back. Domain exceptions become gRPC status codes in the
ErrorInterceptor.

Shutdown (SIGTERM/SIGINT): leave discovery, so routers stop sending, and keep serving for
`--leave-delay-s` while they notice; then stop accepting (new requests get UNAVAILABLE, health
goes NOT_SERVING), wait for in-flight requests up to the drain timeout (`--drain-timeout-s`, the
grace period), cancel what is left, stop the engine. Drain (the RPC) stops accepting at once.

Roles (`--role`): an aggregated worker serves Generate; a prefill worker also serves
PrefillRemote (its engine pins the prompt's KV and the servicer stamps the handle with this
worker's id and address, where decode workers send ReleaseKvBlocks); a decode worker's engine
pulls remote KV for Generate requests that carry `remote_prefill`, releasing it through
`GrpcKvReleaser`. The role is the engine's (`configure_disaggregation`) and is advertised in the
model card and discovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.runtime import wire
from kvmesh.runtime.discovery import Instance, Registration, open_discovery
from kvmesh.runtime.errors import InvalidRequest, KvmeshError, Unavailable, Unimplemented
from kvmesh.runtime.grpcutil import MeshSecurity, mesh_server, status_of
from kvmesh.runtime.metrics import MetricsServer
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.telemetry import LOG_CONTEXT, LogContext, SpanKind, tracer
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineOutput, EngineRequest, Role
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.disagg.release import GrpcKvReleaser
from kvmesh.workers.engine import DisaggSettings, Engine, RequestHandle
from kvmesh.workers.metrics import WorkerCollector
from kvmesh.workers.validation import validate_wire_request

log = logging.getLogger(__name__)

WORKER_SERVICE = wpb.DESCRIPTOR.services_by_name["WorkerService"].full_name


class WorkerServicer(wpb_grpc.WorkerServiceServicer):
    """WorkerService over one Engine."""

    def __init__(self, engine: Engine, worker_id: str, address: str = "") -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.address = address
        """Where decode workers reach this worker (stamped on KV transfer handles)."""
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        # In-flight requests: key -> how to cancel it (drain cancels what is left at timeout).
        self._inflight: dict[object, Callable[[], object]] = {}
        self._releases = TaskSet()
        """Releases of transfers whose PrefillRemote caller left as it answered."""

    # -- generation ------------------------------------------------------------------------

    async def Generate(
        self, request: wpb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[wpb.GenerateResponse]:
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining")
        req = self.engine_request(request, uuid.uuid4().hex)
        req.trace = trace = TraceContext.from_grpc_metadata(context.invocation_metadata() or ())
        _log_context(req.request_id, trace)
        task = asyncio.current_task()
        assert task is not None
        self._begin(task, task.cancel)
        stream = self.engine.generate(req)
        try:
            async for out in stream:
                yield wire.output_to_pb(out)
        finally:
            # Runs on completion, error and cancellation (client went away): the engine
            # aborts the request and frees its blocks before aclose returns.
            await stream.aclose()  # type: ignore[attr-defined]
            self._end(task)

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[wpb.GenerateStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[wpb.GenerateStreamResponse]:
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining")
        session = _StreamSession(self)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            async for batch in session.batches():
                yield batch
        finally:
            reader.cancel()
            session.cancel_all()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def engine_request(self, msg: wpb.GenerateRequest, default_id: str) -> EngineRequest:
        """The engine's request for `msg`; refuses fields the engine cannot honour (media
        without MULTIMODAL, fields no engine implements) and remote_prefill for engines that
        cannot continue a remotely prefilled request."""
        validate_wire_request(msg, self.engine.info)
        req = wire.request_from_pb(msg, default_id=default_id)
        if req.remote_prefill is not None and "DISAGGREGATION" not in self.engine.info.capabilities:
            raise Unimplemented(
                f"engine {self.engine.info.engine!r} cannot continue a remotely prefilled request"
            )
        return req

    def _begin(self, key: object, cancel: Callable[[], object]) -> None:
        self._inflight[key] = cancel
        self._idle.clear()

    def _end(self, key: object) -> None:
        if self._inflight.pop(key, None) is not None and not self._inflight:
            self._idle.set()

    async def PrefillRemote(
        self, request: wpb.PrefillRemoteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.PrefillRemoteResponse:
        if self.engine.info.role is not Role.PREFILL:
            raise Unimplemented(
                f"worker {self.worker_id} has role {self.engine.info.role.value}; PrefillRemote "
                "is served by workers started with --role prefill"
            )
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining")
        validate_wire_request(request, self.engine.info)
        req = wire.prefill_request_from_pb(request, default_id=uuid.uuid4().hex)
        parent = TraceContext.from_grpc_metadata(context.invocation_metadata() or ())
        span = tracer().start(
            "PrefillRemote",
            parent,
            kind=SpanKind.SERVER,
            remote=True,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": WORKER_SERVICE,
                "rpc.method": "PrefillRemote",
                "kvmesh.request_id": req.request_id,
                "kvmesh.worker_id": self.worker_id,
                "gen_ai.usage.input_tokens": len(req.prompt),
            },
        )
        req.trace = span.context
        _log_context(req.request_id, span.context)
        task = asyncio.current_task()
        assert task is not None
        self._begin(task, task.cancel)
        try:
            # Cancelling the call (the gateway went away) aborts the prefill and frees its blocks.
            result = await self.engine.prefill_remote(req)
        except BaseException as exc:
            span.error(type(exc).__name__)
            raise
        finally:
            self._end(task)
            span.end()
        handle = result.remote.handle
        if handle is not None:
            handle.prefill_worker_id = self.worker_id
            handle.prefill_address = self.address
            # The call ends cancelled though the prefill finished (the caller left, or its
            # deadline passed, before the answer was sent): nobody will release what was pinned.
            transfer_id = handle.transfer_id
            # (grpc-stubs types the callback as a class of its own, not a callable)
            context.add_done_callback(
                lambda ctx: self._release_if_cancelled(transfer_id, ctx)  # type: ignore[arg-type]
            )
            span.update(
                {
                    "kvmesh.kv_transfer.id": handle.transfer_id,
                    "kvmesh.kv_transfer.blocks": len(handle.blocks),
                }
            )
        return wire.prefill_result_to_pb(result)

    def _release_if_cancelled(
        self, transfer_id: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        if context.cancelled():
            self._releases.spawn(self.engine.release_kv(transfer_id))

    async def ReleaseKvBlocks(
        self, request: wpb.ReleaseKvBlocksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.ReleaseKvBlocksResponse:
        if not request.transfer_id and not request.request_id:
            raise InvalidRequest("ReleaseKvBlocks needs a transfer_id or a request_id")
        released = await self.engine.release_kv(request.transfer_id, request.request_id)
        return wpb.ReleaseKvBlocksResponse(released=released)

    # -- KV events, load, card -------------------------------------------------------------

    async def SubscribeKvEvents(
        self, request: wpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[wpb.SubscribeKvEventsResponse]:
        events = self.engine.kv_events
        if events is None:
            raise Unimplemented(f"engine {self.engine.info.engine!r} publishes no KV events")
        resume = (
            request.resume_after_event_id if request.HasField("resume_after_event_id") else None
        )
        if request.resume_log_id and request.resume_log_id != events.log_id:
            resume = None  # another process's event ids: start over with a snapshot
        stream = events.subscribe(resume)
        try:
            async for item in stream:
                yield wire.kv_item_to_pb(item, events.log_id)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _load(self) -> wpb.GetLoadMetricsResponse:
        metrics = wire.load_to_pb(
            self.engine.load(), timestamp_ms=int(time.time() * 1000), draining=self.draining
        )
        return wpb.GetLoadMetricsResponse(metrics=metrics)

    async def GetLoadMetrics(
        self, request: wpb.GetLoadMetricsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.GetLoadMetricsResponse:
        return self._load()

    async def StreamLoadMetrics(
        self, request: wpb.StreamLoadMetricsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[wpb.StreamLoadMetricsResponse]:
        interval = (request.interval_ms or 100) / 1000
        while True:
            yield wpb.StreamLoadMetricsResponse(metrics=self._load().metrics)
            await asyncio.sleep(interval)

    async def GetModelCard(
        self, request: wpb.GetModelCardRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.GetModelCardResponse:
        return wpb.GetModelCardResponse(
            card=wire.card_to_pb(self.engine.info), worker_id=self.worker_id
        )

    async def ClearKvCache(
        self, request: wpb.ClearKvCacheRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.ClearKvCacheResponse:
        return wpb.ClearKvCacheResponse(blocks_cleared=await self.engine.clear_kv_cache())

    async def LoadLoraAdapter(
        self, request: wpb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.LoadLoraAdapterResponse:
        info = await self.engine.load_lora(request.lora_name, request.lora_path)
        return wpb.LoadLoraAdapterResponse(card=wire.card_to_pb(info))

    async def UnloadLoraAdapter(
        self, request: wpb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.UnloadLoraAdapterResponse:
        info = await self.engine.unload_lora(request.lora_name)
        return wpb.UnloadLoraAdapterResponse(card=wire.card_to_pb(info))

    async def Drain(
        self, request: wpb.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.DrainResponse:
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        return wpb.DrainResponse(cancelled_requests=await self.drain(timeout))

    async def Embed(
        self, request: wpb.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> wpb.EmbedResponse:
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining")
        prompts = [list(item.token_ids) for item in request.inputs]
        if not prompts or not all(prompts):
            raise InvalidRequest("Embed needs at least one input, and no empty input")
        task = asyncio.current_task()
        assert task is not None
        self._begin(task, task.cancel)
        try:
            vectors = await self.engine.embed(prompts)
        finally:
            self._end(task)
        return wpb.EmbedResponse(embeddings=[wpb.EmbeddingVector(values=v) for v in vectors])

    async def drain(self, timeout_s: float | None) -> int:
        """Refuse new requests, wait for in-flight ones (and, on a prefill worker, for decode
        workers to pull its pinned blocks); cancel leftovers. Returns how many."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            leftovers = list(self._inflight.values())
            for cancel in leftovers:
                cancel()
            return len(leftovers)
        pinned = self.engine.load().kv_pinned_blocks
        while pinned and (deadline is None or loop.time() < deadline):
            await asyncio.sleep(0.01)  # pinned blocks expire by themselves: this ends
            pinned = self.engine.load().kv_pinned_blocks
        return 0


def _log_context(request_id: str, trace: TraceContext | None) -> None:
    """Name the request in every log line of the current task (JSON logs)."""
    LOG_CONTEXT.set(
        LogContext(trace.trace_id, trace.span_id, request_id)
        if trace is not None
        else LogContext(request_id=request_id)
    )


class _StreamSession:
    """The requests of one GenerateStream, outputs batched per engine step.

    Each request is submitted to the engine with a sink that appends its outputs to a shared
    list; the stream handler sends whatever has accumulated as one message, so a whole engine
    step's tokens for this stream travel in one gRPC message, with no task per request.
    """

    def __init__(self, servicer: WorkerServicer) -> None:
        self.servicer = servicer
        self.outputs: list[wpb.StreamedGenerateOutput] = []
        self.running: dict[str, _StreamRequest] = {}
        self.wake = asyncio.Event()
        self.reading = True
        self.error: KvmeshError | None = None

    def emit(self, item: wpb.StreamedGenerateOutput) -> None:
        self.outputs.append(item)
        self.wake.set()

    def fail(self, request_id: str, exc: BaseException) -> None:
        if not isinstance(exc, KvmeshError):
            log.error("request %s failed", request_id, exc_info=exc)
        status = status_of(exc)
        self.emit(
            wpb.StreamedGenerateOutput(
                request_id=request_id,
                error_code=status.code,
                error_message=status.message,
                error_status=status.SerializeToString(),
            )
        )

    def done(self, req: _StreamRequest) -> None:
        if self.running.pop(req.request_id, None) is req:
            self.servicer._end(req)
        self.wake.set()

    async def read(self, requests: AsyncIterator[wpb.GenerateStreamRequest]) -> None:
        try:
            async for msg in requests:
                for start in msg.start:
                    self._start(start)
                for rid in msg.cancel_request_ids:
                    req = self.running.get(rid)
                    if req is not None:
                        req.cancel()
        finally:
            self.reading = False
            self.wake.set()

    def _start(self, start: wpb.StreamedGenerate) -> None:
        rid = start.request.request_id
        if not rid or rid in self.running:
            # Ambiguous outputs would follow: a protocol error that ends the whole stream.
            why = "is required" if not rid else f"{rid!r} is already running on this stream"
            self.error = InvalidRequest(f"request_id {why}", param="request_id")
            self.wake.set()
            return
        if self.servicer.draining:
            self.fail(rid, Unavailable(f"worker {self.servicer.worker_id} is draining"))
            return
        req = _StreamRequest(self, rid)
        try:
            engine_request = self.servicer.engine_request(start.request, rid)
            if start.traceparent:
                engine_request.trace = TraceContext.from_headers(
                    start.traceparent, start.tracestate
                )
            req.handle = self.servicer.engine.submit(engine_request, req)
        except Exception as exc:
            self.fail(rid, exc)
            return
        if not req.finished:
            self.running[rid] = req
            self.servicer._begin(req, req.cancel)

    async def batches(self) -> AsyncIterator[wpb.GenerateStreamResponse]:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.error is not None:
                raise self.error
            if self.outputs:
                batch, self.outputs = self.outputs, []
                yield wpb.GenerateStreamResponse(outputs=batch)
            elif not self.reading and not self.running:
                return

    def cancel_all(self) -> None:
        for req in list(self.running.values()):
            req.cancel()


class _StreamRequest:
    """OutputSink of one request on a GenerateStream."""

    __slots__ = ("finished", "handle", "request_id", "session")

    def __init__(self, session: _StreamSession, request_id: str) -> None:
        self.session = session
        self.request_id = request_id
        self.handle: RequestHandle | None = None
        self.finished = False

    def output(self, out: EngineOutput) -> None:
        item = wpb.StreamedGenerateOutput(request_id=self.request_id)
        wire.fill_output_pb(item.response, out)
        self.session.emit(item)
        if out.finish_reason is not None:
            self.finished = True
            self.session.done(self)

    def fail(self, exc: BaseException) -> None:
        self.finished = True
        self.session.fail(self.request_id, exc)
        self.session.done(self)

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            if self.handle is not None:
                self.handle.cancel()
            self.session.done(self)


# --- process ----------------------------------------------------------------------------------


class Worker:
    """A running worker: engine + gRPC server + discovery registration.

    `security`: how its server authenticates callers and its ReleaseKvBlocks client itself
    (mTLS or the mesh token); None: plaintext."""

    def __init__(
        self, config: WorkerConfig, engine: Engine, security: MeshSecurity | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.worker_id = config.worker_id or f"worker-{uuid.uuid4().hex[:12]}"
        self.releaser = GrpcKvReleaser(security=security)
        engine.configure_disaggregation(
            DisaggSettings(
                role=config.role,
                release_remote=self.releaser,
                pin_timeout_s=config.kv_pin_timeout_s,
                transfer_timeout_s=config.kv_transfer_timeout_s,
            )
        )
        self.servicer = WorkerServicer(engine, self.worker_id)
        self.server = mesh_server(config.host, config.port, security)
        self.server.add(wpb_grpc.add_WorkerServiceServicer_to_server, self.servicer, WORKER_SERVICE)
        self._registration: Registration | None = None
        self.metrics: MetricsServer | None = None
        """The Prometheus endpoint (--metrics-port; None: none)."""
        if config.metrics_port >= 0:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(
                WorkerCollector(self.worker_id, lambda: engine.info, engine.load, engine.stats)
            )
            self.metrics = MetricsServer(registry, config.host, config.metrics_port)

    @property
    def address(self) -> str:
        """host:port clients dial (the advertised host, if one is set)."""
        if self.config.advertise_host:
            return f"{self.config.advertise_host}:{self.server.port}"
        return self.server.address

    async def start(self) -> None:
        """Start the engine, the server, then register (undoing it all if that fails)."""
        await self.engine.start()
        await self.server.start()
        if self.metrics is not None:
            try:
                await self.metrics.start()
            except BaseException:
                await self.server.stop(0)
                await self.engine.stop()
                raise
        self.servicer.address = self.address
        if self.config.discovery:
            info = self.engine.info
            try:
                self._registration = await open_discovery(self.config.discovery).register(
                    Instance(
                        instance_id=self.worker_id,
                        address=self.address,
                        model=info.served_model_name,
                        role=info.role.value,
                    )
                )
            except BaseException:
                await self._stop_metrics()
                await self.server.stop(0)
                await self.engine.stop()
                raise
        log.info(
            "worker %s serving %s (%s) on %s%s",
            self.worker_id,
            self.engine.info.engine,
            self.engine.info.role.value,
            self.address,
            f", metrics on :{self.metrics.port}/metrics" if self.metrics is not None else "",
        )

    async def stop(self) -> None:
        """Deregister, drain, stop the server and the engine."""
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
            if self.config.leave_delay_s > 0:
                await asyncio.sleep(self.config.leave_delay_s)  # routers see us leave first
        await self.server.set_serving(False)
        cancelled = await self.servicer.drain(self.config.drain_timeout_s)
        if cancelled:
            log.warning("drain timed out; cancelled %d requests", cancelled)
        await self.server.stop(1.0)
        await self._stop_metrics()
        await self.engine.stop()
        await self.releaser.close()

    async def _stop_metrics(self) -> None:
        if self.metrics is not None:
            await self.metrics.stop()

    async def kill(self) -> None:
        """Stop at once, as a crash would look to peers: deregister, drop every call without
        draining, stop the engine (fault-injection tests; fatal errors)."""
        self.servicer.draining = True
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        await self.server.stop(0)
        await self._stop_metrics()
        await self.engine.stop()
        await self.releaser.close()
