"""The gateway's backend: route a request, call the worker's Generate, stream the output.

Tokens travel worker -> gateway directly; the router only decides. Trace context rides the
gRPC metadata of the worker call. Closing the output iterator cancels the worker call, which
cancels the request inside the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import Router
from kvmesh.workers import wire
from kvmesh.workers.engine import EngineOutput, EngineRequest, ModelInfo

from kvmesh.errors import Unavailable
from kvmesh.grpcutil import error_from_rpc
from kvmesh.tracing import TraceContext


class MeshBackend:
    """GenerateBackend over a WorkerPool and a Router.

    `configured` holds the models this gateway is set up to serve (from its own model
    directory), so an expected model with no live worker is "unavailable" (503), not
    "unknown" (404).
    """

    def __init__(
        self, pool: WorkerPool, router: Router, configured: dict[str, ModelInfo] | None = None
    ) -> None:
        self.pool = pool
        self.router = router
        self.configured = dict(configured or {})

    def ready(self) -> bool:
        return bool(self.pool.workers())

    def models(self) -> list[ModelInfo]:
        merged = {**self.configured, **self.pool.models()}
        return list(merged.values())

    def model_info(self, model: str) -> ModelInfo | None:
        live = self.pool.models().get(model)
        return live if live is not None else self.configured.get(model)

    async def generate(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncIterator[EngineOutput]:
        decision = await self.router.route(
            model, request.prompt, request.request_id, lora_name=request.lora_name
        )
        metadata = trace.child().grpc_metadata() if trace is not None else ()
        call = decision.worker.stub.Generate(wire.request_to_pb(request), metadata=metadata)
        first = True
        try:
            async for msg in call:
                if first:
                    first = False
                    self.router.first_token(request.request_id)
                yield wire.output_from_pb(msg)
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc)
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise Unavailable(f"worker {decision.worker.worker_id}: {err.message}") from None
            raise err from None
        finally:
            call.cancel()
            self.router.finished(request.request_id)
