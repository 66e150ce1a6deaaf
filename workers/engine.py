"""The engine interface every adapter implements (mocker, torch, vLLM, SGLang, TRT-LLM).

The worker gRPC server (kvmesh.workers.server) turns protobuf into these typed messages, calls
one method of an Engine, and turns the results back into protobuf. Engines never see gRPC.

Lifecycle
    engine = SomeEngine(config); await engine.start(); ... ; await engine.stop()
    `start` loads the model / starts the scheduler loop; `stop` cancels every in-flight request
    (their generators finish with FinishReason.CANCELLED or raise CancelledError) and releases
    all resources. Both are idempotent.

Generation and cancellation
    `generate(request)` returns an async iterator of EngineOutput deltas. The last item has
    `finish_reason` and `usage` set. Abandoning the iterator (task cancelled, or `aclose()`)
    aborts the request inside the engine and frees its KV blocks before aclose() returns.
    Invalid requests raise kvmesh.errors.InvalidRequest (or RequestTooLarge) before the first
    item; a request that can never fit raises ResourceExhausted; a draining or stopped engine
    raises Unavailable.

KV events
    Engines that cache prefixes publish every change of their cache to `kv_events`
    (a KvEventLog). The log alone can produce a snapshot of the cache, so subscribers get
    "snapshot, then deltas, resumable by event id" without the engine's help.

Idempotency
    `release_kv` and `clear_kv_cache` may be called any number of times.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream output deltas for `request` (see the module docstring)."""

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
