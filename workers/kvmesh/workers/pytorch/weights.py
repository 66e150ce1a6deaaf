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

`create_tiny_llava(model_dir)` writes a whole tiny LLaVA-style directory (transformers'
`LlavaForConditionalGeneration`: a CLIP vision tower, the projector, the tiny Llama of
kvmesh.runtime.tinymodel as language model) with those weights, and the image-processor and
processor configs `AutoProcessor` reads, so the directory describes itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["WEIGHTS_FILE", "create_tiny_llava", "create_tiny_weights", "has_weights"]

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
    from transformers import AutoConfig, AutoModelForCausalLM, LlavaForConditionalGeneration

    root = Path(model_dir)
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    multimodal = getattr(config, "model_type", "") == "llava"
    auto: Any = LlavaForConditionalGeneration if multimodal else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto._from_config(config) if multimodal else auto.from_config(config)
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
        tensors[_checkpoint_name(name) if multimodal else name] = value.to(dtype).contiguous()
    path = root / WEIGHTS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


_LLAVA_TOWER = "model.vision_tower."


def _checkpoint_name(name: str) -> str:
    """A LLaVA parameter's name in the checkpoint layout published LLaVA models use (the CLIP
    tower's weights under `vision_model.`, as CLIPVisionModel holds them): transformers 5 maps it
    back to its own module tree when loading, and vLLM's LLaVA loader reads only this layout."""
    if name.startswith(_LLAVA_TOWER):
        return f"{_LLAVA_TOWER}vision_model.{name[len(_LLAVA_TOWER) :]}"
    return name


TINY_LLAVA_IMAGE_SIZE = 16
"""The tiny LLaVA's vision input side (pixels): 4x4 patches of 4 pixels, so 16 image tokens."""


def create_tiny_llava(model_dir: str | Path, seed: int = 0, *, head_dim: int | None = None) -> Path:
    """Write a tiny LLaVA-style model directory at `model_dir` (see the module docstring) and
    return it: the tiny Llama tokenizer with an `<image>` special token and a chat template that
    renders image parts as `<image>`, a LlavaConfig (vision: CLIP, 2 layers, 16-pixel images in
    4-pixel patches; feature layer -2 without its CLS token: 16 tokens per image; text: the tiny
    Llama), preprocessor_config.json (CLIPImageProcessor), processor_config.json
    (LlavaProcessor) and deterministic random weights. Deterministic and offline; an existing
    complete directory (of the same `head_dim`) is left as it is.

    `head_dim`: the language model's attention head size (the tiny Llama's 16 unless given;
    vLLM's CPU attention needs 32 or more, tests/vllm_real builds it with 32).
    """
    from kvmesh.runtime.tinymodel import IMAGE_CHAT_TEMPLATE, IMAGE_TOKEN, create_tiny_model

    root = Path(model_dir)
    config_path = root / "config.json"
    if has_weights(root) and config_path.is_file():
        existing = json.loads(config_path.read_text())
        if existing.get("model_type") == "llava" and (
            head_dim is None or existing["text_config"].get("head_dim") == head_dim
        ):
            return root
    create_tiny_model(
        root,
        name="tiny-llava",
        extra_tokens=(IMAGE_TOKEN,),
        chat_template=IMAGE_CHAT_TEMPLATE,
    )
    text = json.loads(config_path.read_text())
    if text.get("model_type") == "llava" and head_dim is not None:  # another head size
        text["text_config"]["head_dim"] = head_dim
        _write_json(root, "config.json", text)
    elif text.get("model_type") != "llava":
        tokenizer = json.loads((root / "tokenizer.json").read_text())
        image_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == IMAGE_TOKEN)
        text.pop("architectures", None)
        text.pop("_name_or_path", None)
        if head_dim is not None:
            text["head_dim"] = head_dim
        side, patch = TINY_LLAVA_IMAGE_SIZE, 4
        config = {
            "_name_or_path": "tiny-llava",
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "image_token_id": image_id,
            "projector_hidden_act": "gelu",
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "image_seq_length": (side // patch) ** 2,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "text_config": text,
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "image_size": side,
                "patch_size": patch,
                "projection_dim": 32,
                "hidden_act": "quick_gelu",
            },
        }
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
        preprocessor = {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": side},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": side, "width": side},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": mean,
            "image_std": std,
            "do_convert_rgb": True,
        }
        processor = {
            "processor_class": "LlavaProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": patch,
            "num_additional_image_tokens": 1,
            "vision_feature_select_strategy": "default",
        }
        for name, obj in (
            ("preprocessor_config.json", preprocessor),
            ("processor_config.json", processor),
            ("config.json", config),
        ):
            _write_json(root, name, obj)
    create_tiny_weights(root, seed)
    return root


def _write_json(root: Path, name: str, obj: Any) -> None:
    """Write `root`/`name` atomically."""
    tmp = root / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, root / name)
