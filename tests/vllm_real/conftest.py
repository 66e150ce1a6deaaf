"""The real-vLLM tier's shared fixtures."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm_real.env import MODEL, create_vllm_tiny_model, plugin_dist


@pytest.fixture(scope="session", autouse=True)
def vllm_plugin() -> Iterator[None]:
    """kvmesh's vLLM plugin registered for the engines this process starts (and the processes
    they spawn), as an installed kvmesh registers it through its entry point."""
    path = str(plugin_dist())
    saved = os.environ.get("PYTHONPATH")
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([path, *([saved] if saved else [])])
    importlib.invalidate_caches()
    yield
    sys.path.remove(path)
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="session")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvmesh's tiny Llama with 32-dim heads, served as MODEL (built once per session)."""
    return create_vllm_tiny_model(tmp_path_factory.mktemp("vllm") / MODEL, tiny_model)
