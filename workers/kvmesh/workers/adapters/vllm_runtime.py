"""The parts of the vLLM adapter that touch vLLM's own classes (imported only when vLLM runs).

Kept apart from kvmesh.workers.adapters.vllm_adapter so that module, its flags and its output
decoding import without vLLM; everything here needs `pip install kvmesh[vllm]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

try:  # vLLM's "bad request" errors (older versions raise ValueError)
    from vllm.exceptions import VLLMClientError

    CLIENT_ERRORS: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
except ImportError:  # pragma: no cover - older vLLM
    CLIENT_ERRORS = (ValueError,)
PARAMS_ERRORS: tuple[type[Exception], ...] = (*CLIENT_ERRORS, TypeError)
"""What building SamplingParams raises for values vLLM refuses."""

__all__ = [
    "CLIENT_ERRORS",
    "PARAMS_ERRORS",
    "EngineDeadError",
    "EngineGenerateError",
    "SamplingParams",
    "build_engine_args",
    "build_lora_request",
    "build_sampling_params",
    "create_async_llm",
    "stat_logger_factory",
]

_CONFIG_FIELDS: dict[str, Callable[..., Any]] = {
    "kv_transfer_config": KVTransferConfig,
    "kv_events_config": KVEventsConfig,
}


def build_engine_args(kwargs: dict[str, Any]) -> AsyncEngineArgs:
    """AsyncEngineArgs from field values; the nested configs kvmesh sets may be given as dicts.

    Raises ValueError for names AsyncEngineArgs does not have.
    """
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"--vllm-engine-args: unknown vLLM engine arguments: {unknown}")
    values = dict(kwargs)
    for name, cls in _CONFIG_FIELDS.items():
        if isinstance(values.get(name), dict):
            values[name] = cls(**values[name])
    return AsyncEngineArgs(**values)


def build_sampling_params(
    kwargs: dict[str, Any], structured: dict[str, Any] | None
) -> SamplingParams:
    """vLLM SamplingParams streaming deltas of token ids (no detokenization: kvmesh's gateway
    detokenizes). vLLM validates the values (ValueError)."""
    return SamplingParams(
        **kwargs,
        structured_outputs=StructuredOutputsParams(**structured) if structured else None,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )


def build_lora_request(name: str, int_id: int, path: str) -> LoRARequest:
    """vLLM's LoRARequest for a configured adapter."""
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


StatsCallback = Callable[[SchedulerStats | None, IterationStats | None], None]


def stat_logger_factory(callback: StatsCallback) -> Callable[[Any, int], StatLoggerBase]:
    """A per-engine stat logger factory (for AsyncLLM's `stat_loggers`) that hands every
    scheduler/iteration stats record to `callback`."""

    class KvmeshStatLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            callback(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return KvmeshStatLogger(vllm_config, engine_index)

    return factory


def create_async_llm(
    engine_args: AsyncEngineArgs, stat_loggers: Sequence[Callable[[Any, int], Any]]
) -> Any:
    """Start vLLM's AsyncLLM (the V1 engine; needs a GPU)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(engine_args, stat_loggers=list(stat_loggers))
