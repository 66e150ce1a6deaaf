"""Shared fixtures: the offline tiny model (with weights for the torch tests), free ports, and a
KVMESH_HOME per session; `load_benchmark` for the smoke tests of the benchmark scripts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from kvmesh.runtime.tinymodel import create_tiny_model

if TYPE_CHECKING:
    from kvmesh.workers.pytorch.model_runner import LoadedModel


def pytest_configure(config: pytest.Config) -> None:
    """A torch device named by KVMESH_TEST_DEVICE (tests/devices.py) must exist: a GPU run that
    silently fell back to the CPU would prove nothing."""
    from tests.devices import DEVICE

    if DEVICE != "cpu":
        import torch

        if not DEVICE.startswith("cuda") or not torch.cuda.is_available():
            raise pytest.UsageError(f"KVMESH_TEST_DEVICE={DEVICE}: no such torch device here")


@pytest.fixture(scope="session")
def kvmesh_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private KVMESH_HOME so tests never touch the user's cache."""
    home = tmp_path_factory.mktemp("kvmesh-home")
    old = os.environ.get("KVMESH_HOME")
    os.environ["KVMESH_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("KVMESH_HOME", None)
    else:
        os.environ["KVMESH_HOME"] = old


@pytest.fixture(scope="session")
def tiny_model(kvmesh_home: Path) -> Path:
    """The tiny offline model directory (tokenizer, chat template, config; no weights)."""
    return create_tiny_model(kvmesh_home / "models" / "tiny-llama")


@pytest.fixture(scope="module")
def torch_model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny model with its deterministic random weights (needs torch)."""
    from kvmesh.workers.pytorch.weights import create_tiny_weights

    path = tmp_path_factory.mktemp("torch-model") / "tiny-llama"
    shutil.copytree(tiny_model, path)
    create_tiny_weights(path)
    return path


def load_benchmark(name: str) -> ModuleType:
    """The script tests/benchmarks/`name`.py as a module, registered under `name` (dataclasses
    look their module up; the scripts import each other by that name)."""
    path = Path(__file__).resolve().parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def generate_reference(
    loaded: LoadedModel, eos: Sequence[int], prompt: list[int], n: int
) -> list[int]:
    """transformers generate() of `prompt`, greedy: the up to `n` tokens it adds (needs torch)."""
    import torch

    ids = torch.tensor([prompt], device=loaded.device)
    out = loaded.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
    )
    return list(out[0, len(prompt) :].tolist())
