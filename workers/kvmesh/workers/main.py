"""`kvmesh worker`: one engine behind WorkerService, until SIGINT/SIGTERM.

Builds the engine named by `--engine` from its config dataclass (engines that import torch or
an engine package do so only when asked for), wraps it in a Worker (gRPC server, health,
reflection, discovery registration) and serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh.runtime.errors import Unimplemented
from kvmesh.runtime.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.runtime.process import wait_for_signal
from kvmesh.workers.config import EngineKind, WorkerConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.server import Worker

# --- engines ----------------------------------------------------------------------------------

EngineFactory = Callable[[Any, WorkerConfig, ModelDirInfo], Engine]


def _mocker(ns: Any, config: WorkerConfig, model: ModelDirInfo) -> Engine:
    from kvmesh.runtime.config import from_args
    from kvmesh.workers.mocker import MockerConfig, MockerEngine

    return MockerEngine(
        from_args(MockerConfig, ns),
        served_model_name=config.served_model_name or model.name,
        vocab_size=model.vocab_size,
        special_token_ids=model.special_token_ids,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        model_path=str(model.path),
    )


def _torch(ns: Any, config: WorkerConfig, model: ModelDirInfo) -> Engine:
    # Imports torch and transformers: only when this engine is asked for.
    from kvmesh.runtime.config import from_args
    from kvmesh.runtime.modeldir import default_model_dir
    from kvmesh.workers.pytorch.config import TorchConfig
    from kvmesh.workers.pytorch.engine import TorchEngine
    from kvmesh.workers.pytorch.weights import create_tiny_weights, has_weights

    if model.path == default_model_dir().resolve() and not has_weights(model.path):
        create_tiny_weights(model.path)  # the built-in tiny model gets deterministic weights
    return TorchEngine(
        from_args(TorchConfig, ns),
        model_dir=model.path,
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
    )


def _vllm(ns: Any, config: WorkerConfig, model: ModelDirInfo) -> Engine:
    # The adapter imports vLLM only when the engine starts (kvmesh[vllm], a GPU).
    from kvmesh.runtime.config import from_args
    from kvmesh.workers.adapters.config import VllmConfig
    from kvmesh.workers.adapters.vllm_adapter import VllmEngine

    return VllmEngine(
        from_args(VllmConfig, ns),
        model_path=str(model.path),
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
    )


def _sglang(ns: Any, config: WorkerConfig, model: ModelDirInfo) -> Engine:
    from kvmesh.runtime.config import from_args
    from kvmesh.workers.adapters.config import SglangConfig
    from kvmesh.workers.adapters.sglang_adapter import SglangEngine

    return SglangEngine(
        from_args(SglangConfig, ns),
        model_path=str(model.path),
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        advertise_host=config.advertise_host or config.host,
    )


def _trtllm(ns: Any, config: WorkerConfig, model: ModelDirInfo) -> Engine:
    from kvmesh.runtime.config import from_args
    from kvmesh.workers.adapters.config import TrtllmConfig
    from kvmesh.workers.adapters.trtllm_adapter import TrtllmEngine

    return TrtllmEngine(
        from_args(TrtllmConfig, ns),
        model_path=str(model.path),
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
    )


ENGINES: dict[EngineKind, EngineFactory] = {
    EngineKind.MOCKER: _mocker,
    EngineKind.TORCH: _torch,
    EngineKind.VLLM: _vllm,
    EngineKind.SGLANG: _sglang,
    EngineKind.TRTLLM: _trtllm,
}


def engine_arg_groups() -> list[type[Any]]:
    """Config dataclasses whose flags `kvmesh worker` accepts besides WorkerConfig."""
    from kvmesh.workers.adapters.config import SglangConfig, TrtllmConfig, VllmConfig
    from kvmesh.workers.mocker import MockerConfig
    from kvmesh.workers.pytorch.config import TorchConfig  # imports no torch

    return [MockerConfig, TorchConfig, VllmConfig, SglangConfig, TrtllmConfig]


def build_engine(config: WorkerConfig, ns: Any) -> Engine:
    """Construct the engine named by config.engine with its flags from `ns`."""
    factory = ENGINES.get(config.engine)
    if factory is None:
        raise Unimplemented(
            f"engine {config.engine.value!r} is not available yet; available: "
            + ", ".join(k.value for k in ENGINES)
        )
    model = ModelDirInfo.load(resolve_model_dir(config.model))
    return factory(ns, config, model)


async def serve_worker(
    config: WorkerConfig, ns: Any, ready: Callable[[Worker], None] | None = None
) -> None:
    """Run a worker until SIGINT/SIGTERM."""
    worker = Worker(config, build_engine(config, ns))
    await worker.start()
    if ready is not None:
        ready(worker)
    await wait_for_signal()
    await worker.stop()
