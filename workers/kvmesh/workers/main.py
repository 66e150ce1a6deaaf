"""`kvmesh worker`: one engine behind WorkerService, until SIGINT/SIGTERM.

Its flags are WorkerConfig's, the KV tiers' (KvTierConfig: `--kv-host-blocks`, `--kv-disk-dir`,
`--kv-disk-blocks`) and every engine's config dataclass's (`ENTRY`). Builds the engine named by
`--engine` from its config dataclass and the tier settings (engines that import torch or an
engine package do so only when asked for), wraps it in a Worker (gRPC server, health,
reflection, discovery registration) and serves.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.runtime.config import Flags, from_args
from kvmesh.runtime.errors import Unimplemented
from kvmesh.runtime.grpcutil import MeshSecurity
from kvmesh.runtime.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.runtime.process import Entry, freeze_heap, run, wait_for_signal
from kvmesh.runtime.telemetry import TracingConfig, setup_tracing, shutdown_tracing
from kvmesh.runtime.tls import TlsConfig
from kvmesh.workers.adapters.config import SglangConfig, TrtllmConfig, VllmConfig
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.config import EngineKind, WorkerConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.pytorch.config import TorchConfig  # imports no torch
from kvmesh.workers.server import Worker

# --- engines ----------------------------------------------------------------------------------


def _mocker(
    engine: MockerConfig, config: WorkerConfig, model: ModelDirInfo, tiers: KvTierConfig
) -> Engine:
    from kvmesh.workers.mocker import MockerEngine

    return MockerEngine(
        engine,
        served_model_name=config.served_model_name or model.name,
        vocab_size=model.vocab_size,
        special_token_ids=model.special_token_ids,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        model_path=str(model.path),
        tiers=tiers,
    )


def _torch(
    engine: TorchConfig, config: WorkerConfig, model: ModelDirInfo, tiers: KvTierConfig
) -> Engine:
    # Imports torch and transformers: only when this engine is asked for.
    from kvmesh.runtime.modeldir import default_model_dir
    from kvmesh.workers.pytorch.engine import TorchEngine
    from kvmesh.workers.pytorch.weights import create_tiny_weights, has_weights

    if model.path == default_model_dir().resolve() and not has_weights(model.path):
        create_tiny_weights(model.path)  # the built-in tiny model gets deterministic weights
    return TorchEngine(
        engine,
        model_dir=model.path,
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        tiers=tiers,
    )


def _vllm(
    engine: VllmConfig, config: WorkerConfig, model: ModelDirInfo, tiers: KvTierConfig
) -> Engine:
    # The adapter imports vLLM only when the engine starts (kvmesh[vllm], a GPU).
    from kvmesh.workers.adapters.vllm_adapter import VllmEngine

    return VllmEngine(
        engine,
        model_path=str(model.path),
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        tiers=tiers,
    )


def _sglang(
    engine: SglangConfig, config: WorkerConfig, model: ModelDirInfo, tiers: KvTierConfig
) -> Engine:
    from kvmesh.workers.adapters.kv_tiers import refuse_tiers
    from kvmesh.workers.adapters.sglang_adapter import SglangEngine

    refuse_tiers(
        "sglang",
        tiers,
        "configure SGLang's hierarchical cache in --sglang-engine-args (enable_hierarchical_cache, "
        "hicache_size, hicache_storage_backend)",
    )
    return SglangEngine(
        engine,
        model_path=str(model.path),
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        advertise_host=config.advertise_host or config.host,
    )


def _trtllm(
    engine: TrtllmConfig, config: WorkerConfig, model: ModelDirInfo, tiers: KvTierConfig
) -> Engine:
    from kvmesh.workers.adapters.trtllm_adapter import TrtllmEngine

    return TrtllmEngine(
        engine,
        model_path=str(model.path),
        served_model_name=config.served_model_name or model.name,
        eos_token_ids=model.eos_token_ids,
        context_length=model.context_length,
        tiers=tiers,
    )


@dataclass(frozen=True)
class EngineSpec:
    """An engine `kvmesh worker --engine` runs: its config dataclass (its flags) and its
    factory."""

    config: type[Any]
    build: Callable[[Any, WorkerConfig, ModelDirInfo, KvTierConfig], Engine]


ENGINES: dict[EngineKind, EngineSpec] = {
    EngineKind.MOCKER: EngineSpec(MockerConfig, _mocker),
    EngineKind.TORCH: EngineSpec(TorchConfig, _torch),
    EngineKind.VLLM: EngineSpec(VllmConfig, _vllm),
    EngineKind.SGLANG: EngineSpec(SglangConfig, _sglang),
    EngineKind.TRTLLM: EngineSpec(TrtllmConfig, _trtllm),
}


def build_engine(config: WorkerConfig, ns: argparse.Namespace) -> Engine:
    """Construct the engine named by config.engine with its flags from `ns`."""
    spec = ENGINES.get(config.engine)
    if spec is None:
        raise Unimplemented(
            f"engine {config.engine.value!r} is not available yet; available: "
            + ", ".join(k.value for k in ENGINES)
        )
    engine = from_args(spec.config, ns)
    tiers = from_args(KvTierConfig, ns)
    return spec.build(engine, config, ModelDirInfo.load(resolve_model_dir(config.model)), tiers)


async def serve_worker(
    config: WorkerConfig,
    ns: argparse.Namespace,
    ready: Callable[[Worker], None] | None = None,
    security: MeshSecurity | None = None,
    tracing: TracingConfig | None = None,
) -> None:
    """Run a worker until SIGINT/SIGTERM (tracing: see kvmesh.runtime.telemetry)."""
    worker = Worker(config, build_engine(config, ns), security)
    setup_tracing(
        tracing or TracingConfig(), "worker", role=config.role.value, worker_id=worker.worker_id
    )
    try:
        await worker.start()
        if ready is not None:
            ready(worker)
        freeze_heap()
        await wait_for_signal()
        await worker.stop()
    finally:
        shutdown_tracing()


def main(ns: argparse.Namespace) -> int:
    """`kvmesh worker`: serve until SIGINT/SIGTERM."""
    security = MeshSecurity.load(from_args(TlsConfig, ns))  # bad certificates stop it here
    run(
        serve_worker(
            from_args(WorkerConfig, ns),
            ns,
            security=security,
            tracing=from_args(TracingConfig, ns),
        )
    )
    return 0


ENTRY = Entry(
    "worker",
    "a worker process serving one engine (WorkerService)",
    Flags.of(
        WorkerConfig,
        KvTierConfig,
        TlsConfig,
        *(spec.config for spec in ENGINES.values()),
        TracingConfig,
    ),
    main,
)
