"""A client that runs on a test host (tests/netns.py) and does what the test asks: one JSON
request per line on stdin, one JSON answer per line on stdout.

  {"op": "http", "url": ..., "body": {...} | null, "timeout_s": 5}
      -> {"status": 200, "body": "...", "elapsed_s": 0.01} | {"error": "..."}
  {"op": "load", "address": "host:port", "timeout_s": 2}
      -> {"requests_finished_total": N} | {"error": "..."}     (a worker's GetLoadMetrics)

    python -m tests.netns_agent            (under `ip netns exec NS`, from the repository root)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc


def http(req: dict[str, Any]) -> dict[str, Any]:
    body = req.get("body")
    request = urllib.request.Request(
        req["url"],
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=req.get("timeout_s", 5)) as resp:
            status, text = resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return {"error": str(exc), "elapsed_s": time.monotonic() - start}
    return {"status": status, "body": text, "elapsed_s": time.monotonic() - start}


def load(req: dict[str, Any]) -> dict[str, Any]:
    with grpc.insecure_channel(req["address"]) as channel:
        stub = wpb_grpc.WorkerServiceStub(channel)
        try:
            resp = stub.GetLoadMetrics(wpb.GetLoadMetricsRequest(), timeout=req.get("timeout_s", 2))
        except grpc.RpcError as exc:
            return {"error": f"{exc.code().name}: {exc.details()}"}
    return {"requests_finished_total": resp.metrics.requests_finished_total}


OPS = {"http": http, "load": load}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            answer = OPS[req["op"]](req)
        except Exception as exc:  # report it; the test decides
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
