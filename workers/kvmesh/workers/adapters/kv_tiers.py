"""The worker's KV tier flags on the engines kvmesh does not schedule itself, and their
tier-tagged KV events as kvmesh tiers.

`--kv-host-blocks N` / `--kv-disk-dir DIR` / `--kv-disk-blocks M` (KvTierConfig) become:
  * vLLM (0.11+; checked against 0.33): its OffloadingConnector, `kv_transfer_config` =
    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"cpu_bytes_to_use":
     N x block bytes, "self_describing_kv_events": true}}, and with a disk tier its
    TieringOffloadingSpec with a filesystem secondary tier ({"spec_name":
    "TieringOffloadingSpec", "secondary_tiers": [{"type": "fs", "root_dir": DIR,
    "enable_kv_events": true}]}). A disaggregated role's connector and this one are combined in a
    MultiConnector. vLLM's offloaded-tier events carry `medium` "CPU" / "STORAGE": they become
    HOST / DISK events (self-describing events carry the token ids the router hashes). vLLM's
    filesystem tier has no size bound: M is not enforced there (a warning says so).
  * TensorRT-LLM: `kv_cache_config.host_cache_size` = N x block bytes (its secondary, host
    level; blocks moving between levels are "updated" events with a cache_level change, which
    become HOST stored / DEVICE removed and back). TensorRT-LLM has no disk level: a disk tier is
    refused.
  * SGLang: refused (its hierarchical cache, HiCache, is configured through
    --sglang-engine-args: enable_hierarchical_cache, hicache_size, hicache_storage_backend).
Block bytes come from the model's config.json: 2 (keys, values) x layers x KV heads x head dim
x block size x the KV dtype's size.

Not checked here (no GPU): that the engines accept these settings at start-up, their transfer
speeds, and the exact event streams they then publish (the event translation is tested with
vLLM's real event classes and TensorRT-LLM's event dicts).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvmesh.runtime.kv_events import KvTier
from kvmesh.workers.batching.tiers import KvTierConfig

__all__ = [
    "model_kv_block_bytes",
    "refuse_tiers",
    "trtllm_with_tiers",
    "vllm_medium_tier",
    "vllm_with_tiers",
]

log = logging.getLogger(__name__)

_VLLM_MEDIUM = {
    None: KvTier.DEVICE,
    "GPU": KvTier.DEVICE,
    "CPU": KvTier.HOST,
    "STORAGE": KvTier.DISK,
}
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def vllm_medium_tier(medium: str | None) -> KvTier | None:
    """The kvmesh tier of a vLLM KV event's `medium` (None: a medium kvmesh does not know)."""
    return _VLLM_MEDIUM.get(medium)


def model_kv_block_bytes(model_path: str, block_size: int, kv_dtype: str = "auto") -> int:
    """Bytes of one KV block of the model in `model_path` (its config.json; see the module
    docstring). `kv_dtype`: the engine's KV cache dtype ("auto": the model's; fp8 kinds: 1)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    if kv_dtype.startswith("fp8"):
        size = 1
    elif kv_dtype != "auto":
        size = _DTYPE_BYTES.get(kv_dtype, 2)
    else:
        size = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), 2)
    return 2 * layers * kv_heads * head_dim * block_size * size


def vllm_with_tiers(
    kwargs: dict[str, Any], tiers: KvTierConfig, *, block_bytes: int
) -> dict[str, Any]:
    """vLLM engine arguments with the tiers of `tiers` as its offloading (see the module
    docstring). Raises ValueError when the engine arguments configure vLLM's offloading
    themselves (one or the other)."""
    if not tiers.enabled:
        return kwargs
    existing = kwargs.get("kv_transfer_config")
    names = _connector_names(existing)
    if kwargs.get("kv_offloading_size") is not None or names & {
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
    }:
        raise ValueError(
            "--kv-host-blocks and vLLM's own KV offloading (kv_offloading_size or an offloading "
            "connector in --vllm-engine-args) are exclusive: set one of them"
        )
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": tiers.kv_host_blocks * block_bytes,
        "self_describing_kv_events": True,
    }
    if tiers.kv_disk_blocks:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [
            {"type": "fs", "root_dir": tiers.kv_disk_dir, "enable_kv_events": True}
        ]
        log.warning(
            "vLLM's filesystem KV tier has no size bound: --kv-disk-blocks=%d is not enforced; "
            "give %s a volume of about %d bytes",
            tiers.kv_disk_blocks,
            tiers.kv_disk_dir,
            tiers.kv_disk_blocks * block_bytes,
        )
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    out = dict(kwargs)
    if existing is None:
        out["kv_transfer_config"] = offload
    else:
        out["kv_transfer_config"] = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [existing, offload]},
        }
    return out


def _connector_names(config: Any) -> set[str]:
    if not isinstance(config, dict):
        return set()
    names = {str(config.get("kv_connector"))}
    for sub in (config.get("kv_connector_extra_config") or {}).get("connectors") or []:
        names |= _connector_names(sub)
    return names


def trtllm_with_tiers(
    kwargs: dict[str, Any], tiers: KvTierConfig, *, block_bytes: int
) -> dict[str, Any]:
    """TensorRT-LLM LLM() arguments with the host tier as its secondary KV level (see the module
    docstring). Raises ValueError for a disk tier, or when the engine arguments set
    host_cache_size themselves."""
    if not tiers.enabled:
        return kwargs
    if tiers.kv_disk_blocks:
        raise ValueError(
            "TensorRT-LLM has no disk KV tier (it offloads to host memory only): drop "
            "--kv-disk-blocks / --kv-disk-dir"
        )
    kv = dict(kwargs.get("kv_cache_config") or {})
    if kv.get("host_cache_size"):
        raise ValueError(
            "--kv-host-blocks and kv_cache_config.host_cache_size in --trtllm-engine-args are "
            "exclusive: set one of them"
        )
    kv["host_cache_size"] = tiers.kv_host_blocks * block_bytes
    kv.setdefault("enable_block_reuse", True)
    return {**kwargs, "kv_cache_config": kv}


def refuse_tiers(engine: str, tiers: KvTierConfig, how: str) -> None:
    """Raise ValueError when `tiers` asks for KV tiers the `engine` adapter cannot map (`how`:
    what to use instead)."""
    if tiers.enabled:
        raise ValueError(f"the {engine} adapter does not map --kv-host-blocks/--kv-disk-*: {how}")
