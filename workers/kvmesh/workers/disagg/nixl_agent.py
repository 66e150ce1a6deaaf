"""A NIXL agent for KV transfer, used from the event loop.

One agent per engine. It registers the engine's KV storage once (a torch tensor: host memory on
CPU machines, "DRAM"; GPU memory on GPU machines, "VRAM"); its metadata (`metadata`, what a
peer passes to add_remote_agent) travels inside each KvTransferHandle, so peers need no side
channel. A pull is a one-sided READ: the prefill side does nothing while a decode worker reads
its pinned blocks.

`read` posts the transfer and polls its state without blocking the loop. If the caller is
cancelled or the deadline passes, the transfer is released (NIXL cancels it); when NIXL cannot
cancel it, `read` waits for it to end before returning, so the local blocks it writes into are
never handed to anyone else while the transfer may still write them.

Every NIXL call happens on the thread that owns the event loop (agents are created with NIXL's
default, unsynchronized, thread mode). NIXL's own progress thread is off: it busy-polls a core
even when idle, which an engine sharing the machine's cores cannot afford. The puller makes
progress by polling its transfer; the side being read must make progress too (UCX needs it to
complete a READ), so a prefill engine calls `progress()` every millisecond while it has blocks
pinned (`pump`), and not at all otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

__all__ = ["NixlKvAgent", "TransferError", "nixl_available"]

log = logging.getLogger(__name__)

_ABORT_WAIT_S = 5.0


def nixl_available() -> bool:
    """Whether the NIXL Python package is installed (`pip install kvmesh[nixl]`)."""
    return importlib.util.find_spec("nixl") is not None


class TransferError(Exception):
    """A KV transfer failed, timed out or could not be set up."""


class NixlKvAgent:
    """One NIXL agent (UCX backend) with the engine's KV memory registered (module docstring).

    `name`: unique agent name (default: random). Raises ImportError when NIXL is missing and
    TransferError when the UCX backend cannot be created.
    """

    def __init__(self, name: str = "", *, backends: tuple[str, ...] = ("UCX",)) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name or f"kvmesh-{uuid.uuid4().hex[:12]}"
        config = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self._agent: Any = nixl_agent(self.name, config)
        if not all(b in self._agent.backends for b in backends):
            raise TransferError(f"NIXL backends {backends} are not available on this machine")
        self._registered: list[Any] = []
        self._remotes: dict[str, bytes] = {}
        self._metadata = b""
        self.memory_kind = "DRAM"
        self.device_id = 0
        self.bytes_read = 0
        """Bytes this agent has pulled so far."""

    def register(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor's memory (host: DRAM, CUDA: VRAM) for transfers."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        self._registered.append(self._agent.register_memory(tensor))
        self.memory_kind = "VRAM" if tensor.is_cuda else "DRAM"
        self.device_id = (tensor.device.index or 0) if tensor.is_cuda else 0
        self._metadata = bytes(self._agent.get_agent_metadata())

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory), for peers."""
        if not self._metadata:
            self._metadata = bytes(self._agent.get_agent_metadata())
        return self._metadata

    def _remote(self, name: str, metadata: bytes) -> str:
        known = self._remotes.get(name)
        if known == metadata:
            return name
        if known is not None:  # the peer re-registered its memory: reload it
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)
        loaded = self._agent.add_remote_agent(metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != name:
            raise TransferError(f"agent metadata names {loaded_name!r}, expected {name!r}")
        self._remotes[name] = metadata
        return name

    def progress(self) -> None:
        """Let UCX make progress on transfers that read this agent's memory."""
        self._agent.get_new_notifs()

    async def pump(self, busy: Callable[[], bool], interval_s: float = 0.001) -> None:
        """Call progress() every `interval_s` while `busy()` (blocks wait to be pulled)."""
        while busy():
            self.progress()
            await asyncio.sleep(interval_s)

    def forget(self, name: str) -> None:
        """Drop a peer (e.g. it died); the next read from it loads its metadata again."""
        if self._remotes.pop(name, None) is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)

    async def read(
        self,
        remote_name: str,
        remote_metadata: bytes,
        local: npt.NDArray[np.uint64],
        remote: npt.NDArray[np.uint64],
        *,
        remote_kind: str = "DRAM",
        timeout_s: float = 10.0,
    ) -> int:
        """READ `remote` pieces (N x 3: address, length, device) of the peer into `local` pieces
        (same shape and lengths, registered here). Returns the bytes read; raises TransferError
        (failure, timeout) or CancelledError, after the transfer has ended either way."""
        if local.shape != remote.shape or (local[:, 1] != remote[:, 1]).any():
            raise TransferError("local and remote descriptors differ in count or length")
        if not len(local):
            return 0
        agent = self._agent
        try:
            name = self._remote(remote_name, remote_metadata)
            local_descs = agent.get_xfer_descs(local, self.memory_kind)
            remote_descs = agent.get_xfer_descs(remote, remote_kind or "DRAM")
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, name)
        except TransferError:
            raise
        except Exception as exc:  # nixlBackendError, nixlNotFoundError, ...
            self.forget(remote_name)
            raise TransferError(f"cannot set up the KV transfer from {remote_name}: {exc}") from exc
        done = False
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            polls = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"KV transfer from {remote_name} timed out")
                polls += 1
                await asyncio.sleep(0 if polls < 16 else min(0.002, 0.0001 * polls))
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                self.forget(remote_name)
                raise TransferError(f"KV transfer from {remote_name} failed ({state})")
            done = True
        finally:
            self._finish(handle, done)
        nbytes = int(local[:, 1].sum())
        self.bytes_read += nbytes
        return nbytes

    def _finish(self, handle: Any, done: bool) -> None:
        """Release a transfer handle; if NIXL cannot cancel a running transfer, wait for it."""
        agent = self._agent
        try:
            agent.release_xfer_handle(handle)
            return
        except Exception:
            if done:
                raise
        deadline = time.monotonic() + _ABORT_WAIT_S
        while time.monotonic() < deadline:  # rare: a transfer that cannot be cancelled
            try:
                if agent.check_xfer_state(handle) != "PROC":
                    break
            except Exception:
                break
            time.sleep(0.001)
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            log.exception("cannot release a NIXL transfer handle")

    def close(self) -> None:
        """Deregister memory and drop peers (idempotent)."""
        for name in list(self._remotes):
            self.forget(name)
        registered, self._registered = self._registered, []
        for reg in registered:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
