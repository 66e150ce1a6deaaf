"""The gateway's backend: route a request, call the worker's Generate, stream the output.

Tokens travel worker -> gateway directly over the worker's multiplexed GenerateStream
(router.session); the router only decides. The W3C trace context travels with each request.
Closing the output iterator cancels the request on the worker, which cancels it inside the
engine.

Disaggregated pools (a model served by decode workers and no aggregated ones): the router picks
a decode worker D (load-aware, with its cached prefix known), then, unless the request should
prefill on D (conditional disaggregation, `DisaggConfig`), a prefill worker P (KV-aware: most
cached prefix, least queued prefill). P's PrefillRemote returns the first token, which goes to
the client at once, and a KV transfer handle; D gets the request with `remote_prefill`, pulls
the blocks, releases them on P and streams the remaining tokens. D prefills locally when the
uncached part of the prompt is short, when no prefill worker is alive, when the prefill pool is
saturated, or when PrefillRemote fails (P died, timed out); D itself recomputes the prompt when
the pull fails. If the client goes away or D fails before it finished, the gateway releases P's
blocks itself (ReleaseKvBlocks is idempotent; P also frees them when they expire).
`stats` counts which path requests took (exported by router.metrics.DisaggCollector).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.router.routing import RouteDecision, Router
from kvmesh.runtime import wire
from kvmesh.runtime.config import opt
from kvmesh.runtime.errors import InvalidRequest, NotFound, Unavailable
from kvmesh.runtime.grpcutil import error_from_rpc
from kvmesh.runtime.telemetry import tracer
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineOutput, EngineRequest, ModelInfo, PrefillResult, Role

log = logging.getLogger(__name__)

# Attempts per request when a worker is unavailable before it produced anything (one retry).
MAX_ATTEMPTS = 2
LORA_RPC_TIMEOUT_S = 120.0
"""How long a worker may take to load or unload a LoRA adapter."""


@dataclass
class DisaggConfig:
    """Conditional disaggregation: when a request of a disaggregated pool prefills remotely."""

    disagg_local_prefill_tokens: int = opt(
        512,
        "disaggregated pools: prefill on the decode worker when at most this many prompt tokens "
        "are not cached there (0: always prefill remotely when a prefill worker is alive)",
    )
    disagg_max_prefill_inflight: int = opt(
        0,
        "disaggregated pools: the prefill pool is saturated (requests prefill on their decode "
        "worker) when every prefill worker has this many prefills in flight from this gateway; "
        "0: never",
    )
    disagg_prefill_timeout_s: float = opt(
        60.0, "disaggregated pools: a remote prefill slower than this falls back to local prefill"
    )

    def __post_init__(self) -> None:
        if self.disagg_local_prefill_tokens < 0 or self.disagg_max_prefill_inflight < 0:
            raise ValueError("disagg thresholds must be >= 0")
        if not self.disagg_prefill_timeout_s > 0:
            raise ValueError("disagg_prefill_timeout_s must be > 0")


class LocalPrefill(enum.Enum):
    """Why a request of a disaggregated pool prefilled on its decode worker."""

    SHORT_PROMPT = "short_prompt"
    """The uncached part of the prompt is at most disagg_local_prefill_tokens."""
    NO_PREFILL_WORKER = "no_prefill_worker"
    PREFILL_SATURATED = "prefill_saturated"
    """Every prefill worker is busy (router thresholds or disagg_max_prefill_inflight)."""
    PREFILL_FAILED = "prefill_failed"
    """PrefillRemote failed or timed out (the prefill worker died, drained, ...)."""
    TRANSFER_FAILED = "transfer_failed"
    """The decode worker could not use the remote KV (pull failed, blocks released first) and
    recomputed the prompt."""


def local_prefill_reason(
    config: DisaggConfig, prompt_tokens: int, cached_tokens: int, prefill_inflight: Sequence[int]
) -> LocalPrefill | None:
    """Conditional disaggregation: why a request of a disaggregated pool should prefill on its
    decode worker, or None to prefill it remotely.

    `cached_tokens`: prompt tokens the decode worker already holds (the router's overlap in
    blocks x block size); `prefill_inflight`: requests in flight from this gateway on each live
    prefill worker (empty: none is alive). Pure: `MeshBackend` and the simulator
    (kvmesh.sim.disagg) both decide through it.
    """
    if not prefill_inflight:
        return LocalPrefill.NO_PREFILL_WORKER
    if prompt_tokens - cached_tokens <= config.disagg_local_prefill_tokens:
        return LocalPrefill.SHORT_PROMPT
    limit = config.disagg_max_prefill_inflight
    if limit and all(n >= limit for n in prefill_inflight):
        return LocalPrefill.PREFILL_SATURATED
    return None


class DisaggStats:
    """Counters of the disaggregated path (cheap; exported by router.metrics)."""

    __slots__ = ("kv_transfer_bytes", "local_prefills", "remote_prefills")

    def __init__(self) -> None:
        self.remote_prefills = 0
        """Requests prefilled by PrefillRemote and continued on a decode worker."""
        self.local_prefills = dict.fromkeys(LocalPrefill, 0)
        """Requests of disaggregated pools that prefilled on the decode worker, by reason."""
        self.kv_transfer_bytes = 0
        """Prompt KV bytes decode workers pulled from prefill workers."""


class MeshBackend:
    """GenerateBackend over a WorkerPool and a Router.

    `configured` holds the models this gateway is set up to serve (from its own model
    directory), so an expected model with no live worker is "unavailable" (503), not
    "unknown" (404). `disagg`: conditional disaggregation thresholds.
    """

    def __init__(
        self,
        pool: WorkerPool,
        router: Router,
        configured: dict[str, ModelInfo] | None = None,
        disagg: DisaggConfig | None = None,
    ) -> None:
        self.pool = pool
        self.router = router
        self.configured = dict(configured or {})
        self.disagg = disagg if disagg is not None else DisaggConfig()
        self.stats = DisaggStats()
        self._releases: set[asyncio.Task[None]] = set()

    def ready(self) -> bool:
        """A worker that can generate is live (prefill-only workers cannot serve alone)."""
        return any(w.info.role is not Role.PREFILL for w in self.pool.workers())

    def models(self) -> list[ModelInfo]:
        """The served models' cards; each lists the LoRA adapters loaded on any of its workers."""
        merged = {**self.configured, **self.pool.models()}
        adapters: dict[str, set[str]] = {}
        for w in self.pool.workers():
            adapters.setdefault(w.info.served_model_name, set()).update(w.info.lora_adapters)
        return [
            dataclasses.replace(info, lora_adapters=tuple(sorted(adapters.get(name, ()))))
            for name, info in merged.items()
        ]

    def model_info(self, model: str) -> ModelInfo | None:
        """The card of served model `model`, or of the base model of LoRA adapter `model`."""
        live = self.pool.models().get(model) or self.pool.adapters().get(model)
        return live if live is not None else self.configured.get(model)

    def _base_model(self, model: str, request: EngineRequest) -> str:
        """The served model a request for `model` (a model or, with `lora_name`, an adapter)
        runs on."""
        if not request.lora_name or model != request.lora_name:
            return model
        card = self.pool.adapters().get(model)
        if card is None:
            raise NotFound(f"LoRA adapter {model!r} is not loaded on any worker", param="model")
        return card.served_model_name

    # -- LoRA adapters ---------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str, model: str = "") -> list[str]:
        """Load adapter `name` from `path` on every worker of base model `model` (empty: the one
        served model) that supports LoRA; returns their worker ids. Raises the first worker's
        error (the workers that succeeded keep the adapter)."""
        workers = self._lora_workers(model)
        results = await asyncio.gather(
            *(
                w.stub.LoadLoraAdapter(
                    wpb.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
                    timeout=LORA_RPC_TIMEOUT_S,
                )
                for w in workers
            ),
            return_exceptions=True,
        )
        return self._apply_cards(workers, results)

    async def unload_lora(self, name: str) -> list[str]:
        """Unload adapter `name` from every worker that has it; returns their worker ids.
        NotFound when no worker has it."""
        workers = [w for w in self.pool.workers() if name in w.info.lora_adapters]
        if not workers:
            raise NotFound(f"LoRA adapter {name!r} is not loaded on any worker", param="lora_name")
        results = await asyncio.gather(
            *(
                w.stub.UnloadLoraAdapter(
                    wpb.UnloadLoraAdapterRequest(lora_name=name), timeout=LORA_RPC_TIMEOUT_S
                )
                for w in workers
            ),
            return_exceptions=True,
        )
        return self._apply_cards(workers, results)

    def _lora_workers(self, model: str) -> list[WorkerHandle]:
        if not model:
            served = {w.info.served_model_name for w in self.pool.workers()}
            if len(served) > 1:
                raise InvalidRequest(
                    "several models are served: name the adapter's base model in `model`",
                    param="model",
                )
            if not served:
                raise Unavailable("no workers are available")
            model = served.pop()
        workers = self.pool.workers(model)
        if not workers:
            raise NotFound(f"no worker serves model {model!r}", param="model")
        workers = [w for w in workers if "LORA" in w.info.capabilities]
        if not workers:
            raise InvalidRequest(
                f"the workers of model {model!r} do not support LoRA adapters", param="model"
            )
        return workers

    def _apply_cards(self, workers: Sequence[WorkerHandle], results: Sequence[object]) -> list[str]:
        error: BaseException | None = None
        done: list[str] = []
        for w, res in zip(workers, results, strict=True):
            if isinstance(res, grpc.aio.AioRpcError):
                error = error or error_from_rpc(res)
            elif isinstance(res, BaseException):
                error = error or res
            else:
                card = getattr(res, "card", None)
                if card is not None:
                    self.pool.update_card(w, wire.card_from_pb(card))
                done.append(w.worker_id)
        if error is not None:
            raise error
        return done

    def disaggregated(self, model: str) -> bool:
        """Whether `model` is served by decode workers (and no aggregated ones)."""
        roles = {w.info.role for w in self.pool.workers(model)}
        return Role.DECODE in roles and Role.AGGREGATED not in roles

    async def generate(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncIterator[EngineOutput]:
        model = self._base_model(model, request)
        if self.disaggregated(model):
            stream = self._generate_disaggregated(model, request, trace)
        else:
            stream = self._generate_aggregated(model, request, trace)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def _generate_aggregated(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        tried: list[str] = []
        while True:
            decision = await self._route(model, request, trace, rid, exclude=tried)
            worker = decision.worker
            started = False
            try:
                async for out in self._stream(worker, request, trace, first_token=True):
                    started = True
                    yield out
                return
            except Unavailable as exc:
                # The worker died or is draining and nothing reached the client yet: avoid it
                # and try another one (a dead worker stays in discovery until its lease ends).
                if started or len(tried) + 1 >= MAX_ATTEMPTS:
                    raise
                WorkerPool.mark_down(worker)
                tried.append(worker.worker_id)
                log.info(
                    "request %s: worker %s unavailable (%s); retrying",
                    rid,
                    worker.worker_id,
                    exc.message,
                )
            finally:
                self.router.finished(rid)

    async def _stream(
        self,
        worker: WorkerHandle,
        request: EngineRequest,
        trace: TraceContext | None,
        *,
        first_token: bool,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stream `request` from `worker`; `first_token`: tell the router when it arrives.
        The worker's spans are children of `trace` (the gateway's span)."""
        stream = worker.session.generate(wire.request_to_pb(request), trace)
        try:
            async for msg in stream:
                if first_token:
                    first_token = False
                    self.router.first_token(request.request_id)
                yield wire.output_from_pb(msg)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # -- embeddings ------------------------------------------------------------------------------

    async def embed(
        self, model: str, prompts: list[list[int]], trace: TraceContext | None
    ) -> list[list[float]]:
        """Embed `prompts` on one worker of `model` (the router's pick for the first prompt)."""
        rid = f"embed-{uuid.uuid4().hex}"
        decision = await self.router.route(model, prompts[0], rid)
        child = trace.child() if trace is not None else None
        request = wpb.EmbedRequest(
            request_id=rid, inputs=[wpb.EmbedInput(token_ids=p) for p in prompts]
        )
        try:
            resp = await decision.worker.stub.Embed(
                request, metadata=child.grpc_metadata() if child is not None else None
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            self.router.finished(rid)
        return [list(v.values) for v in resp.embeddings]

    # -- disaggregated ---------------------------------------------------------------------------

    async def _generate_disaggregated(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        decision = await self._route(model, request, trace, rid, role=Role.DECODE)
        decode = decision.worker
        try:
            reason = self._local_reason(model, request, decode, decision.overlap_blocks)
            prefilled: tuple[PrefillResult, WorkerHandle] | None = None
            if reason is None:
                prefilled, reason = await self._prefill(model, request, decode, trace)
            if prefilled is None:
                assert reason is not None
                self.stats.local_prefills[reason] += 1
                async for out in self._stream(decode, request, trace, first_token=True):
                    yield out
                return
            result, prefill = prefilled
            self.router.first_token(rid)
            rp = result.remote
            first = EngineOutput(
                [rp.first_token_id], [rp.first_logprob] if rp.first_logprob is not None else None
            )
            if result.finish_reason is not None:  # the first token ended it on P
                first.finish_reason = result.finish_reason
                first.usage = result.usage
                first.stop_token_id = result.stop_token_id
                yield first
                return
            self.stats.remote_prefills += 1
            yield first
            completed = False
            try:
                remote = dataclasses.replace(request, remote_prefill=rp)
                async for out in self._stream(decode, remote, trace, first_token=False):
                    if out.finish_reason is not None:
                        completed = True
                        self.stats.kv_transfer_bytes += out.kv_transfer_bytes
                        if out.remote_prefill_fallback:
                            self.stats.local_prefills[LocalPrefill.TRANSFER_FAILED] += 1
                    yield out
            finally:
                if not completed and rp.handle is not None:
                    # D failed or the client left: D may not have released P's blocks.
                    self._release_later(prefill, rp.handle.transfer_id)
        finally:
            self.router.finished(rid)

    def _local_reason(
        self, model: str, request: EngineRequest, decode: WorkerHandle, overlap_blocks: int
    ) -> LocalPrefill | None:
        """Why `request` should prefill on its decode worker (None: remotely)."""
        return local_prefill_reason(
            self.disagg,
            len(request.prompt),
            overlap_blocks * decode.info.kv_block_size,
            [w.inflight for w in self.pool.workers(model) if w.info.role is Role.PREFILL],
        )

    async def _prefill(
        self,
        model: str,
        request: EngineRequest,
        decode: WorkerHandle,
        trace: TraceContext | None,
    ) -> tuple[tuple[PrefillResult, WorkerHandle] | None, LocalPrefill | None]:
        """PrefillRemote on a prefill worker: (result and worker, None), or (None, why not).
        Errors the decode worker would raise too (invalid request) propagate."""
        prid = f"{request.request_id}/prefill"
        try:
            decision = await self._route(model, request, trace, prid, role=Role.PREFILL)
        except Unavailable:
            return None, LocalPrefill.PREFILL_SATURATED
        worker = decision.worker
        try:
            resp = await worker.stub.PrefillRemote(
                wire.prefill_request_to_pb(request, decode.worker_id),
                timeout=self.disagg.disagg_prefill_timeout_s,
                metadata=trace.grpc_metadata() if trace is not None else None,
            )
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc)
            if isinstance(err, (InvalidRequest, NotFound)):
                raise err from None
            log.warning(
                "remote prefill of %s on %s failed (%s: %s); prefilling on %s",
                request.request_id,
                worker.worker_id,
                exc.code().name,
                err.message,
                decode.worker_id,
            )
            return None, LocalPrefill.PREFILL_FAILED
        finally:
            self.router.finished(prid)
        return (wire.prefill_result_from_pb(resp), worker), None

    async def _route(
        self,
        model: str,
        request: EngineRequest,
        trace: TraceContext | None,
        request_id: str,
        *,
        role: Role | None = None,
        exclude: Sequence[str] = (),
    ) -> RouteDecision:
        """The router's choice for `request` (booked under `request_id`), recorded as a `route`
        span (chosen worker, overlap, cost, policy) when the trace is sampled."""
        route = self.router.route(
            model,
            request.prompt,
            request_id,
            lora_name=request.lora_name,
            exclude=exclude,
            role=role,
            expected_output_tokens=0 if role is Role.PREFILL else request.stop.max_tokens or 0,
        )
        t = tracer()
        if trace is None or not trace.sampled or not t.enabled:
            return await route
        span = t.start("route", trace)
        try:
            decision = await route
        except BaseException as exc:
            span.error(type(exc).__name__, str(exc))
            span.end()
            raise
        span.update(
            {
                "kvmesh.request_id": request.request_id,
                "kvmesh.route.worker_id": decision.worker.worker_id,
                "kvmesh.route.role": decision.worker.info.role.value,
                "kvmesh.route.overlap_blocks": decision.overlap_blocks,
                "kvmesh.route.prompt_blocks": decision.prompt_blocks,
                "kvmesh.route.cost": decision.cost,
                "kvmesh.route.policy": decision.policy,
                "kvmesh.route.overhead_us": decision.routing_overhead_s * 1e6,
            }
        )
        span.end()
        return decision

    def _release_later(self, worker: WorkerHandle, transfer_id: str) -> None:
        async def release() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await worker.stub.ReleaseKvBlocks(
                    wpb.ReleaseKvBlocksRequest(transfer_id=transfer_id), timeout=5.0
                )

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
