"""The engine interface every adapter implements (mocker, torch, vLLM, SGLang, TRT-LLM).

The worker gRPC server (kvmesh.workers.server) turns protobuf into the typed messages of
kvmesh.runtime.types (kvmesh.runtime.wire), calls
one method of an Engine, and turns the results back into protobuf. Engines never see gRPC.

Lifecycle
    engine = SomeEngine(config); await engine.start(); ... ; await engine.stop()
    `start` loads the model / starts the scheduler loop; `stop` cancels every in-flight request
    (their generators finish with FinishReason.CANCELLED or raise CancelledError) and releases
    all resources. Both are idempotent.

Generation and cancellation
    Engines implement one primitive, `submit(request, sink) -> RequestHandle`: it validates the
    request (raising kvmesh.runtime.errors.InvalidRequest / RequestTooLarge, ResourceExhausted for a
    request that can never fit, Unavailable when stopped), then pushes EngineOutput deltas to
    `sink.output(...)` on the event loop; the last one has `finish_reason` and `usage` set. An
    engine failure calls `sink.fail(exc)` instead. `handle.cancel()` aborts the request: nothing
    more reaches the sink and its KV blocks are freed (before cancel returns for engines that
    abort synchronously, like the mocker; as soon as the engine processes the abort otherwise).
    Pushing avoids a task wake-up per token, which matters at thousands of requests per second.

    `generate(request)` (provided here, on top of submit) returns an async iterator of the same
    deltas; abandoning it (task cancelled, or `aclose()`) cancels the request.

KV events
    Engines that cache prefixes publish every change of their cache to `kv_events`
    (a KvEventLog). The log alone can produce a snapshot of the cache, so subscribers get
    "snapshot, then deltas, resumable by event id" without the engine's help.

Idempotency
    `release_kv` and `clear_kv_cache` may be called any number of times.

Disaggregated serving (optional; engines listing the DISAGGREGATION capability)
    The worker calls `configure_disaggregation(settings)` once, before `start()`, with its role
    and how to tell a prefill worker to release blocks. On a prefill worker, `prefill_remote`
    computes the prompt's KV and samples the first token; the blocks stay pinned (referenced,
    neither evicted nor reused) under a transfer id until `release_kv(transfer_id)` (or by the
    request's id, `release_kv(request_id=...)`: a caller that left as the answer came) or until
    they expire. On a decode worker, `submit` of a request with `remote_prefill` set pulls the
    blocks named by its handle into free blocks, calls `settings.release_remote(handle)`, uses
    the pulled KV only if that confirms the blocks were still pinned (else it recomputes the
    prompt), caches the full blocks (they appear in its prefix cache and KV events), and
    decodes after `first_token_id`: its outputs start with the second token. Every path
    (success, failed pull, cancellation, stop) releases every block it took.
"""

from __future__ import annotations

import abc
import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.runtime.errors import Unimplemented
from kvmesh.runtime.kv_events import KvEventLog
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    KvTransferHandle,
    LoadInfo,
    ModelInfo,
    PrefillResult,
    Role,
)
from kvmesh.workers.metrics import EngineStats

KvReleaser = Callable[[KvTransferHandle], Awaitable[bool]]
"""Tells the prefill worker holding a handle's blocks to release them; True when they were
still pinned (so KV read from them before the call is intact), False when they were already
released or expired, or the prefill worker cannot be reached."""


async def _never_confirmed(handle: KvTransferHandle) -> bool:
    return False


@dataclass(slots=True)
class DisaggSettings:
    """How a worker takes part in disaggregated serving (Engine.configure_disaggregation)."""

    role: Role = Role.AGGREGATED
    release_remote: KvReleaser = _never_confirmed
    """Decode side: release a handle's blocks on its prefill worker (the worker server calls
    ReleaseKvBlocks over gRPC)."""
    pin_timeout_s: float = 30.0
    """Prefill side: pinned blocks nobody released are freed after this long."""
    transfer_timeout_s: float = 10.0
    """Decode side: a pull that takes longer is abandoned (the prompt is recomputed)."""


class OutputSink(Protocol):
    """Receives one request's outputs. Called on the engine's event loop; must not block or
    raise."""

    def output(self, out: EngineOutput) -> None:
        """A delta; the one with finish_reason set is the last call."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The request failed (engine error); no other call follows."""
        ...


class RequestHandle(Protocol):
    """A submitted request."""

    def cancel(self) -> None:
        """Abort the request (idempotent; a no-op once it finished)."""
        ...


class _Channel:
    """An OutputSink that an async iterator reads from (used by Engine.generate); deltas that
    pile up while the reader is busy are merged into one."""

    __slots__ = ("error", "finished", "items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[EngineOutput] = collections.deque()
        self.error: BaseException | None = None
        self.finished = False
        self.waiter: asyncio.Future[None] | None = None

    def output(self, out: EngineOutput) -> None:
        self.items.append(out)
        if out.finish_reason is not None:
            self.finished = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.finished = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> EngineOutput:
        while not self.items:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out = self.items.popleft()
        if self.items:  # a slow consumer gets everything that is ready in one delta
            tokens = list(out.token_ids)
            logprobs = list(out.logprobs) if out.logprobs is not None else None
            while self.items:
                out = self.items.popleft()
                tokens += out.token_ids
                if logprobs is not None and out.logprobs is not None:
                    logprobs += out.logprobs
            out = EngineOutput(
                tokens,
                logprobs,
                out.finish_reason,
                out.usage,
                out.stop_token_id,
                out.kv_transfer_bytes,
                out.remote_prefill_fallback,
            )
        return out


class Engine(abc.ABC):
    """Base class of every engine adapter. See the module docstring for the contract."""

    stats: EngineStats | None = None
    """Per-request timings and token counts for the worker's metrics (the engine core records
    them; None: the engine keeps none, its worker exports only its load)."""

    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo:
        """The model card data. Valid after start()."""

    @property
    def kv_events(self) -> KvEventLog | None:
        """The engine's KV event log, or None if it publishes no events."""
        return None

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start scheduling. Idempotent."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Cancel in-flight requests and release resources. Idempotent."""

    @abc.abstractmethod
    def submit(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        """Start `request`; outputs go to `sink` (see the module docstring)."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream output deltas for `request`; closing the iterator cancels it."""
        channel = _Channel()
        handle = self.submit(request, channel)
        try:
            while True:
                out = await channel.next()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if not channel.finished:
                handle.cancel()

    @abc.abstractmethod
    def load(self) -> LoadInfo:
        """Current load. Cheap: called on every metrics tick."""

    async def clear_kv_cache(self) -> int:
        """Drop every unreferenced cached block; returns how many. Default: nothing cached."""
        return 0

    async def load_lora(self, name: str, path: str) -> ModelInfo:
        """Load the LoRA adapter at `path` (on the worker's disk) as `name`; requests may then
        name it. Returns the updated card (its `lora_adapters`). Raises InvalidRequest (bad
        name or adapter, already loaded), Unimplemented when the engine has no runtime LoRA
        loading (the default)."""
        raise Unimplemented(f"engine {self.info.engine!r} cannot load LoRA adapters at runtime")

    async def unload_lora(self, name: str) -> ModelInfo:
        """Unload adapter `name` (requests running on it finish); returns the updated card.
        Raises NotFound when it is not loaded, Unimplemented as load_lora."""
        raise Unimplemented(f"engine {self.info.engine!r} cannot unload LoRA adapters at runtime")

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        """Called once by the worker before start(): the worker's role and how to release
        remote blocks (see the module docstring). Default: only the aggregated role."""
        if settings.role is not Role.AGGREGATED:
            raise Unimplemented(
                f"engine {type(self).__name__} does not support disaggregated serving "
                f"(role {settings.role.value})"
            )

    async def release_kv(self, transfer_id: str = "", request_id: str = "") -> bool:
        """Release blocks pinned for a remote prefill: the transfer `transfer_id`, and every
        transfer pinned for the `prefill_remote` request `request_id`. True if this call
        released any, False if they were already released or expired (or never existed).
        Default: nothing is ever pinned."""
        return False

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """One embedding vector per prompt (non-empty token id lists), in order, pooled and
        normalized as the engine is configured. Engines listing the EMBEDDINGS capability
        implement it; InvalidRequest for a bad prompt. Default: Unimplemented."""
        raise Unimplemented(f"engine {self.info.engine!r} does not compute embeddings")

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        """Prefill `request`'s prompt, sample its first token and pin its KV for a decode
        worker (disaggregated serving). `request.stop` decides whether the first token already
        ends the request (then nothing is pinned). Cancelling the call aborts the prefill and
        frees its blocks. Raises like submit; Unimplemented when unsupported."""
        raise Unimplemented(f"engine {self.info.engine!r} does not support PrefillRemote yet")
