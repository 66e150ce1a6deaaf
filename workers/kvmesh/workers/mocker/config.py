"""Configuration of the mocker engine (`kvmesh worker --engine mocker`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.runtime.config import opt
from kvmesh.runtime.kv_events import KvTier
from kvmesh.workers.adapters.config import parse_lora_modules


@dataclass(slots=True)
class MockerConfig:
    """Knobs of the simulated engine. The first six mirror vLLM's engine arguments."""

    num_gpu_blocks: int = opt(16384, "number of KV cache blocks in the simulated pool")
    block_size: int = opt(64, "tokens per KV cache block")
    max_num_seqs: int = opt(256, "maximum number of running sequences per step")
    max_num_batched_tokens: int = opt(8192, "token budget of one scheduler step")
    watermark: float = opt(
        0.01, "fraction of KV blocks kept free when admitting new requests (0 <= w < 1)"
    )
    enable_chunked_prefill: bool = opt(
        True, "split long prompts over several steps (otherwise a prompt must fit one step)"
    )
    enable_prefix_caching: bool = opt(
        True, "reuse cached KV blocks across requests and publish KV events"
    )
    speedup_ratio: float = opt(
        1.0, "simulated step durations are divided by this (large values: as fast as possible)"
    )
    timing_profile: str = opt(
        "",
        "JSON timing profile (prefill_tokens/prefill_ms, decode_kv_usage/decode_ms tables, "
        "linearly interpolated); empty: the Dynamo mocker polynomial model",
    )
    max_model_len: int = opt(0, "maximum sequence length (0: the model's context length)")
    seed: int = opt(0, "seed of the per-request seeds drawn for unseeded sampled requests")
    max_loras: int = opt(
        4, "LoRA adapters kept loaded; loading one more unloads the least recently used"
    )
    lora_modules: tuple[str, ...] = opt(
        (),
        "LoRA adapter names to load at start, as NAME=PATH (simulated: the path is not read)",
    )
    kv_bytes_per_token: int = opt(
        131072,
        "disaggregation: simulated KV cache bytes per token (default: Llama-3-8B in bf16, "
        "2 x 32 layers x 8 KV heads x 128 dims x 2 bytes)",
    )
    kv_transfer_gbps: float = opt(
        25.0, "disaggregation: simulated KV transfer bandwidth between workers, GB/s"
    )
    kv_transfer_latency_ms: float = opt(
        1.0, "disaggregation: simulated fixed cost of one KV transfer (setup, completion), ms"
    )
    kv_host_gbps: float = opt(
        25.0,
        "KV tiers: simulated bandwidth of moves between the device pool and the host tier, GB/s "
        "(PCIe 4.0 x16 class)",
    )
    kv_disk_gbps: float = opt(
        5.0, "KV tiers: simulated bandwidth of moves to and from the disk tier, GB/s (NVMe class)"
    )
    kv_tier_latency_ms: float = opt(
        0.05, "KV tiers: simulated fixed cost of one move between tiers (a batch of blocks), ms"
    )

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        parse_lora_modules(self.lora_modules, "--lora-modules")
        if self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if not (self.speedup_ratio > 0 and not math.isnan(self.speedup_ratio)):
            raise ValueError("speedup_ratio must be > 0")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
        if self.kv_bytes_per_token < 1:
            raise ValueError("kv_bytes_per_token must be >= 1")
        if not self.kv_transfer_gbps > 0 or not self.kv_transfer_latency_ms >= 0:
            raise ValueError("kv_transfer_gbps must be > 0 and kv_transfer_latency_ms >= 0")
        if not (self.kv_host_gbps > 0 and self.kv_disk_gbps > 0 and self.kv_tier_latency_ms >= 0):
            raise ValueError(
                "kv_host_gbps and kv_disk_gbps must be > 0 and kv_tier_latency_ms >= 0"
            )

    @property
    def watermark_blocks(self) -> int:
        """Blocks admission keeps free (vLLM: int(watermark * num_blocks))."""
        return int(self.watermark * self.num_gpu_blocks)

    @property
    def kv_block_bytes(self) -> int:
        """Simulated bytes of one KV block."""
        return self.kv_bytes_per_token * self.block_size

    def transfer_s(self, nbytes: int) -> float:
        """Simulated time (before speedup) to move `nbytes` of KV between two workers."""
        return self.kv_transfer_latency_ms / 1000.0 + nbytes / (self.kv_transfer_gbps * 1e9)

    def tier_move_s(self, tier: KvTier, nbytes: int) -> float:
        """Simulated time (before speedup) of one move of `nbytes` to or from `tier` (HOST:
        between the device and the host tier; DISK: to or from the disk tier); 0 for nothing."""
        if nbytes <= 0:
            return 0.0
        gbps = self.kv_host_gbps if tier is KvTier.HOST else self.kv_disk_gbps
        return self.kv_tier_latency_ms / 1000.0 + nbytes / (gbps * 1e9)
