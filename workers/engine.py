"""The engine interface every adapter implements (mocker, torch, vLLM, SGLang, TRT-LLM).

The worker gRPC server (kvmesh.workers.server) turns protobuf into these typed messages, calls
one method of an Engine, and turns the results back into protobuf. Engines never see gRPC.

Lifecycle
    engine = SomeEngine(config); await engine.start(); ... ; await engine.stop()
    `start` loads the model / starts the scheduler loop; `stop` cancels every in-flight request
    (their generators finish with FinishReason.CANCELLED or raise CancelledError) and releases
    all resources. Both are idempotent.

Generation and cancellation
    Engines implement one primitive, `submit(request, sink) -> RequestHandle`: it validates the
    request (raising kvmesh.errors.InvalidRequest / RequestTooLarge, ResourceExhausted for a
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
    neither evicted nor reused) under a transfer id until `release_kv(transfer_id)` or until
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
import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvmesh.errors import Unimplemented

if TYPE_CHECKING:
    from .kv_events import KvEventLog


class FinishReason(enum.Enum):
    """Why a sequence ended."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


class Role(enum.Enum):
    """The part a worker plays."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class GuidedKind(enum.Enum):
    """Kinds of structured-output constraint (kvmesh.api.common.v1.GuidedDecoding)."""

    JSON_SCHEMA = "json_schema"
    """`value`: a JSON Schema document (JSON text) the output must validate against."""
    JSON_OBJECT = "json_object"
    """Any syntactically valid JSON object; `value` is empty."""
    REGEX = "regex"
    """`value`: a regular expression the whole output must match."""
    GRAMMAR = "grammar"
    """`value`: an EBNF / GBNF grammar."""
    CHOICE = "choice"
    """`choices`: the output is exactly one of them."""


@dataclass(slots=True)
class GuidedDecoding:
    """A structured-output constraint. Engines without the GUIDED_DECODING capability never
    receive one (the gateway refuses such requests)."""

    kind: GuidedKind
    value: str = ""
    """The schema, regex or grammar text (empty for JSON_OBJECT and CHOICE)."""
    choices: tuple[str, ...] = ()
    """The allowed outputs of CHOICE."""


@dataclass(slots=True)
class SamplingParams:
    """Sampling knobs with their semantic defaults (validated by the worker server)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """None: the engine picks a random seed."""
    top_logprobs: int | None = None
    """None: no logprobs; 0: only the chosen token's; k: plus k alternatives."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    guided: GuidedDecoding | None = None
    """Structured-output constraint; None: unconstrained."""


@dataclass(slots=True)
class StopParams:
    """When to stop."""

    max_tokens: int | None = None
    """None: until the context window is full."""
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop token ids (EOS ids from the model card always stop unless ignore_eos)."""
    ignore_eos: bool = False


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of a generated token and its top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    """Token accounting of one sequence."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


# --- disaggregated serving (kvmesh.api.common.v1 KvLayout ... RemotePrefillResult) -----------


@dataclass(slots=True, frozen=True)
class KvLayout:
    """Shape of a KV block in memory, so a puller can compute offsets and check compatibility."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    """Element type name, e.g. "bfloat16"."""
    block_bytes: int
    """Bytes of one block across all layers, keys and values."""
    chunk_bytes: int = 0
    """Bytes of one contiguous piece of a block (pieces ordered by layer, keys before values);
    0: a block is one contiguous region."""
    chunk_stride_bytes: int = 0
    """Distance from one piece of a block to the next (unused when chunk_bytes is 0)."""

    def compatible(self, other: KvLayout) -> bool:
        """Whether KV of `other`'s blocks can be used as KV of this layout's blocks."""
        return (
            self.num_layers == other.num_layers
            and self.num_kv_heads == other.num_kv_heads
            and self.head_dim == other.head_dim
            and self.block_size == other.block_size
            and self.dtype == other.dtype
            and self.block_bytes == other.block_bytes
        )


@dataclass(slots=True, frozen=True)
class KvBlockDescriptor:
    """Where one pinned block sits in the prefill worker's registered memory."""

    block_hash: int
    """The prefill engine's hash of the block; 0 for a partial (unhashed) last block."""
    address: int
    """Address of the block (of its first piece, for a chunked layout)."""
    length_bytes: int
    device_id: int = 0
    """GPU ordinal; 0 for host memory."""


@dataclass(slots=True)
class KvTransferHandle:
    """What a decode worker needs to pull a prompt's KV from the prefill worker holding it."""

    transfer_id: str
    layout: KvLayout
    blocks: list[KvBlockDescriptor]
    """The prompt's blocks in order (the last one partial when the prompt does not fill it)."""
    num_computed_tokens: int
    """Prompt tokens whose KV the blocks hold."""
    agent_name: str = ""
    """NIXL agent of the prefill worker; empty: not NIXL (e.g. the mocker's simulation)."""
    agent_metadata: bytes = b""
    """NIXL agent metadata (add_remote_agent)."""
    memory_kind: str = "DRAM"
    """"DRAM" (host memory) or "VRAM" (GPU memory)."""
    expires_after_ms: int = 0
    """The prefill worker frees the blocks by itself after this long without release."""
    prefill_worker_id: str = ""
    prefill_address: str = ""
    """gRPC address of the prefill worker (set by its worker server)."""

    @property
    def total_bytes(self) -> int:
        """Bytes of every block of the handle."""
        return sum(b.length_bytes for b in self.blocks)


@dataclass(slots=True)
class RemotePrefill:
    """The result of a remote prefill, handed to the decode worker with the request."""

    first_token_id: int
    first_logprob: TokenLogprob | None = None
    handle: KvTransferHandle | None = None
    """Where the prompt KV is; None: the decode worker recomputes it (or the engine moves it
    by its own means, described in engine_params_json)."""
    engine_params_json: str = ""
    """Engine-specific transfer parameters (vLLM kv_transfer_params, SGLang bootstrap room,
    TRT-LLM disaggregated_params) as a JSON object; empty: none."""
    cached_tokens: int = 0
    """Prompt tokens the prefill worker served from its prefix cache."""


@dataclass(slots=True)
class PrefillResult:
    """What Engine.prefill_remote returns."""

    remote: RemotePrefill
    usage: Usage
    """Prompt tokens, 1 completion token, cached tokens on the prefill side."""
    finish_reason: FinishReason | None = None
    """Set when the first token already ends the request (nothing is pinned then)."""
    stop_token_id: int | None = None


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


@dataclass(slots=True)
class EngineRequest:
    """One generation request."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    lora_name: str = ""
    priority: int = 0
    remote_prefill: RemotePrefill | None = None
    """Set on a decode worker: the prompt was prefilled remotely (see the module docstring)."""


@dataclass(slots=True)
class EngineOutput:
    """Tokens generated since the previous output; the last one carries finish_reason/usage."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_token_id: int | None = None
    kv_transfer_bytes: int = 0
    """Last output of a remote-prefilled request: prompt KV bytes pulled."""
    remote_prefill_fallback: bool = False
    """Last output of a remote-prefilled request: the pulled KV could not be used and the
    prompt was recomputed locally."""


@dataclass(slots=True)
class ModelInfo:
    """What an engine serves; becomes the ModelCard on the wire."""

    served_model_name: str
    engine: str
    kv_block_size: int
    kv_total_blocks: int
    context_length: int
    model_path: str = ""
    role: Role = Role.AGGREGATED
    max_num_seqs: int = 0
    eos_token_ids: tuple[int, ...] = ()
    lora_adapters: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    """Names of kvmesh.api.common.v1.EngineCapability values without the prefix, e.g.
    "KV_EVENTS", "LOGPROBS"."""


@dataclass(slots=True)
class LoadInfo:
    """Instantaneous load; becomes LoadMetrics on the wire."""

    num_running: int = 0
    num_waiting: int = 0
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    pending_prefill_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    requests_finished_total: int = 0
    preemptions_total: int = 0
    kv_pinned_blocks: int = 0
    """Blocks pinned for remote prefill transfers (included in kv_active_blocks)."""


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

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        """Called once by the worker before start(): the worker's role and how to release
        remote blocks (see the module docstring). Default: only the aggregated role."""
        if settings.role is not Role.AGGREGATED:
            raise Unimplemented(
                f"engine {type(self).__name__} does not support disaggregated serving "
                f"(role {settings.role.value})"
            )

    async def release_kv(self, transfer_id: str) -> bool:
        """Release blocks pinned for a remote prefill: True if this call released them, False
        if they were already released or expired (or never existed). Default: nothing is ever
        pinned."""
        return False

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        """Prefill `request`'s prompt, sample its first token and pin its KV for a decode
        worker (disaggregated serving). `request.stop` decides whether the first token already
        ends the request (then nothing is pinned). Cancelling the call aborts the prefill and
        frees its blocks. Raises like submit; Unimplemented when unsupported."""
        raise Unimplemented(f"engine {self.info.engine!r} does not support PrefillRemote yet")
