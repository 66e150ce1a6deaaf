"""Fakes of vLLM's, SGLang's and TensorRT-LLM's async Python APIs, for the adapters' tests.

Each fake implements the engine's real API surface that its kvmesh adapter uses (same method
names and signatures, same output objects or dicts, same KV event wire format) and serves the
requests with the kvmesh mocker as its "model". The vLLM fake uses vLLM's own classes
(RequestOutput, SchedulerStats, the KV event messages and ZmqEventPublisher); the SGLang and
TensorRT-LLM fakes produce the formats those engines' sources define. No engine runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.workers.engine import Engine


def build_adapter(engine: str) -> Engine:
    """An unstarted kvmesh adapter for `engine` ("vllm", "sglang", "trtllm") over its fake."""
    if engine == "vllm":
        from kvmesh.workers.adapters.config import VllmConfig
        from kvmesh.workers.adapters.vllm_adapter import VllmEngine

        from . import vllm_fake

        return VllmEngine(
            VllmConfig(),
            model_path="/fake/model",
            served_model_name="conformance",
            engine_factory=vllm_fake.factory(),
        )
    if engine == "sglang":
        from kvmesh.workers.adapters.config import SglangConfig
        from kvmesh.workers.adapters.sglang_adapter import SglangEngine

        from . import sglang_fake

        return SglangEngine(
            SglangConfig(sglang_load_interval_s=0.05),
            model_path="/fake/model",
            served_model_name="conformance",
            engine_factory=sglang_fake.factory(),
        )
    if engine == "trtllm":
        from kvmesh.workers.adapters.config import TrtllmConfig
        from kvmesh.workers.adapters.trtllm_adapter import TrtllmEngine

        from . import trtllm_fake

        return TrtllmEngine(
            TrtllmConfig(),
            model_path="/fake/model",
            served_model_name="conformance",
            runtime=trtllm_fake.FakeRuntime(),
        )
    raise ValueError(f"no fake for {engine!r}")
