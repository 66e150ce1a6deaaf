"""The parts of the TensorRT-LLM adapter that touch tensorrt_llm itself (imported only when the
engine runs; needs `pip install kvmesh[trtllm]` and a GPU)."""

from __future__ import annotations

from typing import Any

__all__ = ["create_llm", "disaggregated_params", "lora_request", "sampling_params"]


def create_llm(kwargs: dict[str, Any]) -> Any:
    """tensorrt_llm.LLM(**kwargs) (LlmArgs fields; nested configs may be dicts)."""
    from tensorrt_llm import LLM  # pyright: ignore[reportMissingImports]  (GPU-only engine)

    return LLM(**kwargs)


def sampling_params(kwargs: dict[str, Any], guided: dict[str, Any] | None) -> Any:
    """tensorrt_llm.SamplingParams, with GuidedDecodingParams when `guided` is set."""
    from tensorrt_llm import SamplingParams  # pyright: ignore[reportMissingImports]  (GPU-only engine)
    from tensorrt_llm.sampling_params import GuidedDecodingParams  # pyright: ignore[reportMissingImports]  (GPU-only engine)

    if guided:
        kwargs = {**kwargs, "guided_decoding": GuidedDecodingParams(**guided)}
    return SamplingParams(**kwargs)


def disaggregated_params(kwargs: dict[str, Any]) -> Any:
    """tensorrt_llm.disaggregated_params.DisaggregatedParams."""
    from tensorrt_llm.disaggregated_params import DisaggregatedParams  # pyright: ignore[reportMissingImports]  (GPU-only engine)

    return DisaggregatedParams(**kwargs)


def lora_request(name: str, int_id: int, path: str) -> Any:
    """tensorrt_llm.executor.request.LoRARequest."""
    from tensorrt_llm.executor.request import LoRARequest  # pyright: ignore[reportMissingImports]  (GPU-only engine)

    return LoRARequest(name, int_id, path)
