"""The real-vLLM tier's shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_real.env import MODEL, create_vllm_tiny_model


@pytest.fixture(scope="session")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvmesh's tiny Llama with 32-dim heads, served as MODEL (built once per session)."""
    return create_vllm_tiny_model(tmp_path_factory.mktemp("vllm") / MODEL, tiny_model)
