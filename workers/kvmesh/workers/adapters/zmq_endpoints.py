"""Endpoints for an engine's ZMQ KV event publisher (no ZMQ import: engines bind them)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid

__all__ = ["private_ipc_endpoints", "remove_private_ipc_files"]

_PREFIX = "kvmesh-"


def private_ipc_endpoints(engine: str) -> tuple[str, str]:
    """(publish endpoint, replay endpoint): fresh ipc sockets in the temp directory, private to
    this worker. The engine's publisher binds them; the worker subscribes to them and removes
    the socket files when the engine stops (`remove_private_ipc_files`): ZMQ unlinks them only
    when the binding socket is closed cleanly, which an engine process killed or shut down
    without closing its publisher never does."""
    base = os.path.join(tempfile.gettempdir(), f"{_PREFIX}{engine}-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-events", f"ipc://{base}-replay"


def remove_private_ipc_files(*endpoints: str | None) -> None:
    """Unlink the socket files of endpoints made by `private_ipc_endpoints`; any other endpoint
    (a user's tcp:// or ipc:// address, None) is left alone."""
    tmp = tempfile.gettempdir()
    for endpoint in endpoints:
        if not endpoint or not endpoint.startswith("ipc://"):
            continue
        path = endpoint.removeprefix("ipc://")
        if os.path.dirname(path) == tmp and os.path.basename(path).startswith(_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
