"""Shared fixtures: the offline tiny model, free ports, and a KVMESH_HOME per session."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.runtime.tinymodel import create_tiny_model


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


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
