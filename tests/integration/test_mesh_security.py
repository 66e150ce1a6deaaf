"""Mesh links over real gRPC: mTLS (plaintext and foreign certificates refused, identities
checked on every RPC), the shared token of meshes without TLS, certificate rotation under load
with zero failed requests, and start-up errors for bad certificate files."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.session import WorkerSession
from kvmesh.runtime.grpcutil import (
    MESH_TOKEN_HEADER,
    MeshSecurity,
    insecure_channel,
    mesh_channel,
    mesh_server,
)
from kvmesh.runtime.tls import MESH_TOKEN_ENV, DevPki, ReloadingTls, TlsConfig, write_dev_pki
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker
from tests.integration.test_worker_contract import gen_request, make_engine

pytestmark = pytest.mark.integration

MESH = ["kvmesh-frontend", "kvmesh-worker", "kvmesh-up"]
SCALING = spb.DESCRIPTOR.services_by_name["ScalingService"].full_name


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), [*MESH, "outsider"])


def security(pki: DevPki, identity: str, check_s: float = 1.0) -> MeshSecurity:
    """`identity`'s mesh security; its servers accept MESH."""
    return MeshSecurity(ReloadingTls(pki.files(identity), check_s=check_s), identities=MESH)


@pytest.fixture
async def worker(pki: DevPki, tiny_model: Path) -> AsyncIterator[Worker]:
    w = Worker(WorkerConfig(), make_engine(tiny_model), security(pki, "kvmesh-worker"))
    await w.start()
    yield w
    await w.stop()


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_mtls_refuses_plaintext_and_certificates_of_another_ca(
    worker: Worker, pki: DevPki, tmp_path: Path
) -> None:
    plain = insecure_channel(worker.address)
    foreign_pki = write_dev_pki(tmp_path, ["kvmesh-frontend"])  # same identity, another CA
    foreign = mesh_channel(worker.address, MeshSecurity.load(foreign_pki.config("kvmesh-frontend")))
    server_only = grpc.ssl_channel_credentials(pki.ca.read_bytes())  # TLS, no client certificate
    certless = grpc.aio.secure_channel(worker.address, server_only)
    try:
        for channel in (plain, foreign, certless):
            stub = wpb_grpc.WorkerServiceStub(channel)
            assert await _code(stub.GetModelCard(wpb.GetModelCardRequest(), timeout=5)) is (
                grpc.StatusCode.UNAVAILABLE
            )
            health = health_pb2_grpc.HealthStub(channel)
            assert await _code(health.Check(health_pb2.HealthCheckRequest(), timeout=5)) is (
                grpc.StatusCode.UNAVAILABLE
            )
    finally:
        for channel in (plain, foreign, certless):
            await channel.close()


async def test_identities_outside_the_mesh_get_permission_denied(
    worker: Worker, pki: DevPki
) -> None:
    outsider = mesh_channel(worker.address, MeshSecurity.load(pki.config("outsider")))
    frontend = mesh_channel(worker.address, MeshSecurity.load(pki.config("kvmesh-frontend")))
    try:
        stub = wpb_grpc.WorkerServiceStub(outsider)
        for call in (
            stub.Drain(wpb.DrainRequest(), timeout=5),
            stub.ClearKvCache(wpb.ClearKvCacheRequest(), timeout=5),
            stub.ReleaseKvBlocks(wpb.ReleaseKvBlocksRequest(transfer_id="t"), timeout=5),
            stub.GetModelCard(wpb.GetModelCardRequest(), timeout=5),
            stub.Generate(gen_request([1, 2, 3]), timeout=5).read(),
        ):
            try:
                await call
                raise AssertionError("an outsider's call succeeded")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.PERMISSION_DENIED
                assert "outsider" in (exc.details() or "")
        assert not worker.servicer.draining
        ok = wpb_grpc.WorkerServiceStub(frontend)
        card = await ok.GetModelCard(wpb.GetModelCardRequest(), timeout=5)
        assert card.card.served_model_name == "tiny"
        msgs = [m async for m in ok.Generate(gen_request([1, 2, 3], max_tokens=3), timeout=5)]
        assert sum(len(m.token_ids) for m in msgs) == 3
        await ok.Drain(wpb.DrainRequest(timeout_ms=100), timeout=5)
        assert worker.servicer.draining
    finally:
        await outsider.close()
        await frontend.close()


class _Scaling(spb_grpc.ScalingServiceServicer):
    """Answers Scale with the caller's certificate digest in the trailing metadata."""

    async def Scale(
        self, request: spb.ScaleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> spb.ScaleResponse:
        pem = b"".join(context.auth_context().get("x509_pem_cert", ()))
        context.set_trailing_metadata((("peer-cert", hashlib.sha256(pem).hexdigest()),))
        return spb.ScaleResponse(target_replicas=request.replicas)


async def test_shared_token_without_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MESH_TOKEN_ENV, "a-shared-mesh-token-of-32-chars!")
    mesh = MeshSecurity.load(TlsConfig())
    server = mesh_server("127.0.0.1", 0, mesh)
    server.add(spb_grpc.add_ScalingServiceServicer_to_server, _Scaling(), SCALING)
    await server.start()
    plain = insecure_channel(server.address)
    ours = mesh_channel(server.address, mesh)
    try:
        stub = spb_grpc.ScalingServiceStub(plain)
        request = spb.ScaleRequest(replicas=3)
        assert await _code(stub.Scale(request)) is grpc.StatusCode.UNAUTHENTICATED
        wrong = ((MESH_TOKEN_HEADER, "b-shared-mesh-token-of-32-chars!"),)
        assert await _code(stub.Scale(request, metadata=wrong)) is grpc.StatusCode.UNAUTHENTICATED
        # Probes need no token.
        health = health_pb2_grpc.HealthStub(plain)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == 1
        resp = await spb_grpc.ScalingServiceStub(ours).Scale(request)
        assert resp.target_replicas == 3
    finally:
        await plain.close()
        await ours.close()
        await server.stop(0)


def _served_certificate(address: str, pki: DevPki, identity: str) -> bytes:
    """The DER certificate a TLS server presents to a new connection (with `identity`'s client
    certificate, as the mesh requires)."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(pki.cert(identity), pki.key(identity))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port))) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as sock,
    ):
        der = sock.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


async def test_rotation_under_load_fails_no_request(pki: DevPki, tiny_model: Path) -> None:
    """Certificates of server and client replaced on disk while requests flow on a shared
    connection and on new connections: no request fails, new handshakes present the new
    server certificate, new calls present the new client certificate."""
    worker_sec = security(pki, "kvmesh-worker", check_s=0.05)
    w = Worker(WorkerConfig(), make_engine(tiny_model), worker_sec)
    await w.start()
    client = security(pki, "kvmesh-frontend", check_s=0.05)
    shared = mesh_channel(w.address, client)
    session = WorkerSession(wpb_grpc.WorkerServiceStub(shared), w.address)
    echo = mesh_server("127.0.0.1", 0, worker_sec)
    echo.add(spb_grpc.add_ScalingServiceServicer_to_server, _Scaling(), SCALING)
    await echo.start()
    echo_channel = mesh_channel(echo.address, client)
    ok = failed = 0
    errors: list[str] = []
    stop = asyncio.Event()

    async def shared_load(i: int) -> None:
        nonlocal ok, failed
        n = 0
        while not stop.is_set():
            n += 1
            req = gen_request([1, 2, 3, i, n % 50], max_tokens=4)
            req.request_id = f"s{i}-{n}"
            try:
                outs = [o async for o in session.generate(req)]
                assert outs[-1].finish_reason
                ok += 1
            except Exception as exc:
                failed += 1
                errors.append(repr(exc))
                await asyncio.sleep(0.05)  # a failure before any await must not spin the loop

    async def fresh_connections() -> None:
        nonlocal ok, failed
        while not stop.is_set():
            channel = mesh_channel(w.address, client)
            try:
                stub = wpb_grpc.WorkerServiceStub(channel)
                msgs = [m async for m in stub.Generate(gen_request([4, 5, 6], max_tokens=2))]
                assert msgs[-1].finish_reason
                ok += 1
            except Exception as exc:
                failed += 1
                errors.append(repr(exc))
            finally:
                await channel.close()

    async def client_cert_seen() -> str:
        call = spb_grpc.ScalingServiceStub(echo_channel).Scale(spb.ScaleRequest(replicas=1))
        await call
        return str(dict(await call.trailing_metadata())["peer-cert"])

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    try:
        assert await client_cert_seen() == digest(pki.cert("kvmesh-frontend"))
        tasks = [asyncio.create_task(shared_load(i)) for i in range(8)]
        tasks.append(asyncio.create_task(fresh_connections()))
        first_server = _served_certificate(w.address, pki, "kvmesh-frontend")
        for _ in range(4):
            await asyncio.sleep(0.3)
            pki.issue("kvmesh-worker")
            pki.issue("kvmesh-frontend")
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        assert failed == 0, errors[:5]
        assert ok > 50, ok
        assert worker_sec.tls is not None and worker_sec.tls.generation >= 1
        # New handshakes get the newest server certificate...
        served = await asyncio.to_thread(_served_certificate, w.address, pki, "kvmesh-frontend")
        assert served == _der(pki.cert("kvmesh-worker")) != first_server
        # ...and new calls on a channel opened before present the newest client certificate.
        assert await client_cert_seen() == digest(pki.cert("kvmesh-frontend"))
    finally:
        stop.set()
        await session.close()
        await shared.close()
        await echo_channel.close()
        await echo.stop(0)
        await w.stop()


def test_bad_certificates_stop_a_process_at_start_up(pki: DevPki, tmp_path: Path) -> None:
    """`kvmesh worker` with a key that is not its certificate's exits at once with a message
    that names the flag and the file, before it serves anything."""
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "worker",
            "--tls-cert",
            str(pki.cert("kvmesh-worker")),
            "--tls-key",
            str(pki.key("outsider")),
            "--tls-ca",
            str(pki.ca),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "kvmesh worker: error: --tls-key" in proc.stderr
    assert "outsider-key.pem does not match the certificate in --tls-cert" in proc.stderr
    assert time.monotonic() - start < 30


async def test_servers_dialed_by_ip_with_a_shared_server_name(tmp_path: Path) -> None:
    """--tls-server-name: servers whose certificates name only `kvmesh-mesh` (not the address
    clients dial, e.g. a pod IP) are verified against that name; the image's healthcheck
    reaches them over mTLS (grpcs://)."""
    pki = write_dev_pki(tmp_path, [], hosts=["kvmesh-mesh"])
    for identity in ("kvmesh-up", "kvmesh-planner"):
        pki.issue(identity, hosts=["kvmesh-mesh"])
    up = MeshSecurity.load(pki.config("kvmesh-up", ["kvmesh-planner"]))
    server = mesh_server("127.0.0.1", 0, up)
    await server.start()
    named = TlsConfig(**{**vars(pki.config("kvmesh-planner")), "tls_server_name": "kvmesh-mesh"})
    good = mesh_channel(server.address, MeshSecurity.load(named))
    unnamed = mesh_channel(server.address, MeshSecurity.load(pki.config("kvmesh-planner")))
    try:
        request = health_pb2.HealthCheckRequest()
        assert await _code(health_pb2_grpc.HealthStub(good).Check(request, timeout=5)) is (
            grpc.StatusCode.OK
        )
        # Without the name, 127.0.0.1 is not in the certificate: the client refuses it.
        assert await _code(health_pb2_grpc.HealthStub(unnamed).Check(request, timeout=5)) is (
            grpc.StatusCode.UNAVAILABLE
        )
        check = Path(__file__).parents[2] / "deploy" / "container" / "healthcheck.py"
        env = {
            "KVMESH_TLS_CERT": str(pki.cert("kvmesh-planner")),
            "KVMESH_TLS_KEY": str(pki.key("kvmesh-planner")),
            "KVMESH_TLS_CA": str(pki.ca),
        }
        target = f"grpcs://{server.address}"
        for extra, code in (({}, 1), ({"KVMESH_TLS_SERVER_NAME": "kvmesh-mesh"}, 0)):
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, str(check), target],
                env={**os.environ, **env, **extra},
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.returncode == code, done.stdout
    finally:
        await good.close()
        await unnamed.close()
        await server.stop(0)
