#!/usr/bin/env python3
"""The container image's HEALTHCHECK (`docker run`, podman): exit 0 when healthy, 1 otherwise.

What it checks comes from $KVMESH_HEALTHCHECK (or the first argument):
  http://HOST:PORT/PATH   an HTTP GET that must answer 200 (the frontend's /live or /health)
  grpc://HOST:PORT[/SVC]  grpc.health.v1 Check that must answer SERVING (a worker or router;
                          SVC: a service name, default "" = the whole server)
  grpcs://HOST:PORT[/SVC] the same over mTLS, presenting $KVMESH_TLS_CERT / $KVMESH_TLS_KEY and
                          trusting $KVMESH_TLS_CA (a mesh server with --tls-cert); the
                          server's certificate must name $KVMESH_TLS_SERVER_NAME if set
Kubernetes checks the same endpoints with native probes, except mesh servers under mTLS
(deploy/kubernetes/components/tls), which its gRPC probes cannot call: they exec this.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

TIMEOUT_S = 4.0


def check_http(url: str) -> str | None:
    """None when GET `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)


def check_grpc(target: str, service: str, tls: bool = False) -> str | None:
    """None when grpc.health.v1 Check(service) on `target` answers SERVING, else why not;
    `tls`: over mTLS with the $KVMESH_TLS_* files."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls:
        try:
            files = [
                Path(os.environ[f"KVMESH_TLS_{name}"]).read_bytes()
                for name in ("CA", "KEY", "CERT")
            ]
        except (KeyError, OSError) as exc:
            return f"grpcs:// needs $KVMESH_TLS_CA, $KVMESH_TLS_KEY, $KVMESH_TLS_CERT: {exc}"
        name = os.environ.get("KVMESH_TLS_SERVER_NAME", "")
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(*files), options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return None


def main(argv: list[str]) -> int:
    spec = argv[1] if len(argv) > 1 else os.environ.get("KVMESH_HEALTHCHECK", "")
    url = urllib.parse.urlsplit(spec)
    if url.scheme in ("http", "https"):
        problem = check_http(spec)
    elif url.scheme in ("grpc", "grpcs") and url.hostname and url.port:
        target = f"{url.hostname}:{url.port}"
        problem = check_grpc(target, url.path.lstrip("/"), tls=url.scheme == "grpcs")
    else:
        print(
            f"kvmesh-healthcheck: unsupported target {spec!r} (http://..., grpc://h:p or grpcs://h:p)"
        )
        return 1
    if problem is not None:
        print(f"kvmesh-healthcheck: {spec}: {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
