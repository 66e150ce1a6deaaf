"""The planner's connectors: Kubernetes (against an emulation of the scale subresource's HTTP
contract: no real cluster can run here, see tests/k8s_apiserver.py) and virtual (file store here;
the etcd store in tests/integration/test_planner_etcd.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.planner.kubernetes import CONFLICT_RETRIES, KubernetesConfig, KubernetesConnector
from kvmesh.planner.policy import PoolState
from kvmesh.planner.virtual import FileStore, VirtualConfig, VirtualConnector
from kvmesh.runtime.errors import Aborted, InvalidRequest, NotFound, Unavailable
from kvmesh.runtime.types import Role
from tests.k8s_apiserver import FakeApiServer

pytestmark = pytest.mark.unit

NS = "kvmesh"
PLANNER_RBAC = {
    ("get", "deployments"),
    ("get", "deployments/scale"),
    ("patch", "deployments/scale"),
    ("get", "statefulsets"),
    ("get", "statefulsets/scale"),
    ("patch", "statefulsets/scale"),
}


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer({"planner-token": PLANNER_RBAC, "read-only": {("get", "deployments")}})
    server.add("deployments", NS, "kvmesh-worker", 2)
    server.add("deployments", NS, "kvmesh-prefill", 1)
    server.add("statefulsets", NS, "kvmesh-decode", 3)
    await server.start()
    yield server
    await server.stop()


def connector(
    api: FakeApiServer, tmp_path: Path, token: str, *workloads: str
) -> KubernetesConnector:
    kubeconfig = tmp_path / f"kubeconfig-{token}"
    kubeconfig.write_text(api.kubeconfig(token))
    return KubernetesConnector(
        KubernetesConfig(
            k8s_workloads=list(workloads), k8s_namespace=NS, k8s_kubeconfig=str(kubeconfig)
        )
    )


async def test_kubernetes_reads_pools_and_patches_the_scale_subresource(
    api: FakeApiServer, tmp_path: Path
) -> None:
    k8s = connector(
        api,
        tmp_path,
        "planner-token",
        "prefill=deployment/kvmesh-prefill",
        "decode=statefulset/kvmesh-decode",
    )
    try:
        pools = await k8s.pools()
        assert pools[Role.PREFILL] == PoolState(Role.PREFILL, target=1, ready=1)
        assert pools[Role.DECODE] == PoolState(Role.DECODE, target=3, ready=3)
        rv_before = api.objects[("statefulsets", NS, "kvmesh-decode")].resource_version
        await k8s.scale({Role.PREFILL: 4, Role.DECODE: 1}, "planner: test")
        # the patches: JSON merge patches of the scale subresource, with the resourceVersion read
        patches = [r for r in api.requests if r[0] == "PATCH"]
        assert patches == [
            ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/kvmesh-prefill/scale",
             "application/merge-patch+json"),
            ("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/kvmesh-decode/scale",
             "application/merge-patch+json"),
        ]  # fmt: skip
        decode = api.objects[("statefulsets", NS, "kvmesh-decode")]
        assert decode.replicas == 1 and decode.resource_version > rv_before
        assert api.objects[("deployments", NS, "kvmesh-prefill")].replicas == 4
        # Right after the patch the pods have not followed yet: starting / draining.
        pools = await k8s.pools()
        assert pools[Role.PREFILL].target == 4 and pools[Role.PREFILL].starting >= 0
        # Scaling to the current size sends no patch.
        n = len(api.requests)
        await k8s.scale({Role.PREFILL: 4})
        assert [r[0] for r in api.requests[n:]] == ["GET"]
    finally:
        await k8s.close()


async def test_kubernetes_conflicts_are_retried_then_aborted(
    api: FakeApiServer, tmp_path: Path
) -> None:
    k8s = connector(api, tmp_path, "planner-token", "aggregated=deployment/kvmesh-worker")
    try:
        api.interfere(CONFLICT_RETRIES - 1)  # someone else writes after each of our reads
        await k8s.scale({Role.AGGREGATED: 5})
        assert api.objects[("deployments", NS, "kvmesh-worker")].replicas == 5
        api.interfere(CONFLICT_RETRIES)
        with pytest.raises(Aborted, match="changed concurrently"):
            await k8s.scale({Role.AGGREGATED: 1})
        assert api.objects[("deployments", NS, "kvmesh-worker")].replicas == 5  # not applied
    finally:
        await k8s.close()


async def test_kubernetes_bad_input_and_missing_rbac(api: FakeApiServer, tmp_path: Path) -> None:
    k8s = connector(api, tmp_path, "planner-token", "aggregated=deployment/kvmesh-worker")
    try:
        with pytest.raises(InvalidRequest, match="no decode pool"):
            await k8s.scale({Role.DECODE: 1})
        with pytest.raises(InvalidRequest, match=">= 0"):
            await k8s.scale({Role.AGGREGATED: -1})
        assert not [r for r in api.requests if r[0] == "PATCH"]
    finally:
        await k8s.close()
    missing = connector(api, tmp_path, "planner-token", "aggregated=deployment/nope")
    try:
        with pytest.raises(NotFound, match="not found"):
            await missing.pools()
    finally:
        await missing.close()
    read_only = connector(api, tmp_path, "read-only", "aggregated=deployment/kvmesh-worker")
    try:
        assert (await read_only.pools())[Role.AGGREGATED].target == 2
        with pytest.raises(Unavailable, match=r"forbidden.*patch on their scale subresource"):
            await read_only.scale({Role.AGGREGATED: 3})
    finally:
        await read_only.close()
    with pytest.raises(InvalidRequest, match="ROLE=deployment/NAME"):
        KubernetesConnector(KubernetesConfig(k8s_workloads=["aggregated=pod/x"]))
    with pytest.raises(InvalidRequest, match="twice"):
        KubernetesConnector(
            KubernetesConfig(k8s_workloads=["decode=deployment/a", "decode=deployment/b"])
        )


async def test_the_emulation_refuses_what_the_api_refuses(api: FakeApiServer) -> None:
    """The emulation itself: wrong patch type, stale resourceVersion, negative replicas."""
    import aiohttp

    url = (
        f"http://127.0.0.1:{api.port}/apis/apps/v1/namespaces/{NS}/deployments/kvmesh-worker/scale"
    )
    auth = {"Authorization": "Bearer planner-token"}
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            assert r.status == 401
        async with http.patch(
            url, data="{}", headers={**auth, "Content-Type": "application/json"}
        ) as r:
            assert r.status == 415
        merge = {**auth, "Content-Type": "application/merge-patch+json"}
        stale = json.dumps({"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}})
        async with http.patch(url, data=stale, headers=merge) as r:
            assert r.status == 409 and (await r.json())["reason"] == "Conflict"
        async with http.patch(url, data='{"spec": {"replicas": -2}}', headers=merge) as r:
            assert r.status == 422
        jp = json.dumps([{"op": "test", "path": "/spec/replicas", "value": 2},
                         {"op": "replace", "path": "/spec/replicas", "value": 6}])  # fmt: skip
        async with http.patch(
            url, data=jp, headers={**auth, "Content-Type": "application/json-patch+json"}
        ) as r:
            assert r.status == 200 and (await r.json())["spec"]["replicas"] == 6


async def test_virtual_connector_waits_for_acknowledgements(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "decisions")
    virtual = VirtualConnector(
        VirtualConfig(virtual_store="unused", virtual_pools=["prefill", "decode"]), store
    )
    pools = await virtual.pools()
    assert pools[Role.PREFILL] == PoolState(Role.PREFILL, target=0, ready=0)
    await virtual.scale({Role.PREFILL: 2, Role.DECODE: 3}, "planner: first")
    decision = json.loads((tmp_path / "decisions" / "decision.json").read_text())
    assert decision["id"] == 1 and decision["targets"] == {"prefill": 2, "decode": 3}
    # Not acknowledged: the pools are starting, and a new decision is refused whole.
    pools = await virtual.pools()
    assert pools[Role.DECODE] == PoolState(Role.DECODE, target=3, ready=0, starting=3)
    with pytest.raises(Aborted, match="decision 1 is not acknowledged"):
        await virtual.scale({Role.DECODE: 1})
    assert json.loads((tmp_path / "decisions" / "decision.json").read_text())["id"] == 1
    # The external system acknowledges, reporting its pools.
    ack = {"id": 1, "pools": {"prefill": {"ready": 2}, "decode": {"ready": 2, "starting": 1}}}
    (tmp_path / "decisions" / "ack.json").write_text(json.dumps(ack))
    pools = await virtual.pools()
    assert pools[Role.DECODE] == PoolState(Role.DECODE, target=3, ready=2, starting=1)
    await virtual.scale({Role.DECODE: 1})
    decision = json.loads((tmp_path / "decisions" / "decision.json").read_text())
    assert decision["id"] == 2 and decision["targets"] == {"prefill": 2, "decode": 1}
    with pytest.raises(InvalidRequest, match="no aggregated pool"):
        await virtual.scale({Role.AGGREGATED: 1})
    with pytest.raises(InvalidRequest, match="etcd://"):
        VirtualConnector(VirtualConfig(virtual_store="http://x"))
