"""The router as a gRPC service (`kvmesh router`), and its client for frontends.

The service owns a WorkerPool and a Router; `Route` answers with a worker, `Generate` routes
and proxies the token stream, `SubscribeLoadEvents` streams a KV router's bookings to its peer
replicas (kvmesh.router.kv_subscriber.PeerLoadSync). `RemoteRouter` implements the Router
interface over the service, so a frontend can swap its in-process router for a shared one
without other changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import grpc

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.router.v1 import router_service_pb2 as rpb
from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.router.backend import BackendConfig, MeshBackend
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.kv_subscriber import load_event_to_pb
from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.router.routing import RouteDecision, Router
from kvmesh.runtime import wire
from kvmesh.runtime.errors import InvalidRequest, Unavailable, Unimplemented
from kvmesh.runtime.grpcutil import GrpcServer, error_from_rpc, mesh_channel, watch_health
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import Role

_ROLE_FROM_PB = {
    cpb.WORKER_ROLE_AGGREGATED: Role.AGGREGATED,
    cpb.WORKER_ROLE_PREFILL: Role.PREFILL,
    cpb.WORKER_ROLE_DECODE: Role.DECODE,
}
_ROLE_TO_PB = {v: k for k, v in _ROLE_FROM_PB.items()}

ROUTER_SERVICE = rpb.DESCRIPTOR.services_by_name["RouterService"].full_name


def _only_model(pool: WorkerPool, model: str) -> str:
    if model:
        return model
    names = list(pool.models())
    if len(names) == 1:
        return names[0]
    if not names:
        raise Unavailable("no workers are available")
    raise InvalidRequest("model is required when several models are served", param="model")


class RouterServicer(rpb_grpc.RouterServiceServicer):
    """RouterService over an in-process Router and its WorkerPool."""

    def __init__(
        self, pool: WorkerPool, router: Router, config: BackendConfig | None = None
    ) -> None:
        self.pool = pool
        self.router = router
        self.backend = MeshBackend(pool, router, disagg=config)

    async def Route(
        self, request: rpb.RouteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.RouteResponse:
        if not request.token_ids:
            raise InvalidRequest("token_ids must not be empty", param="token_ids")
        model = _only_model(self.pool, request.model)
        request_id = request.request_id or uuid.uuid4().hex
        decision = await self.router.route(
            model,
            request.token_ids,
            request_id,
            lora_name=request.lora_name,
            exclude=request.exclude_worker_ids,
            role=_ROLE_FROM_PB.get(request.role),
            expected_output_tokens=request.expected_output_tokens,
            dry_run=request.dry_run,
        )
        return rpb.RouteResponse(
            worker_id=decision.worker.worker_id,
            address=decision.worker.address,
            overlap_blocks=decision.overlap_blocks,
            prompt_blocks=decision.prompt_blocks,
            request_id=request_id,
        )

    async def ReportRequestState(
        self, request: rpb.ReportRequestStateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.ReportRequestStateResponse:
        if request.state == rpb.REQUEST_STATE_FIRST_TOKEN:
            self.router.first_token(request.request_id)
        elif request.state in (rpb.REQUEST_STATE_FINISHED, rpb.REQUEST_STATE_CANCELLED):
            self.router.finished(request.request_id, request.output_tokens)
        else:
            raise InvalidRequest("state must be FIRST_TOKEN, FINISHED or CANCELLED", param="state")
        return rpb.ReportRequestStateResponse(known=True)

    async def Generate(
        self, request: rpb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[rpb.GenerateResponse]:
        inner = request.request
        if not inner.token_ids:
            raise InvalidRequest("request.token_ids must not be empty", param="token_ids")
        model = _only_model(self.pool, request.model)
        req = wire.request_from_pb(inner, default_id=uuid.uuid4().hex)
        trace = TraceContext.from_grpc_metadata(context.invocation_metadata() or ())
        stream = self.backend.generate(model, req, trace)
        try:
            async for out in stream:
                yield rpb.GenerateResponse(response=wire.output_to_pb(out))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def SubscribeLoadEvents(
        self, request: rpb.SubscribeLoadEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[rpb.SubscribeLoadEventsResponse]:
        if not isinstance(self.router, KvRouter):
            raise Unimplemented("only the KV router shares predicted load with its replicas")
        # Headers now: a replica with no bookings sends nothing for a while, and its peers
        # want to know that the stream is open.
        await context.send_initial_metadata(())
        events = self.router.load_events(request.subscriber_id)
        try:
            async for event in events:
                yield load_event_to_pb(event)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def SubscribeLoadEventBatches(
        self,
        request: rpb.SubscribeLoadEventBatchesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[rpb.SubscribeLoadEventBatchesResponse]:
        if not isinstance(self.router, KvRouter):
            raise Unimplemented("only the KV router shares predicted load with its replicas")
        await context.send_initial_metadata(())  # as SubscribeLoadEvents
        batches = self.router.load_event_batches(request.subscriber_id)
        try:
            async for batch in batches:
                yield rpb.SubscribeLoadEventBatchesResponse(
                    events=[load_event_to_pb(event) for event in batch]
                )
        finally:
            await batches.aclose()  # type: ignore[attr-defined]

    async def ListWorkers(
        self, request: rpb.ListWorkersRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.ListWorkersResponse:
        workers = self.pool.workers(request.model or None)
        infos = []
        for w in workers:
            info = rpb.WorkerInfo(
                worker_id=w.worker_id, address=w.address, card=wire.card_to_pb(w.info)
            )
            if isinstance(self.router, KvRouter):
                sched = self.router.scheduler
                info.indexed_blocks = sched.indexer.num_blocks(w.worker_id) or (
                    sched.approx.num_blocks(w.worker_id)
                )
                load = sched.worker(w.worker_id)
                if load is not None and load.sample is not None:
                    sample = load.sample
                    info.load.CopyFrom(
                        cpb.LoadMetrics(
                            num_running_requests=sample.num_running,
                            num_waiting_requests=sample.num_waiting,
                            kv_active_blocks=sample.kv_active_blocks,
                            kv_total_blocks=sample.kv_total_blocks,
                            pending_prefill_tokens=sample.pending_prefill_tokens,
                            draining=sample.draining,
                        )
                    )
            infos.append(info)
        return rpb.ListWorkersResponse(workers=infos)


async def serve_when_routable(server: GrpcServer, pool: WorkerPool) -> None:
    """Keep the service's health SERVING only while its pool has a worker that can generate
    (prefill-only workers cannot serve alone): gateways using this router count it ready then,
    so none answers 503 while this router has not joined the workers yet."""
    serving: bool | None = None
    async for workers in pool.watch_workers():
        now = any(w.info.role is not Role.PREFILL for w in workers)
        if now != serving:
            serving = now
            await server.set_serving(now)


JOIN_WAIT_S = 2.0
"""How long a gateway waits for its own pool to join a worker its router service chose."""


class RemoteRouter:
    """Router interface backed by a `kvmesh router` service.

    Decisions come from the service; the worker handles (channels, model cards) come from the
    frontend's own WorkerPool, keyed by worker id. `ready()` follows the service's health: it
    is SERVING once the service has joined a worker that can generate. Construct it on the
    event loop; `close()` when done. The channel to the service authenticates as
    the pool's (`pool.security`).
    """

    def __init__(self, address: str, pool: WorkerPool) -> None:
        self.pool = pool
        self._channel = mesh_channel(address, pool.security)
        self._stub = rpb_grpc.RouterServiceStub(self._channel)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serving = False
        self._health = asyncio.get_running_loop().create_task(
            self._follow_health(), name="router-health"
        )

    def ready(self) -> bool:
        """Whether the router service reports SERVING (it has joined a worker that can
        generate), as its grpc.health.v1 Watch last said."""
        return self._serving

    async def _follow_health(self) -> None:
        delay = 0.05
        while True:
            try:
                async for serving in watch_health(self._channel):
                    self._serving = serving
                    delay = 0.05
            except grpc.aio.AioRpcError:
                pass
            self._serving = False  # the service went away: not ready until it answers again
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        request_id: str,
        *,
        lora_name: str = "",
        exclude: Collection[str] = (),
        role: Role | None = None,
        expected_output_tokens: int = 0,
        dry_run: bool = False,
    ) -> RouteDecision:
        try:
            resp = await self._stub.Route(
                rpb.RouteRequest(
                    model=model,
                    token_ids=token_ids,
                    lora_name=lora_name,
                    request_id=request_id,
                    role=cpb.WORKER_ROLE_UNSPECIFIED if role is None else _ROLE_TO_PB[role],
                    exclude_worker_ids=exclude,
                    expected_output_tokens=expected_output_tokens,
                    dry_run=dry_run,
                ),
                timeout=5.0,
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        worker = await self._worker(resp.worker_id)
        if worker is not None:
            return RouteDecision(worker, resp.overlap_blocks, resp.prompt_blocks, policy="remote")
        self._report(request_id, rpb.REQUEST_STATE_CANCELLED)
        raise Unavailable(
            f"router chose worker {resp.worker_id}, which this frontend has not found in "
            f"discovery within {JOIN_WAIT_S:g} s"
        )

    async def _worker(self, worker_id: str) -> WorkerHandle | None:
        """This frontend's handle of `worker_id`, waiting up to JOIN_WAIT_S for its pool to
        join it: the service and this frontend follow the same discovery, but each joins a
        new worker on its own poll (right after start-up, the service may know a worker this
        frontend does not yet)."""
        for w in self.pool.workers():
            if w.worker_id == worker_id:
                return w
        with contextlib.suppress(TimeoutError):
            async with (
                asyncio.timeout(JOIN_WAIT_S),
                contextlib.aclosing(self.pool.watch_workers()) as watch,
            ):
                async for workers in watch:
                    for w in workers:
                        if w.worker_id == worker_id:
                            return w
        return None

    def _report(
        self, request_id: str, state: rpb.RequestState.ValueType, output_tokens: int = 0
    ) -> None:
        task = asyncio.get_running_loop().create_task(
            self._send_report(request_id, state, output_tokens)
        )
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _send_report(
        self, request_id: str, state: rpb.RequestState.ValueType, output_tokens: int = 0
    ) -> None:
        msg = rpb.ReportRequestStateRequest(
            request_id=request_id, state=state, output_tokens=output_tokens
        )
        await self._stub.ReportRequestState(msg, timeout=5.0)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # consumed: a lost report only delays freeing predicted load

    def first_token(self, request_id: str) -> None:
        self._report(request_id, rpb.REQUEST_STATE_FIRST_TOKEN)

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self._report(request_id, rpb.REQUEST_STATE_FINISHED, output_tokens)

    async def close(self) -> None:
        """Stop following the service's health and close the channel to it."""
        self._health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health
        await self._channel.close()
