"""Deterministic random weights for a Hugging Face causal-LM directory (tests, benchmarks, demos).

`create_tiny_weights(model_dir)` reads the directory's config.json (e.g. the one
kvmesh.runtime.tinymodel writes), lists the parameters the architecture has (the model is built on
the `meta` device, so nothing is allocated) and writes `model.safetensors` with values drawn from a
seeded generator in sorted parameter-name order:

  * norm weights: 1; biases: 0;
  * embeddings: N(0, 1);
  * every other matrix: N(0, 1/fan_in), so each layer's output is of the same order as the
    residual stream and attention really depends on the context (with the usual 0.02 init a
    random model's next token depends almost only on the current token, which would hide
    attention and KV-cache bugs from greedy-equality tests).

The file is a pure function of (config, seed, torch's normal_ algorithm): the same bytes on every
run. It is written atomically, so concurrent creators never expose half a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["WEIGHTS_FILE", "create_tiny_weights", "has_weights"]

WEIGHTS_FILE = "model.safetensors"


def has_weights(model_dir: str | Path) -> bool:
    """True if `model_dir` holds safetensors or PyTorch weights (single or sharded)."""
    root = Path(model_dir)
    patterns = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
    return any(any(root.glob(p)) for p in patterns)


def create_tiny_weights(model_dir: str | Path, seed: int = 0) -> Path:
    """Write deterministic random weights for `model_dir`/config.json; return the file's path.

    Overwrites an existing model.safetensors (with the same bytes, for the same seed and config).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(model_dir)
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    auto: Any = AutoModelForCausalLM  # from_config is untyped
    with torch.device("meta"):
        model = auto.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "tie_word_embeddings", False):
        for name in getattr(model, "_tied_weights_keys", None) or {}:
            shapes.pop(name, None)
    dtype = getattr(config, "dtype", None) or torch.float32
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(dtype))
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            value = torch.zeros(shape)
        elif len(shape) == 1:  # RMSNorm / LayerNorm scales
            value = torch.ones(shape)
        elif "embed" in name:
            value = torch.empty(shape).normal_(0.0, 1.0, generator=gen)
        else:
            value = torch.empty(shape).normal_(0.0, shape[-1] ** -0.5, generator=gen)
        tensors[name] = value.to(dtype).contiguous()
    path = root / WEIGHTS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path
