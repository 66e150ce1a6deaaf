"""`kvmesh up --prefill-workers 1 --decode-workers 1` with the mocker, as real processes: the
official `openai` client gets its answers through prefill and decode workers, the frontend's
/metrics shows the remote prefills and KV bytes moved, and ScalingService scales the prefill
and decode pools (and only those)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.runtime.ports import free_port
from tests.integration.test_up_openai import start_mesh, stop_mesh

pytestmark = pytest.mark.integration


def test_disaggregated_mesh_serves_counts_and_scales(tiny_model: Path, tmp_path: Path) -> None:
    control = free_port()
    mesh = start_mesh(
        tmp_path,
        "--workers",
        "0",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--disagg-local-prefill-tokens",
        "0",
        "--kv-transfer-gbps",
        "1000",
        "--control-port",
        str(control),
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{control}")
    stub = spb_grpc.ScalingServiceStub(channel)

    def pools() -> dict[int, spb.PoolStatus]:
        return {p.role: p for p in stub.ListPools(spb.ListPoolsRequest()).pools}

    def wait_ready(role: int, ready: int) -> None:
        deadline = time.monotonic() + 30
        while pools()[role].ready_replicas != ready:
            assert time.monotonic() < deadline, pools()
            time.sleep(0.1)

    try:
        assert set(pools()) == {cpb.WORKER_ROLE_PREFILL, cpb.WORKER_ROLE_DECODE}
        wait_ready(cpb.WORKER_ROLE_PREFILL, 1)
        wait_ready(cpb.WORKER_ROLE_DECODE, 1)
        mesh.wait_workers(prefill=1, decode=1)
        client = mesh.client()
        for i in range(3):
            res = client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": f"Tell me about disaggregation {i}"}],
                max_tokens=6,
                temperature=0,
            )
            assert res.usage is not None and res.usage.completion_tokens == 6
        m = mesh.metrics()
        assert m["kvmesh_remote_prefill_total"] == 3
        assert m["kvmesh_kv_transfer_bytes_total"] > 0

        up = stub.Scale(spb.ScaleRequest(role=cpb.WORKER_ROLE_DECODE, replicas=2))
        assert (up.previous_replicas, up.target_replicas) == (1, 2)
        wait_ready(cpb.WORKER_ROLE_DECODE, 2)
        assert pools()[cpb.WORKER_ROLE_PREFILL].target_replicas == 1
        with pytest.raises(grpc.RpcError) as info:  # no aggregated pool in this mesh
            stub.Scale(spb.ScaleRequest(role=cpb.WORKER_ROLE_AGGREGATED, replicas=1))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
