"""Endpoints for an engine's ZMQ KV event publisher (no ZMQ import: engines bind them)."""

from __future__ import annotations

import os
import tempfile
import uuid

__all__ = ["private_ipc_endpoints"]


def private_ipc_endpoints(engine: str) -> tuple[str, str]:
    """(publish endpoint, replay endpoint): fresh ipc sockets in the temp directory, private to
    this worker. The engine's publisher binds them (and ZMQ removes the files on close); the
    worker subscribes to them."""
    base = os.path.join(tempfile.gettempdir(), f"kvmesh-{engine}-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-events", f"ipc://{base}-replay"
