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
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.router.admission import Admission, AdmissionConfig
from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.router.routing import RouteDecision, Router, router_ready
from kvmesh.router.session import MAX_BUFFERED_OUTPUTS, RequestPaused, WorkerLost
from kvmesh.runtime import wire
from kvmesh.runtime.config import opt
from kvmesh.runtime.errors import InvalidRequest, NotFound, Unavailable
from kvmesh.runtime.grpcutil import error_from_rpc
from kvmesh.runtime.multimodal import salt_placeholders
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.telemetry import AttributeValue, Step, tracer
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    ModelInfo,
    PrefillResult,
    Role,
    Usage,
)

log = logging.getLogger(__name__)

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


@dataclass
class MigrationConfig:
    """Request migration and per-request flow control."""

    migration_limit: int = opt(
        3,
        "times one request may move to another worker when its worker dies, hangs or cancels "
        "it mid-stream (resuming after the tokens already sent); 0: never",
    )
    max_buffered_outputs: int = opt(
        MAX_BUFFERED_OUTPUTS,
        "outputs one request may buffer for a client that does not read them; past it the "
        "worker stops generating for it (resumed when the client reads again, or ended); 0: no "
        "limit",
    )

    def __post_init__(self) -> None:
        if self.migration_limit < 0 or self.max_buffered_outputs < 0:
            raise ValueError("migration_limit and max_buffered_outputs must be >= 0")


@dataclass
class BackendConfig(DisaggConfig, MigrationConfig, AdmissionConfig):
    """Everything a MeshBackend is configured with."""


class MigrationReason(enum.Enum):
    """Why a request moved to another worker (kvmesh_migrations_total{reason})."""

    STREAM_LOST = "stream_lost"
    """The connection or stream to its worker broke (the worker died or was cut off)."""
    UNRESPONSIVE = "unresponsive"
    """Health checks found its worker hung and ejected it."""
    WORKER_CANCELLED = "worker_cancelled"
    """Its worker cancelled it (a drain that timed out)."""
    WORKER_UNAVAILABLE = "worker_unavailable"
    """Its worker refused it (draining, stopping) before producing anything."""


def resume_request(
    request: EngineRequest, generated: Sequence[int], info: ModelInfo
) -> EngineRequest | None:
    """The request that continues `request` after the output tokens `generated` on a worker with
    card `info`, or None when that worker cannot continue it identically.

    Nothing generated yet: `request` itself. Otherwise the prompt plus `generated`, with what is
    left of max_tokens and min_tokens: marked as resumed output (`resumed_output_tokens`) for
    engines with the RESUME capability, which continue the same output in every sampling mode;
    for other engines only greedy requests without presence/frequency penalties continue
    identically (a longer prompt is then the same computation). Guided decoding never does (the
    grammar state is the engine's).
    """
    if not generated:
        return request
    s = request.sampling
    if s.guided is not None:
        return None
    resumed = len(generated) if "RESUME" in info.capabilities else 0
    if not resumed and (s.temperature > 0 or s.presence_penalty or s.frequency_penalty):
        return None
    stop = request.stop
    k = len(generated)
    return dataclasses.replace(
        request,
        prompt=[*request.prompt, *generated],
        stop=dataclasses.replace(
            stop,
            max_tokens=None if stop.max_tokens is None else stop.max_tokens - k,
            min_tokens=max(0, stop.min_tokens - k),
        ),
        remote_prefill=None,
        resumed_output_tokens=request.resumed_output_tokens + resumed if resumed else 0,
    )


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
    """Counters of the disaggregated path, of migrations and of paused streams (cheap; exported
    by router.metrics)."""

    __slots__ = ("kv_transfer_bytes", "local_prefills", "migrations", "pauses", "remote_prefills")

    def __init__(self) -> None:
        self.migrations = dict.fromkeys(MigrationReason, 0)
        """Requests moved to another worker mid-request, by reason."""
        self.pauses = 0
        """Times a request's worker stopped generating for a client that did not read."""
        self.remote_prefills = 0
        """Requests prefilled by PrefillRemote and continued on a decode worker."""
        self.local_prefills = dict.fromkeys(LocalPrefill, 0)
        """Requests of disaggregated pools that prefilled on the decode worker, by reason."""
        self.kv_transfer_bytes = 0
        """Prompt KV bytes decode workers pulled from prefill workers."""


class _Progress:
    """What one request produced so far, over every worker it ran on."""

    __slots__ = (
        "admitted",
        "generated",
        "migration",
        "migrations",
        "prompt_tokens",
        "resumed",
        "worker",
    )

    def __init__(self, request: EngineRequest) -> None:
        self.prompt_tokens = len(request.prompt)
        self.generated: list[int] = []
        """Output tokens delivered to the consumer."""
        self.migrations = 0
        self.migration: tuple[MigrationReason, str] | None = None
        """The last move: why, and from which worker."""
        self.resumed = False
        """An attempt continued after earlier output (usage is then recounted)."""
        self.admitted = False
        """The request holds an admission slot."""
        self.worker: WorkerHandle | None = None
        """The worker of the current attempt (None while routing)."""


class MeshBackend:
    """GenerateBackend over a WorkerPool and a Router.

    `configured` holds the models this gateway is set up to serve (from its own model
    directory), so an expected model with no live worker is "unavailable" (503), not
    "unknown" (404). `disagg`: conditional disaggregation thresholds, and, when it is a
    BackendConfig, migration and admission settings.

    Resilience: each generation is admitted first (`admission`: concurrency limit, per-worker
    limits, bounded queue with timeout; kvmesh.router.admission). When its worker dies, hangs
    (ejected by health checks), refuses it or cancels it before it finished, the request moves to
    another worker (`MigrationConfig.migration_limit` times at most) and continues after the
    tokens already delivered (`resume_request`): the consumer sees one stream, with no token
    repeated or missing and usage counted once. A request whose consumer stops reading is
    stopped on its worker and resumed where it stopped once the consumer has caught up
    (kvmesh.router.session flow control).
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
        if isinstance(disagg, BackendConfig):
            config = disagg
        else:
            config = BackendConfig(**dataclasses.asdict(disagg)) if disagg else BackendConfig()
        self.config = config
        self.disagg: DisaggConfig = config
        self.stats = DisaggStats()
        self.admission = Admission(config)
        self._releases = TaskSet()
        pool.add_listener(lambda _w, joined: self.admission.wake() if joined else None)

    def ready(self) -> bool:
        """A worker that can generate is live and answering (prefill-only workers cannot serve
        alone; ejected and draining workers take no new work), and the router can route (a
        router service has joined one too)."""
        return router_ready(self.router) and any(
            w.info.role is not Role.PREFILL and w.available for w in self.pool.workers()
        )

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
        progress = _Progress(request)
        disaggregated = self.disaggregated(model)
        exclude: list[str] = []
        cause: Exception | None = None
        try:
            while True:
                if disaggregated and cause is None:
                    stream = self._generate_disaggregated(model, request, trace, progress)
                else:
                    role = Role.DECODE if disaggregated else None
                    stream = self._attempt(model, request, trace, progress, exclude, role, cause)
                try:
                    try:
                        async for out in stream:
                            yield out
                    finally:
                        await stream.aclose()
                    return
                except RequestPaused as exc:
                    cause = exc  # resumed where it stopped, on any worker (its own is likely)
                except Unavailable as exc:
                    if not self._migrate(request, progress, exc, exclude, trace):
                        raise
                    cause = exc
        finally:
            if progress.admitted:
                self.admission.finished()

    def _migrate(
        self,
        request: EngineRequest,
        progress: _Progress,
        exc: Unavailable,
        exclude: list[str],
        trace: TraceContext | None,
    ) -> bool:
        """Whether the request moves on after `exc` ended its attempt on `progress.worker`
        (and if so, the failed worker is avoided and the migration counted)."""
        worker = progress.worker
        if worker is None:  # routing failed: no worker to move from
            return False
        if isinstance(exc, WorkerLost):
            reason = MigrationReason(exc.cause)
        else:
            reason = MigrationReason.WORKER_UNAVAILABLE
        if reason is not MigrationReason.UNRESPONSIVE:
            WorkerPool.mark_down(worker)  # (health checks already ejected an unresponsive one)
        if progress.migrations >= self.config.migration_limit:
            log.warning(
                "request %s: %s on worker %s; migration limit (%d) reached",
                request.request_id,
                exc.message,
                worker.worker_id,
                self.config.migration_limit,
            )
            return False
        progress.migrations += 1
        progress.migration = (reason, worker.worker_id)
        exclude.append(worker.worker_id)
        self.stats.migrations[reason] += 1
        log.warning(
            "request %s%s: %s on worker %s after %d tokens; migrating (%d of %d)",
            request.request_id,
            f" (trace {trace.trace_id})" if trace is not None else "",
            exc.message,
            worker.worker_id,
            len(progress.generated),
            progress.migrations,
            self.config.migration_limit,
        )
        return True

    async def _route(
        self,
        model: str,
        prompt: Sequence[int],
        request: EngineRequest,
        trace: TraceContext | None,
        progress: _Progress,
        *,
        exclude: Sequence[str] = (),
        role: Role | None = None,
    ) -> RouteDecision:
        """Admit the request (or, once admitted, re-admit it at the head of the queue) and book a
        worker for it (a `route` span; after a migration it says why and from where)."""
        progress.worker = None
        moved: dict[str, AttributeValue] = {}
        if progress.migration is not None:
            reason, source = progress.migration
            moved = {
                "kvmesh.migration.reason": reason.value,
                "kvmesh.migration.from_worker_id": source,
                "kvmesh.migration.count": progress.migrations,
                "kvmesh.migration.resumed_tokens": len(progress.generated),
            }

        def route() -> Awaitable[RouteDecision]:
            return self._traced_route(
                model,
                prompt,
                request,
                trace,
                request.request_id,
                exclude=exclude,
                role=role,
                attributes=moved,
            )

        admitted = progress.admitted
        decision = await self.admission.admit(route, new=not admitted, urgent=admitted)
        progress.admitted = True
        progress.worker = decision.worker
        return decision

    def _paused(self) -> None:
        self.stats.pauses += 1

    def _booking_ended(self, request_id: str, output_tokens: int = 0) -> None:
        self.router.finished(request_id, output_tokens)
        self.admission.wake()

    async def _attempt(
        self,
        model: str,
        request: EngineRequest,
        trace: TraceContext | None,
        progress: _Progress,
        exclude: Sequence[str],
        role: Role | None,
        cause: Exception | None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """One attempt at `request` on a worker (after `cause` ended the previous one), continuing
        after the output delivered so far."""
        done = progress.generated
        if done:
            stop = request.stop
            info = self.model_info(model)
            context = info.context_length if info is not None else 0
            if (stop.max_tokens is not None and len(done) >= stop.max_tokens) or (
                context and progress.prompt_tokens + len(done) >= context
            ):  # the output was complete; only the final message was lost
                yield EngineOutput(
                    [],
                    finish_reason=FinishReason.LENGTH,
                    usage=Usage(progress.prompt_tokens, len(done)),
                )
                return
        prompt = [*request.prompt, *done] if done else request.prompt
        decision = await self._route(
            model, prompt, request, trace, progress, exclude=exclude, role=role
        )
        try:
            attempt = resume_request(request, done, decision.worker.info)
            if attempt is None:
                assert cause is not None  # nothing generated: the request itself is resumable
                log.warning(
                    "request %s cannot be resumed identically on %s (its sampling state is the "
                    "engine's); not migrated",
                    request.request_id,
                    decision.worker.info.engine,
                )
                raise cause
            progress.resumed = progress.resumed or bool(done)
            async for out in self._stream(
                decision.worker, attempt, trace, progress, first_token=not done
            ):
                yield out
        finally:
            self._booking_ended(request.request_id)

    async def _stream(
        self,
        worker: WorkerHandle,
        request: EngineRequest,
        trace: TraceContext | None,
        progress: _Progress,
        *,
        first_token: bool,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stream `request` from `worker`; `first_token`: tell the router when it arrives.
        The worker's spans are children of `trace` (the gateway's span)."""
        limit = self.config.max_buffered_outputs
        stream = worker.session.generate(
            wire.request_to_pb(request),
            trace,
            max_buffered=limit,
            pausable=bool(limit) and resume_request(request, [0], worker.info) is not None,
            on_stop=self._paused,
        )
        generated = progress.generated
        before = len(generated)  # output of earlier attempts (a migrated request)
        try:
            async for msg in stream:
                if first_token:
                    first_token = False
                    self.router.first_token(request.request_id)
                out = wire.output_from_pb(msg)
                if out.finish_reason is FinishReason.CANCELLED:
                    # Not this consumer's doing: the worker gave up on it (a drain timed out).
                    if out.token_ids:
                        generated += out.token_ids
                        yield EngineOutput(out.token_ids, out.logprobs)
                    raise WorkerLost(
                        f"worker {worker.worker_id} cancelled the request",
                        MigrationReason.WORKER_CANCELLED.value,
                    )
                generated += out.token_ids
                if out.usage is not None and progress.resumed:
                    out.usage = Usage(
                        progress.prompt_tokens, len(generated), out.usage.cached_tokens
                    )
                if out.finish_reason is not None:
                    # Done on the worker: free its booking now, before the caller answers the
                    # client (who may send the next turn at once) and closes this generator.
                    self._booking_ended(request.request_id, len(generated) - before)
                yield out
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
        self,
        model: str,
        request: EngineRequest,
        trace: TraceContext | None,
        progress: _Progress,
    ) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        decision = await self._route(
            model, request.prompt, request, trace, progress, role=Role.DECODE
        )
        decode = decision.worker
        try:
            reason = self._local_reason(model, request, decode, decision.overlap_blocks)
            prefilled: tuple[PrefillResult, WorkerHandle] | None = None
            if reason is None:
                prefilled, reason = await self._prefill(model, request, decode, trace)
            if prefilled is None:
                assert reason is not None
                self.stats.local_prefills[reason] += 1
                async for out in self._stream(decode, request, trace, progress, first_token=True):
                    yield out
                return
            result, prefill = prefilled
            self.router.first_token(rid)
            rp = result.remote
            first = EngineOutput(
                [rp.first_token_id], [rp.first_logprob] if rp.first_logprob is not None else None
            )
            progress.generated.append(rp.first_token_id)
            if result.finish_reason is not None:  # the first token ended it on P
                first.finish_reason = result.finish_reason
                first.usage = result.usage
                first.stop_token_id = result.stop_token_id
                yield first
                return
            self.stats.remote_prefills += 1
            completed = False
            try:
                # P holds the prompt's blocks from here on: a consumer that stops at the first
                # token (the yield below) leaves them to be released like any other stop.
                yield first
                remote = dataclasses.replace(request, remote_prefill=rp)
                async for out in self._stream(decode, remote, trace, progress, first_token=False):
                    if out.finish_reason is not None:
                        completed = True
                        self.stats.kv_transfer_bytes += out.kv_transfer_bytes
                        if out.remote_prefill_fallback:
                            self.stats.local_prefills[LocalPrefill.TRANSFER_FAILED] += 1
                    yield out
            finally:
                if not completed and rp.handle is not None:
                    # D failed or the client left: D may not have released P's blocks.
                    self._release_later(
                        prefill, wpb.ReleaseKvBlocksRequest(transfer_id=rp.handle.transfer_id)
                    )
        finally:
            self._booking_ended(rid)

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
            decision = await self._traced_route(
                model, request.prompt, request, trace, prid, role=Role.PREFILL
            )
        except Unavailable:
            return None, LocalPrefill.PREFILL_SATURATED
        worker = decision.worker
        answered = refused = False
        try:
            resp = await worker.stub.PrefillRemote(
                wire.prefill_request_to_pb(request, decode.worker_id),
                timeout=self.disagg.disagg_prefill_timeout_s,
                metadata=trace.grpc_metadata() if trace is not None else None,
            )
            answered = True
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc)
            if isinstance(err, (InvalidRequest, NotFound)):
                refused = True  # nothing was pinned
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
            if not (answered or refused):
                # The call ended without an answer here: the caller left (cancelling the call
                # aborted the prefill on P), it timed out, or P was unreachable. P may have
                # answered all the same (a cancellation or a deadline can overtake an answer
                # sent), and its blocks would then wait for a transfer id this side never sees:
                # released by the request's id instead (nothing to release if P died).
                self._release_later(
                    worker, wpb.ReleaseKvBlocksRequest(request_id=request.request_id)
                )
        return (wire.prefill_result_from_pb(resp), worker), None

    async def _traced_route(
        self,
        model: str,
        prompt: Sequence[int],
        request: EngineRequest,
        trace: TraceContext | None,
        request_id: str,
        *,
        role: Role | None = None,
        exclude: Sequence[str] = (),
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> RouteDecision:
        """The router's choice for `prompt` of `request` (booked under `request_id`), recorded
        as a `route` span (chosen worker, overlap, cost, policy, and `attributes`) when the trace
        is sampled. A request with images is routed by its salted token ids
        (kvmesh.runtime.multimodal), which the engine's block hashes cover too."""
        if request.media:
            info = self.model_info(model)
            if info is not None and info.image_token_id is not None and info.tokens_per_image:
                prompt = salt_placeholders(
                    prompt, info.image_token_id, request.media, info.tokens_per_image
                )
        route = self.router.route(
            model,
            prompt,
            request_id,
            lora_name=request.lora_name,
            exclude=exclude,
            role=role,
            expected_output_tokens=0 if role is Role.PREFILL else request.stop.max_tokens or 0,
        )
        t = tracer()
        if trace is None or not trace.sampled or not t.enabled:
            return await route
        began = time.time_ns()
        try:
            decision = await route
        except BaseException as exc:
            error = (type(exc).__name__, str(exc))
            t.record(trace, (Step("route", began, time.time_ns(), dict(attributes or {}), error),))
            raise
        routed = {
            **(attributes or {}),
            "kvmesh.request_id": request.request_id,
            "kvmesh.route.worker_id": decision.worker.worker_id,
            "kvmesh.route.role": decision.worker.info.role.value,
            "kvmesh.route.overlap_blocks": decision.overlap_blocks,
            "kvmesh.route.prompt_blocks": decision.prompt_blocks,
            "kvmesh.route.cost": decision.cost,
            "kvmesh.route.policy": decision.policy,
            "kvmesh.route.overhead_us": decision.routing_overhead_s * 1e6,
        }
        t.record(trace, (Step("route", began, time.time_ns(), routed),))
        return decision

    def _release_later(self, worker: WorkerHandle, release: wpb.ReleaseKvBlocksRequest) -> None:
        """Release, in the background, the blocks P (`worker`) pinned: by transfer id, or by
        the PrefillRemote request's id (nothing to release if P did not answer)."""

        async def release_on_p() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await worker.stub.ReleaseKvBlocks(release, timeout=5.0)

        self._releases.spawn(release_on_p())
