"""Where the planner's decisions go: one `Connector` interface over whatever runs the workers.

  * `GrpcConnector`: any `ScalingService` (kvmesh.api.scaling.v1): the local supervisor of
    `kvmesh up`, or an external system that implements the service;
  * `KubernetesConnector` (kvmesh.planner.kubernetes): patches the `scale` subresource of the
    worker Deployments / StatefulSets;
  * `VirtualConnector` (kvmesh.planner.virtual): publishes each decision for an external system
    (through etcd when the mesh uses etcd, else a directory) and waits for it to acknowledge.

Every connector reports the pools it manages (`pools`) and sets pool sizes (`scale`, one or more
pools in one decision);
errors are kvmesh.runtime.errors exceptions (InvalidRequest for a pool it does not manage or a
bad count, Aborted while a previous change is still being applied, Unavailable when it cannot
reach what it drives).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import grpc

from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.planner.policy import PoolState
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.grpcutil import MeshSecurity, error_from_rpc, mesh_channel
from kvmesh.runtime.types import Role
from kvmesh.runtime.wire import role_from_pb, role_to_pb

__all__ = ["Connector", "GrpcConnector", "check_replicas"]


class Connector(Protocol):
    """Sets and reports the size of worker pools."""

    async def pools(self) -> dict[Role, PoolState]:
        """Every pool this connector manages, as it is now."""
        ...

    async def scale(self, targets: Mapping[Role, int], reason: str = "") -> None:
        """Set the target size of each pool in `targets` (returns once the change is under
        way)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def check_replicas(replicas: int, maximum: int) -> None:
    """InvalidRequest unless 0 <= replicas <= maximum."""
    if replicas < 0:
        raise InvalidRequest(f"replicas must be >= 0, got {replicas}", param="replicas")
    if replicas > maximum:
        raise InvalidRequest(
            f"replicas {replicas} exceeds the maximum of {maximum}", param="replicas"
        )


class GrpcConnector:
    """A ScalingService over gRPC (`kvmesh up`'s control port, or an external implementation)."""

    def __init__(
        self,
        address: str,
        model: str = "",
        timeout_s: float = 10.0,
        security: MeshSecurity | None = None,
    ) -> None:
        self.address = address
        self.model = model
        self.timeout_s = timeout_s
        self._channel = mesh_channel(address, security)
        self._stub = spb_grpc.ScalingServiceStub(self._channel)

    async def pools(self) -> dict[Role, PoolState]:
        try:
            reply = await self._stub.ListPools(
                spb.ListPoolsRequest(model=self.model), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        out: dict[Role, PoolState] = {}
        for p in reply.pools:
            role = role_from_pb(p.role)
            if role is not None:
                out[role] = PoolState(
                    role,
                    target=p.target_replicas,
                    ready=p.ready_replicas,
                    starting=p.starting_replicas,
                    draining=p.draining_replicas,
                )
        return out

    async def scale(self, targets: Mapping[Role, int], reason: str = "") -> None:
        for replicas in targets.values():
            check_replicas(replicas, 2**32 - 1)
        for role, replicas in targets.items():
            try:
                await self._stub.Scale(
                    spb.ScaleRequest(
                        model=self.model, role=role_to_pb(role), replicas=replicas, reason=reason
                    ),
                    timeout=self.timeout_s,
                )
            except grpc.aio.AioRpcError as err:
                raise error_from_rpc(err) from None

    async def close(self) -> None:
        await self._channel.close()
