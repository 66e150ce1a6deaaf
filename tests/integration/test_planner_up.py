"""`kvmesh up`'s ScalingService under the planner's use: bad input refused whole with clear codes,
a concurrent Scale ABORTED, scale-down draining the least cached worker with no client error,
and (slow) `kvmesh up --planner sla` following a load ramp up and down."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.wire import device_cached_blocks
from tests.integration.test_up_openai import MODEL, Mesh, start_mesh, stop_mesh
from tests.procs import poll

pytestmark = pytest.mark.integration

AGG = cpb.WORKER_ROLE_AGGREGATED


class Control:
    """The mesh's ScalingService and its file registry."""

    def __init__(self, port: int, registry: Path) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = spb_grpc.ScalingServiceStub(self.channel)
        self.registry = registry

    def pool(self) -> spb.PoolStatus:
        return self.stub.ListPools(spb.ListPoolsRequest()).pools[0]

    def settled(self, ready: int, timeout_s: float = 60.0) -> spb.PoolStatus:
        def done() -> spb.PoolStatus | None:
            p = self.pool()
            return p if (p.ready_replicas, p.starting_replicas, p.draining_replicas) == (
                ready, 0, 0) else None  # fmt: skip

        return poll(done, timeout_s, f"{ready} ready workers, none starting or draining")

    def workers(self) -> dict[str, str]:
        """Registered worker id -> address."""
        out = {}
        for path in self.registry.glob("worker.*.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            out[data["instance_id"]] = data["address"]
        return out


class Streams:
    """Client threads streaming chat completions in a loop until stopped; every failure is
    kept (the tests expect none)."""

    def __init__(self, base: str, prompt: str, max_tokens: int) -> None:
        self.base, self.prompt, self.max_tokens = base, prompt, max_tokens
        self.errors: list[BaseException] = []
        self.done: list[int] = []
        """Content chunks of each finished stream."""
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def add(self) -> None:
        t = threading.Thread(target=self._loop)
        t.start()
        self.threads.append(t)

    def _loop(self) -> None:
        c = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0)
        try:
            while not self.stop.is_set():
                stream = c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": self.prompt}],
                    max_tokens=self.max_tokens,
                    stream=True,
                )
                self.done.append(
                    sum(1 for ch in stream if ch.choices and ch.choices[0].delta.content)
                )
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            c.close()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@pytest.fixture
def mesh3(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Mesh, Control]]:
    control = free_port()
    registry = tmp_path / "registry"
    mesh = start_mesh(
        tmp_path,
        "--workers", "3", "--control-port", str(control), "--max-workers", "6",
        "--max-total-workers", "4", "--discovery", f"file://{registry}",
        "--speedup-ratio", "50",
    )  # fmt: skip
    ctl = Control(control, registry)
    try:
        ctl.settled(3)
        yield mesh, ctl
    finally:
        ctl.channel.close()
        assert stop_mesh(mesh) == 0, mesh.log.read_text()


def _code(fn: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()  # type: ignore[operator]
    return info.value.code()


def test_scale_refuses_bad_input_whole(mesh3: tuple[Mesh, Control]) -> None:
    _, ctl = mesh3
    before = ctl.pool()
    bad = [
        (spb.ScaleRequest(role=cpb.WORKER_ROLE_PREFILL, replicas=1), "no prefill pool"),
        (spb.ScaleRequest(role=cpb.WORKER_ROLE_UNSPECIFIED, replicas=1), "role must be"),
        (spb.ScaleRequest(role=AGG, replicas=7), "--max-workers"),
        (spb.ScaleRequest(role=AGG, replicas=5), "--max-total-workers 4"),
    ]
    for request, why in bad:
        with pytest.raises(grpc.RpcError) as info:
            ctl.stub.Scale(request)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert why in (info.value.details() or ""), info.value.details()
    # A client that sends replicas as a signed int (-1): on the wire it is the uint32 2**32-1.
    raw = ctl.channel.unary_unary(
        "/kvmesh.api.scaling.v1.ScalingService/Scale",
        request_serializer=lambda b: b,
        response_deserializer=spb.ScaleResponse.FromString,
    )
    minus_one = bytes([0x10, AGG, 0x18]) + b"\xff" * 9 + b"\x01"  # role, replicas=-1 (int32)
    assert _code(lambda: raw(minus_one)) is grpc.StatusCode.INVALID_ARGUMENT
    after = ctl.pool()
    assert (after.target_replicas, after.ready_replicas) == (before.target_replicas, 3)
    # --max-total-workers 4 is the budget: 4 is fine
    assert ctl.stub.Scale(spb.ScaleRequest(role=AGG, replicas=4)).previous_replicas == 3


def test_concurrent_scale_is_aborted_and_changes_nothing(mesh3: tuple[Mesh, Control]) -> None:
    _, ctl = mesh3
    workers = poll(lambda: ctl.workers() if len(ctl.workers()) == 3 else None, 30, "3 workers")
    # Freeze one worker: the scale-down reads every worker's cache size first (up to 1 s each),
    # so it is still being applied while the second call comes.
    frozen = _worker_pid(next(iter(workers)))
    os.kill(frozen, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ctl.stub.Scale, spb.ScaleRequest(role=AGG, replicas=2))
            time.sleep(0.3)
            second = pool.submit(ctl.stub.Scale, spb.ScaleRequest(role=AGG, replicas=1))
            with pytest.raises(grpc.RpcError) as info:
                second.result()
            assert info.value.code() is grpc.StatusCode.ABORTED
            assert "still being applied" in (info.value.details() or "")
            assert first.result().target_replicas == 2
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert ctl.pool().target_replicas == 2  # the aborted call left no trace
    ctl.settled(2)


def _worker_pid(worker_id: str) -> int:
    """The pid of the worker process `worker_id` (a child of kvmesh up)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv and f"--worker-id={worker_id}".encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no process for worker {worker_id}")


def _cached_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = wpb_grpc.WorkerServiceStub(ch).GetLoadMetrics(wpb.GetLoadMetricsRequest())
        return device_cached_blocks(reply.metrics)


def test_scale_down_drains_the_least_cached_worker_without_client_errors(
    mesh3: tuple[Mesh, Control],
) -> None:
    mesh, ctl = mesh3
    client = mesh.client()
    prefix = "the quick brown fox jumps over the lazy dog " * 20
    for i in range(3):  # a long shared prefix: the KV router keeps it on one worker
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{prefix} {i}"}], max_tokens=2
        )
    workers = ctl.workers()
    cached = {w: _cached_blocks(a) for w, a in workers.items()}
    hot = max(cached, key=lambda w: cached[w])
    assert cached[hot] > max(v for w, v in cached.items() if w != hot)
    # Streams in flight while the pool shrinks from 3 to 1: every one must finish.
    streams = Streams(mesh.base, "count to twenty", 40)
    for _ in range(6):
        streams.add()
    try:
        time.sleep(1.0)
        ctl.stub.Scale(spb.ScaleRequest(role=AGG, replicas=1, reason="test"))
        ctl.settled(1)
        time.sleep(0.5)
    finally:
        streams.finish()
    assert not streams.errors, streams.errors
    assert len(streams.done) > 12
    assert list(ctl.workers()) == [hot]  # the worker holding the cache stayed


@pytest.mark.slow
def test_up_planner_follows_a_load_ramp_both_ways(tiny_model: Path, tmp_path: Path) -> None:
    """`kvmesh up --planner sla`: load ramps up (the pool grows), then stops (it shrinks back),
    and no request fails, scale-downs included."""
    control = free_port()
    mesh = start_mesh(
        tmp_path,
        "--workers", "1", "--control-port", str(control), "--planner", "sla",
        "--speedup-ratio", "1", "--ttft-slo-ms", "300", "--itl-slo-ms", "10",
        "--adjustment-interval-s", "1", "--worker-startup-s", "2", "--scale-down-delay-s", "3",
        "--min-workers", "1", "--max-workers", "3", "--drain-timeout-s", "20",
    )  # fmt: skip
    ctl = Control(control, tmp_path)
    streams = Streams(mesh.base, "tell me a story " * 20, 64)
    sizes: list[int] = []
    try:
        ctl.settled(1)
        for _ in range(24):  # ramp up: more and more concurrent streams
            streams.add()
            time.sleep(0.25)
            sizes.append(ctl.pool().target_replicas)
        grown = poll(
            lambda: ctl.pool().target_replicas if ctl.pool().target_replicas >= 2 else None,
            30,
            "the planner to grow the pool",
        )
        streams.finish()  # the load stops: the pool must shrink back
        poll(lambda: ctl.pool().target_replicas == 1 or None, 60, "the pool to shrink back")
        ctl.settled(1)
    finally:
        streams.finish()
        ctl.channel.close()
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
    assert grown >= 2, sizes
    assert not streams.errors, streams.errors
    assert len(streams.done) > 24
    log = mesh.log.read_text()
    assert "planner: aggregated pool 1 -> " in log or "scaling aggregated to" in log, log[-3000:]
