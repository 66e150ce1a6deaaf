"""Configuration of the PyTorch engine (`kvmesh worker --engine torch`). Imports no torch.

Scheduler knobs that the mocker has too (block size, batch limits, prefix caching, ...) share
their argparse destination with the mocker's flags: `--block-size 32` and `--torch-block-size 32`
both set the torch engine's block size, so the generic vLLM-style flags work whichever engine
runs, while each engine keeps its own default (16 here, 64 for the mocker).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvmesh.runtime.config import opt
from kvmesh.workers.adapters.config import parse_lora_modules

__all__ = ["EmbeddingNormalize", "Pooling", "TorchConfig", "TorchDType"]


class TorchDType(enum.Enum):
    """Compute dtype of weights, activations and the KV cache."""

    AUTO = "auto"
    """float32 on CPU; on CUDA the checkpoint's dtype, float32 checkpoints in bfloat16."""
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Pooling(enum.Enum):
    """How /v1/embeddings pools a prompt's final hidden states into one vector."""

    AUTO = "auto"
    """The model's sentence-transformers pooling config (1_Pooling/config.json), else LAST."""
    MEAN = "mean"
    LAST = "last"
    """The last token's hidden state (decoder embedding models: Qwen3-Embedding, e5-mistral)."""
    CLS = "cls"
    """The first token's hidden state."""


class EmbeddingNormalize(enum.Enum):
    """Whether embedding vectors are scaled to unit length."""

    AUTO = "auto"
    """As the model's sentence-transformers modules.json says (a Normalize module), else yes."""
    YES = "yes"
    NO = "no"


@dataclass(slots=True)
class TorchConfig:
    """Knobs of the PyTorch/transformers engine."""

    device: str = opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    dtype: TorchDType = opt(TorchDType.AUTO, "compute and KV cache dtype")
    block_size: int = opt(16, "tokens per KV cache block", flag="--torch-block-size")
    num_gpu_blocks: int = opt(
        0,
        "number of KV cache blocks (0: sized from --kv-cache-gb)",
        flag="--torch-num-gpu-blocks",
    )
    kv_cache_gb: float = opt(
        0.0,
        "KV cache size in GiB when the block count is 0; 0: auto (CPU: 1 GiB; CUDA: 90 percent of "
        "the memory free after loading the weights); capped at what max-num-seqs full-length "
        "sequences need",
    )
    max_num_seqs: int = opt(
        256, "maximum number of running sequences per step", flag="--torch-max-num-seqs"
    )
    max_num_batched_tokens: int = opt(
        2048, "token budget of one scheduler step", flag="--torch-max-num-batched-tokens"
    )
    enable_chunked_prefill: bool = opt(
        True,
        "split long prompts over several steps (otherwise a prompt must fit one step)",
        flag="--torch-enable-chunked-prefill",
    )
    enable_prefix_caching: bool = opt(
        True,
        "reuse cached KV blocks across requests and publish KV events",
        flag="--torch-enable-prefix-caching",
    )
    max_model_len: int = opt(
        0, "maximum sequence length (0: the model's context length)", flag="--torch-max-model-len"
    )
    seed: int = opt(
        0, "seed of the per-request seeds drawn for unseeded sampled requests", flag="--torch-seed"
    )
    embedding_pooling: Pooling = opt(Pooling.AUTO, "pooling of embeddings (/v1/embeddings)")
    embedding_normalize: EmbeddingNormalize = opt(
        EmbeddingNormalize.AUTO, "scale embeddings to unit length"
    )
    max_loras: int = opt(
        4,
        "LoRA adapters kept loaded; loading one more unloads the least recently used",
        flag="--torch-max-loras",
    )
    lora_modules: tuple[str, ...] = opt(
        (), "peft LoRA adapters to load at start, as NAME=PATH", flag="--torch-lora-modules"
    )
    num_speculative_tokens: int = opt(
        0,
        "speculative decoding: draft tokens per step by prompt lookup (n-gram) for greedy "
        "requests; 0: off",
        flag="--torch-num-speculative-tokens",
    )
    prompt_lookup_max: int = opt(
        4,
        "longest n-gram the prompt-lookup drafter matches (at least the shortest)",
        flag="--torch-prompt-lookup-max",
    )
    prompt_lookup_min: int = opt(
        1, "shortest n-gram the prompt-lookup drafter matches", flag="--torch-prompt-lookup-min"
    )
    draft_model: str = opt(
        "",
        "speculative decoding: a smaller model directory with the same vocabulary that drafts "
        "the tokens instead of prompt lookup (needs --torch-num-speculative-tokens)",
        flag="--torch-draft-model",
    )
    spec_min_acceptance: float = opt(
        0.2,
        "speculative decoding: a request whose drafts' acceptance over its last 4 verified steps "
        "falls below this stops drafting for a back-off; 0: always draft",
        flag="--torch-spec-min-acceptance",
    )
    spec_backoff_steps: int = opt(
        16,
        "speculative decoding: decode steps a request skips drafting after low acceptance "
        "(doubled at each consecutive failure, up to 8 times)",
        flag="--torch-spec-backoff-steps",
    )

    num_threads: int = opt(
        0,
        "CPU threads of the engine's tensor work (torch.set_num_threads); 0: torch's default, "
        "one per core (kvmesh up splits the cores among its torch workers instead: several "
        "workers each using every core run many times slower)",
        flag="--torch-num-threads",
    )

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_gpu_blocks < 0:
            raise ValueError("num_gpu_blocks must be >= 0")
        if not self.kv_cache_gb >= 0:
            raise ValueError("kv_cache_gb must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        parse_lora_modules(self.lora_modules, "--torch-lora-modules")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.prompt_lookup_min < 1 or self.prompt_lookup_max < 1:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must be >= 1")
        if not 0.0 <= self.spec_min_acceptance <= 1.0:
            raise ValueError("spec_min_acceptance must be between 0 and 1")
        if self.spec_backoff_steps < 1:
            raise ValueError("spec_backoff_steps must be >= 1")
