"""The gateway's backend: route a request, call the worker's Generate, stream the output.

Tokens travel worker -> gateway directly over the worker's multiplexed GenerateStream
(router.session); the router only decides. The W3C trace context travels with each request.
Closing the output iterator cancels the request on the worker, which cancels it inside the
engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import Router
from kvmesh.tracing import TraceContext
from kvmesh.workers import wire
from kvmesh.workers.engine import EngineOutput, EngineRequest, ModelInfo


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
            model,
            request.prompt,
            request.request_id,
            lora_name=request.lora_name,
            expected_output_tokens=request.stop.max_tokens or 0,
        )
        child = trace.child() if trace is not None else None
        stream = decision.worker.session.generate(wire.request_to_pb(request), child)
        first = True
        try:
            async for msg in stream:
                if first:
                    first = False
                    self.router.first_token(request.request_id)
                yield wire.output_from_pb(msg)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self.router.finished(request.request_id)
