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
"""

from __future__ import annotations

import abc
import asyncio
import collections
import enum
from collections.abc import AsyncIterator
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
class EngineRequest:
    """One generation request."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    lora_name: str = ""
    priority: int = 0


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


@dataclass(slots=True)
class EngineOutput:
    """Tokens generated since the previous output; the last one carries finish_reason/usage."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_token_id: int | None = None


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
            out = EngineOutput(tokens, logprobs, out.finish_reason, out.usage, out.stop_token_id)
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

    async def release_kv(self, transfer_id: str) -> bool:
        """Release blocks pinned for a remote prefill. Default: nothing is ever pinned."""
        return False

    async def prefill_remote(self, request: EngineRequest) -> object:
        """Prefill and pin the prompt's KV for a decode worker (disaggregated serving)."""
        raise Unimplemented(f"engine {self.info.engine!r} does not support PrefillRemote yet")
