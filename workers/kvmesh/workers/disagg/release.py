"""The decode side's ReleaseKvBlocks client: what a worker server gives its engine as
DisaggSettings.release_remote."""

from __future__ import annotations

import logging

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.runtime.grpcutil import MeshSecurity, mesh_channel
from kvmesh.runtime.types import KvTransferHandle

__all__ = ["GrpcKvReleaser"]

log = logging.getLogger(__name__)


class GrpcKvReleaser:
    """Calls ReleaseKvBlocks on the prefill worker named by a handle (one channel per address,
    kept until `close`). Returns the worker's `released`; False when it cannot be reached, so a
    caller never trusts KV it could not confirm."""

    def __init__(self, timeout_s: float = 5.0, *, security: MeshSecurity | None = None) -> None:
        self.timeout_s = timeout_s
        self.security = security
        self._channels: dict[str, tuple[grpc.aio.Channel, wpb_grpc.WorkerServiceAsyncStub]] = {}

    async def __call__(self, handle: KvTransferHandle) -> bool:
        address = handle.prefill_address
        if not address or not handle.transfer_id:
            return False
        entry = self._channels.get(address)
        if entry is None:
            channel = mesh_channel(address, self.security)
            entry = self._channels[address] = (channel, wpb_grpc.WorkerServiceStub(channel))
        try:
            resp = await entry[1].ReleaseKvBlocks(
                wpb.ReleaseKvBlocksRequest(transfer_id=handle.transfer_id), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "cannot release transfer %s on %s: %s", handle.transfer_id, address, exc.code()
            )
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                self._channels.pop(address, None)
                await entry[0].close(None)
            return False
        return bool(resp.released)

    async def close(self) -> None:
        """Close every channel."""
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close(None)
