"""The interface the gateway generates through.

The gateway tokenizes, applies chat templates, detokenizes and speaks HTTP; everything behind
it (choosing a worker with the KV-aware router, calling the worker's `Generate` over gRPC,
retries) hides behind `GenerateBackend`. The production implementation lives with the router
and worker clients; tests use fakes that implement this same Protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineOutput, EngineRequest, ModelInfo

__all__ = ["EmbeddingBackend", "GenerateBackend", "LoraBackend"]


class GenerateBackend(Protocol):
    """Where generation requests go.

    Contract
    - `ready()`, `model_info()` and `models()` are cheap and synchronous (they read state kept
      up to date by discovery); the gateway calls them on every request.
    - `generate()` returns an async iterator of EngineOutput deltas, as the engine contract in
      kvmesh.workers.engine describes: the last item has `finish_reason` (and normally `usage`)
      set; token ids arrive in order, possibly several per item.
    - Errors are kvmesh.runtime.errors exceptions raised from the iterator (normally before the
      first item): Unavailable when no worker can take the request, NotFound for an unknown model or
      adapter, InvalidRequest / RequestTooLarge from the worker's validation,
      ResourceExhausted when overloaded. Anything else is treated as an internal error.
    - Cancellation: closing the iterator (`aclose()`, which async generators have) or
      cancelling the task that iterates it cancels the request on the worker. The gateway
      always closes iterators it does not run to the end (client disconnect, stop string).
    - `trace` is the gateway span's context; pass `trace.grpc_metadata()` to the next hop.
    """

    def ready(self) -> bool:
        """Whether at least one worker is ready to serve."""
        ...

    def model_info(self, model: str) -> ModelInfo | None:
        """The card of served model (or LoRA adapter) `model`; None if nothing serves it."""
        ...

    def models(self) -> list[ModelInfo]:
        """Cards of every model served now."""
        ...

    def generate(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncIterator[EngineOutput]:
        """Stream output deltas of `request` for `model` (see the class docstring)."""
        ...


@runtime_checkable
class EmbeddingBackend(Protocol):
    """A backend that can also reach engines computing embeddings (optional).

    Contract: `embed` returns one vector per prompt, in order, for a model whose card lists
    the EMBEDDINGS capability; errors as for `generate`. Backends without it make
    /v1/embeddings answer 501.
    """

    async def embed(
        self, model: str, prompts: list[list[int]], trace: TraceContext | None
    ) -> list[list[float]]:
        """Embedding vectors of `prompts` (token ids) under `model`."""
        ...


@runtime_checkable
class LoraBackend(Protocol):
    """A backend that can load and unload LoRA adapters on its workers (optional).

    Contract: `load_lora` loads adapter `name` from `path` (on the workers' disk) on the workers
    of base model `model` (empty: the one served model) and returns their worker ids; afterwards
    `model_info(name)` is the base model's card and `models()` lists the adapter in its card's
    `lora_adapters`. `unload_lora` unloads it everywhere (NotFound when nowhere loaded). Errors
    are kvmesh.runtime.errors exceptions. Backends without it make the endpoints answer 501.
    """

    async def load_lora(self, name: str, path: str, model: str = "") -> list[str]: ...

    async def unload_lora(self, name: str) -> list[str]: ...
