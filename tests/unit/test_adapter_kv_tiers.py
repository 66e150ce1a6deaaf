"""The KV tier flags on vLLM, TensorRT-LLM and SGLang (kvmesh.workers.adapters.kv_tiers): the
engine configuration they become (vLLM's through its real config classes when installed), what
is refused, and the block size in bytes they are computed with. No engine starts (no GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvmesh.runtime.config import Flags
from kvmesh.runtime.kv_events import KvTier
from kvmesh.runtime.types import Role
from kvmesh.workers.adapters.config import TrtllmConfig, VllmConfig
from kvmesh.workers.adapters.kv_tiers import (
    model_kv_block_bytes,
    trtllm_with_tiers,
    vllm_medium_tier,
    vllm_with_tiers,
)
from kvmesh.workers.adapters.trtllm_adapter import TrtllmEngine
from kvmesh.workers.adapters.vllm_adapter import VllmEngine
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.engine import DisaggSettings
from kvmesh.workers.main import ENTRY, build_engine

pytestmark = pytest.mark.unit

HOST = KvTierConfig(kv_host_blocks=100)
DISK = KvTierConfig(kv_host_blocks=100, kv_disk_dir="/kv", kv_disk_blocks=1000)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    cfg = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_block_bytes_from_the_model_config(model: Path) -> None:
    # 2 (K, V) x 4 layers x 2 KV heads x 64 dims x 16 tokens x 2 bytes
    assert model_kv_block_bytes(str(model), 16) == 2 * 4 * 2 * 64 * 16 * 2
    assert model_kv_block_bytes(str(model), 16, "fp8_e4m3") == 2 * 4 * 2 * 64 * 16
    assert model_kv_block_bytes(str(model), 32, "float32") == 2 * 4 * 2 * 64 * 32 * 4


def test_vllm_media_are_tiers() -> None:
    assert [vllm_medium_tier(m) for m in (None, "GPU", "CPU", "STORAGE", "TAPE")] == [
        KvTier.DEVICE,
        KvTier.DEVICE,
        KvTier.HOST,
        KvTier.DISK,
        None,
    ]


def test_vllm_offloading_connector(caplog: pytest.LogCaptureFixture) -> None:
    assert vllm_with_tiers({"x": 1}, KvTierConfig(), block_bytes=10) == {"x": 1}
    out = vllm_with_tiers({}, HOST, block_bytes=10)
    assert out["kv_transfer_config"] == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1000, "self_describing_kv_events": True},
    }
    out = vllm_with_tiers({}, DISK, block_bytes=10)
    extra = out["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": "/kv", "enable_kv_events": True}]
    assert "not enforced" in caplog.text  # vLLM's filesystem tier has no size bound
    # A disaggregated role's connector and the offloading one: a MultiConnector.
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    out = vllm_with_tiers({"kv_transfer_config": nixl}, HOST, block_bytes=10)
    cfg = out["kv_transfer_config"]
    assert cfg["kv_connector"] == "MultiConnector"
    assert [c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]] == [
        "NixlConnector",
        "OffloadingConnector",
    ]
    for own in (
        {"kv_offloading_size": 4.0},
        {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}},
    ):
        with pytest.raises(ValueError, match="exclusive"):
            vllm_with_tiers(own, HOST, block_bytes=10)


def _vllm(model: Path, role: Role = Role.AGGREGATED) -> VllmEngine:
    eng = VllmEngine(
        VllmConfig(vllm_kv_events=False), model_path=str(model), served_model_name="m", tiers=HOST
    )
    eng.configure_disaggregation(DisaggSettings(role=role))
    return eng


def test_vllm_engine_arguments_carry_the_tiers(model: Path) -> None:
    kwargs = _vllm(model).engine_kwargs()
    block = model_kv_block_bytes(str(model), 16)
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["cpu_bytes_to_use"] == (
        100 * block
    )
    kwargs = _vllm(model, Role.DECODE).engine_kwargs()
    assert kwargs["kv_transfer_config"]["kv_connector"] == "MultiConnector"
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (bash tests/install_vllm.sh): its classes unchecked")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # see tests/adapter_fakes/vllm_fake.py
        from kvmesh.workers.adapters.vllm_runtime import build_engine_args

    args: Any = build_engine_args(kwargs)  # vLLM's own AsyncEngineArgs and KVTransferConfig
    assert args.kv_transfer_config.kv_connector == "MultiConnector"
    offload = args.kv_transfer_config.kv_connector_extra_config["connectors"][1]
    assert offload["kv_load_failure_policy"] == "recompute"


def test_trtllm_host_cache(model: Path) -> None:
    out = trtllm_with_tiers(
        {"kv_cache_config": {"free_gpu_memory_fraction": 0.8}}, HOST, block_bytes=10
    )
    assert out["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.8,
        "host_cache_size": 1000,
        "enable_block_reuse": True,
    }
    with pytest.raises(ValueError, match="no disk KV tier"):
        trtllm_with_tiers({}, DISK, block_bytes=10)
    with pytest.raises(ValueError, match="exclusive"):
        trtllm_with_tiers({"kv_cache_config": {"host_cache_size": 5}}, HOST, block_bytes=10)
    eng = TrtllmEngine(TrtllmConfig(), model_path=str(model), served_model_name="m", tiers=HOST)
    size = eng.engine_kwargs()["kv_cache_config"]["host_cache_size"]
    assert size == 100 * model_kv_block_bytes(str(model), 32)  # 32 tokens per block by default


def test_sglang_refuses_the_tier_flags(tiny_model: Path) -> None:
    parser = argparse.ArgumentParser()
    ENTRY.flags.add_to(parser)
    ns = parser.parse_args(
        ["--engine", "sglang", "--model", str(tiny_model), "--kv-host-blocks", "8"]
    )
    from kvmesh.runtime.config import from_args

    with pytest.raises(ValueError, match="hierarchical cache"):
        build_engine(from_args(WorkerConfig, ns), ns)
    assert isinstance(ENTRY.flags, Flags) and KvTierConfig in ENTRY.flags.configs
