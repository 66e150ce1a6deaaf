"""A deterministic in-process GenerateBackend for tests and benchmarks.

`FakeBackend` implements kvmesh.frontend.backend.GenerateBackend without workers: every
request streams a scripted list of token ids (by default the tokens of `DEFAULT_TEXT`, which
mixes ASCII, accents, CJK and emoji so byte-level detokenization is exercised), cut at
`max_tokens`. Knobs make it fail before the first output or mid-stream, go slow, report cached
tokens, or end with a chosen finish reason. It records what it was asked (`calls`) and which
requests were abandoned by the gateway (`cancelled`), so tests can assert cancellation. To
script what a model "says" (tool calls, reasoning), set `tokens` to the tokenization of that
text. With `embedding_dim` > 0 it also serves /v1/embeddings (deterministic unit vectors).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.runtime.errors import (
    InvalidRequest,
    KvmeshError,
    NotFound,
    Unavailable,
    Unimplemented,
)
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    ModelInfo,
    TokenLogprob,
    Usage,
)

__all__ = ["DEFAULT_TEXT", "FakeBackend", "FakeCall", "model_info"]

DEFAULT_TEXT = "Hello! Un café à Zürich 😀, 日本語のテキスト and 🚀 emoji. The end."


def model_info(
    name: str,
    *,
    context_length: int = 4096,
    model_path: str = "",
    capabilities: tuple[str, ...] = ("LOGPROBS",),
) -> ModelInfo:
    """A model card for the fake backend (`capabilities`: EngineCapability names)."""
    return ModelInfo(
        served_model_name=name,
        engine="fake",
        kv_block_size=16,
        kv_total_blocks=1024,
        context_length=context_length,
        model_path=model_path,
        capabilities=capabilities,
    )


@dataclass(slots=True)
class FakeCall:
    """One generate() call as the fake saw it."""

    model: str
    request: EngineRequest
    trace: TraceContext | None


@dataclass
class FakeBackend:
    """Scripted GenerateBackend (see the module docstring). Mutate the fields between calls."""

    models_: list[ModelInfo] = field(default_factory=list)
    tokens: Sequence[int] | Callable[[EngineRequest], Sequence[int]] = ()
    """Token ids every request generates (or a function of the request)."""
    eos_token_id: int | None = None
    """Appended (as the stop token) when the script ends before max_tokens."""
    tokens_per_output: int = 1
    delay_s: float = 0.0
    """Sleep before each output (0: never yield to the event loop)."""
    error_before: KvmeshError | None = None
    """Raised before the first output."""
    error_after: int | None = None
    """Raise `error_mid` after this many outputs."""
    error_mid: Exception = field(default_factory=lambda: Unavailable("worker went away"))
    finish_reason: FinishReason | None = None
    """Force the final finish reason (default: LENGTH at max_tokens, else STOP)."""
    cached_tokens: int = 0
    embedding_dim: int = 0
    """Size of the vectors `embed` returns (0: embeddings are not implemented)."""
    is_ready: bool = True
    history: int = 10_000
    """How many calls / request ids the records below keep (0 for benchmarks)."""
    calls: deque[FakeCall] = field(init=False)
    cancelled: deque[str] = field(init=False)
    """request_ids whose iterator was closed before the final output."""
    completed: deque[str] = field(init=False)
    """request_ids that got their final output."""

    def __post_init__(self) -> None:
        self.calls = deque(maxlen=self.history)
        self.cancelled = deque(maxlen=self.history)
        self.completed = deque(maxlen=self.history)

    def ready(self) -> bool:
        return self.is_ready

    def model_info(self, model: str) -> ModelInfo | None:
        for info in self.models_:
            if info.served_model_name == model or model in info.lora_adapters:
                return info
        return None

    def models(self) -> list[ModelInfo]:
        return list(self.models_)

    def generate(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncGenerator[EngineOutput, None]:
        self.calls.append(FakeCall(model, request, trace))
        return self._generate(request)

    async def _generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self.error_before is not None:
            raise self.error_before
        script = self.tokens(request) if callable(self.tokens) else self.tokens
        limit = request.stop.max_tokens
        stop_id: int | None = None
        if limit is not None and limit <= len(script):
            script = script[:limit]
            reason = FinishReason.LENGTH
        else:
            reason = FinishReason.STOP
            if self.eos_token_id is not None and not request.stop.ignore_eos:
                script = [*script, self.eos_token_id]
                stop_id = self.eos_token_id
        if self.finish_reason is not None:
            reason = self.finish_reason
        step = max(1, self.tokens_per_output)
        last = max(0, (len(script) - 1) // step)
        top = request.sampling.top_logprobs
        delay = self.delay_s
        error_after = self.error_after
        done = False
        try:
            for n in range(last + 1):
                if delay:
                    await asyncio.sleep(delay)
                if error_after is not None and n >= error_after:
                    raise self.error_mid
                ids = list(script[n * step : (n + 1) * step])
                logprobs = None if top is None else [_logprob(t, top) for t in ids]
                if n == last:
                    done = True
                    yield EngineOutput(
                        token_ids=ids,
                        logprobs=logprobs,
                        finish_reason=reason,
                        usage=Usage(len(request.prompt), len(script), self.cached_tokens),
                        stop_token_id=stop_id,
                    )
                else:
                    yield EngineOutput(token_ids=ids, logprobs=logprobs)
        finally:
            (self.completed if done else self.cancelled).append(request.request_id)

    async def load_lora(self, name: str, path: str, model: str = "") -> list[str]:
        """Add adapter `name` to the card of `model` (empty: the one model) (LoraBackend)."""
        if any(name in info.lora_adapters for info in self.models_):
            raise InvalidRequest(f"LoRA adapter {name!r} is already loaded", param="lora_name")
        cards = [i for i in self.models_ if not model or i.served_model_name == model]
        if not cards:
            raise NotFound(f"no worker serves model {model!r}", param="model")
        if len(cards) > 1:
            raise InvalidRequest("several models are served: name the base model", param="model")
        cards[0].lora_adapters = (*cards[0].lora_adapters, name)
        return ["fake"]

    async def unload_lora(self, name: str) -> list[str]:
        """Remove adapter `name` from the card that lists it (LoraBackend)."""
        for info in self.models_:
            if name in info.lora_adapters:
                info.lora_adapters = tuple(a for a in info.lora_adapters if a != name)
                return ["fake"]
        raise NotFound(f"LoRA adapter {name!r} is not loaded", param="lora_name")

    async def embed(
        self, model: str, prompts: list[list[int]], trace: TraceContext | None
    ) -> list[list[float]]:
        """Deterministic unit vectors derived from the token ids (EmbeddingBackend)."""
        if self.embedding_dim <= 0:
            raise Unimplemented("the fake backend has no embedding model")
        if self.error_before is not None:
            raise self.error_before
        out: list[list[float]] = []
        for ids in prompts:
            raw = [float((sum(ids) * (i + 1)) % 97 + 1) for i in range(self.embedding_dim)]
            norm = sum(x * x for x in raw) ** 0.5
            out.append([x / norm for x in raw])
        return out


def _logprob(token_id: int, top: int) -> TokenLogprob:
    """Made-up logprobs: the chosen token at -0.5, then alternatives token+1.. at -1.5, -2.5."""
    alternatives = [(token_id, -0.5)] + [(token_id + k, -0.5 - k) for k in range(1, top)]
    return TokenLogprob(token_id, -0.5, alternatives[:top])
