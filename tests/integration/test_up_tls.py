"""`kvmesh up --tls --api-key ...` end to end (frontend, 2 mocker workers, `up`'s
ScalingService as real processes): the official `openai` client over HTTPS and `tritonclient`
over TLS gRPC with the throwaway CA; plaintext, unknown CAs and bad or missing API keys
refused at every door; Scale only from the mesh's identities (the planner's succeeds)."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.tls import DevPki, write_dev_pki
from tests.integration.test_up_openai import MESSAGES, MODEL

pytestmark = pytest.mark.integration

KEYS = ("sk-kvmesh-first-key", "sk-kvmesh-second-key")


@dataclass
class TlsMesh:
    proc: subprocess.Popen[bytes]
    base: str
    grpc_address: str
    control: str
    pki: DevPki
    log: Path


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    tmp = tmp_path_factory.mktemp("up-tls")
    port, control = free_port(), free_port()
    log = tmp / "up.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KVMESH_API_KEY", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh", "up", "--log-level", "warning", "--tls",
             "--api-key", *KEYS, "--http-port", str(port), "--control-port", str(control),
             "--kserve-grpc-port", "0", "--workers", "2", "--speedup-ratio", "1000000"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 90
    while not (banner := re.search(r"CA +: (\S+)", log.read_text())) or "Press Ctrl-C" not in (
        log.read_text()
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"kvmesh up --tls did not come up:\n{log.read_text()}")
        time.sleep(0.2)
    ca = Path(banner.group(1))
    grpc_address = re.search(r"grpc (127\.0\.0\.1:\d+) \(inference", log.read_text())
    assert grpc_address is not None, log.read_text()
    pki = DevPki(ca.parent, ca, ca.parent / "ca-key.pem")
    yield TlsMesh(
        proc, f"https://127.0.0.1:{port}", grpc_address.group(1), f"127.0.0.1:{control}", pki, log
    )
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(30) == 0, log.read_text()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert not ca.parent.exists(), "the throwaway CA outlived kvmesh up"
    assert KEYS[0] not in log.read_text(), "an API key reached the log"


def _openai(mesh: TlsMesh, key: str) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(mesh.pki.ca)))
    return openai.OpenAI(base_url=mesh.base + "/v1", api_key=key, max_retries=0, http_client=http)


def test_openai_client_over_https_with_api_keys(mesh: TlsMesh) -> None:
    for key in KEYS:
        with _openai(mesh, key) as client:
            res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            assert res.usage is not None and res.usage.completion_tokens == 4
    with _openai(mesh, KEYS[0]) as client:
        stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
        with stream:
            assert len([c for c in stream if c.choices]) >= 1
    with _openai(mesh, "sk-not-a-key") as client, pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"


def _get(url: str, context: ssl.SSLContext | None, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_http_doors_refuse_missing_keys_plaintext_and_unknown_cas(
    mesh: TlsMesh, tmp_path: Path
) -> None:
    trusted = ssl.create_default_context(cafile=str(mesh.pki.ca))
    auth = {"Authorization": f"Bearer {KEYS[1]}"}
    for path in ("/v1/models", "/v2/models/" + MODEL, "/v2"):
        assert _get(mesh.base + path, trusted, {}) == 401, path
        assert _get(mesh.base + path, trusted, {"Authorization": "Bearer nope"}) == 401, path
        assert _get(mesh.base + path, trusted, auth) == 200, path
    for path in ("/health", "/live", "/metrics", "/v2/health/ready"):
        assert _get(mesh.base + path, trusted, {}) == 200, path  # probes stay open
    # A client that trusts another CA refuses the gateway's certificate ...
    other = write_dev_pki(tmp_path / "other", ["client"])
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(mesh.base + "/health", ssl.create_default_context(cafile=str(other.ca)), {})
    # ... and plaintext HTTP gets no answer from the HTTPS port.
    plain = mesh.base.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        _get(plain + "/health", None, {})


def _triton_inputs(prompt: str, max_tokens: int) -> list[grpcclient.InferInput]:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    limit = grpcclient.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    return [text, limit]


def test_tritonclient_over_tls_with_api_key(mesh: TlsMesh) -> None:
    client = grpcclient.InferenceServerClient(
        mesh.grpc_address, ssl=True, root_certificates=str(mesh.pki.ca)
    )
    try:
        assert client.is_server_ready()  # a probe: no key needed
        headers = {"authorization": f"Bearer {KEYS[0]}"}
        result = client.infer(MODEL, _triton_inputs("The quick brown fox", 5), headers=headers)
        assert result.as_numpy("num_output_tokens")[0] == 5
        for bad in ({}, {"authorization": "Bearer sk-wrong"}):
            with pytest.raises(InferenceServerException) as info:
                client.infer(MODEL, _triton_inputs("x", 2), headers=bad)
            assert info.value.status() == "StatusCode.UNAUTHENTICATED", info.value
    finally:
        client.close()
    plaintext = grpcclient.InferenceServerClient(mesh.grpc_address)
    try:
        with pytest.raises(InferenceServerException):
            plaintext.is_server_ready()
    finally:
        plaintext.close()


def _scale(channel: grpc.Channel, replicas: int) -> spb.ScaleResponse:
    stub = spb_grpc.ScalingServiceStub(channel)
    request = spb.ScaleRequest(role=cpb.WORKER_ROLE_AGGREGATED, replicas=replicas)
    response: spb.ScaleResponse = stub.Scale(request, timeout=10)
    return response


def _mtls(pki: DevPki, identity: str, address: str) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.key(identity).read_bytes(), pki.cert(identity).read_bytes()
    )
    return grpc.secure_channel(address, creds)


def test_scale_only_from_the_mesh_identities(mesh: TlsMesh, tmp_path: Path) -> None:
    # Same CA, but an identity that is not the mesh's: PERMISSION_DENIED.
    mesh.pki.issue("intruder")
    with _mtls(mesh.pki, "intruder", mesh.control) as channel, pytest.raises(grpc.RpcError) as info:
        _scale(channel, 0)
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # Another CA, or plaintext: no connection at all.
    other = write_dev_pki(tmp_path / "other", ["kvmesh-planner"])
    foreign = _mtls(other, "kvmesh-planner", mesh.control)
    with foreign as channel, pytest.raises(grpc.RpcError) as info:
        _scale(channel, 0)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(mesh.control) as channel, pytest.raises(grpc.RpcError) as info:
        _scale(channel, 0)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    # The planner's certificate: Scale succeeds (same size: nothing restarts).
    with _mtls(mesh.pki, "kvmesh-planner", mesh.control) as channel:
        assert _scale(channel, 2).target_replicas == 2
