"""`kvmesh frontend --gateway-processes 2` over real processes: two mocker workers (file
discovery) and one gateway group of two processes on one HTTP port and one KServe gRPC port.

  * connections are spread over both processes, and every request is answered;
  * `/metrics` from whichever process answers sums both (requests counted once each, in one
    exposition), with the workers shown once;
  * each process serves its router's bookings (RouterService) and follows the other's;
  * a process killed with SIGKILL is started again, and the port keeps answering meanwhile;
  * SIGTERM drains: a stream in flight finishes, and the group exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.router.v1 import router_service_pb2 as rpb
from kvmesh.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from kvmesh.runtime.ports import free_port
from tests.procs import Proc, frontend_ready, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny-llama"


class Group:
    def __init__(self, tiny_model: Path, logdir: Path) -> None:
        self.port = free_port()
        self.kserve_port = free_port()
        disc = ["--discovery", f"file://{logdir / 'registry'}"]
        mocker = ["--engine", "mocker", "--model", str(tiny_model), "--speedup-ratio", "2"]
        ports = ["--http-port", str(self.port), "--kserve-grpc-port", str(self.kserve_port)]
        self.workers = [
            Proc(
                f"w{i}",
                ["worker", *disc, *mocker, "--worker-id", f"w{i}"],
                logdir,
            )
            for i in range(2)
        ]
        self.gateway = Proc(
            "gateway",
            ["frontend", *disc, *ports, "--model", str(tiny_model), "--gateway-processes", "2"],
            logdir,
        )

    def children(self) -> dict[int, dict[str, str]]:
        """The group's processes by index: pid and flags, from their command lines."""
        assert self.gateway.popen is not None
        return group_children(self.gateway.popen.pid)

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The group's /metrics (from whichever process answers): samples by name."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return samples(r.read().decode())


def group_children(parent: int) -> dict[int, dict[str, str]]:
    """The processes of the gateway group `parent` started, by index: pid and flags, from
    their command lines."""
    found: dict[int, dict[str, str]] = {}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int(proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = proc.joinpath("cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        pid = proc.name
        if ppid != parent:
            continue
        flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
        if "gateway-group" in flags:
            flags["pid"] = pid
            if "--router-peers" in argv:  # a list flag: its values follow it
                flags["router-peers"] = argv[argv.index("--router-peers") + 1]
            found[int(flags["gateway-group"].split(",")[1])] = flags
    return found


def unix_get(path: Path, target: str) -> str:
    """The body of GET `target` from the HTTP server on Unix socket `path`."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        sock.sendall(f"GET {target} HTTP/1.0\r\nHost: gateway\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") or head.startswith(b"HTTP/1.0 200"), head
    return body.decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def router_peers(port: int) -> dict[str, float]:
    """A gateway's `kvmesh_router_peers` by state (summed over a group's processes)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        found = samples(r.read().decode()).get("kvmesh_router_peers", [])
    return {labels["state"]: value for labels, value in found}


def chat(port: int, max_tokens: int = 4, stream: bool = False) -> urllib.request.Request:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Connection": "close"},
    )


def completed(port: int) -> bool:
    with urllib.request.urlopen(chat(port), timeout=10) as r:
        return json.loads(r.read())["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture(scope="module")
def group(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    g = Group(tiny_model, tmp_path_factory.mktemp("gateway-group"))
    try:
        for w in g.workers:
            w.start()
        g.gateway.start()
        poll(lambda: frontend_ready(g.port), 60, "the gateway group")
        poll(lambda: len(g.children()) == 2, 30, "both gateway processes")
        # Every process has joined both workers (scrapes land on either process).
        both = [({"model": MODEL, "role": "aggregated"}, 2.0)]
        poll(
            lambda: all(g.metrics().get("kvmesh_router_workers") == both for _ in range(8)),
            30,
            "both workers in every process",
        )
        yield g
    except BaseException:
        print("\n".join(p.tail() for p in [g.gateway, *g.workers]))
        raise
    finally:
        g.gateway.stop()
        for w in g.workers:
            w.stop()


def test_both_processes_serve_and_metrics_sum_them(group: Group) -> None:
    before = group.metrics()
    done = sum(v for _, v in before.get("kvmesh_frontend_requests_total", []))
    for _ in range(40):  # a new connection each: the kernel picks a process for each
        assert completed(group.port)
    for _ in range(4):  # whichever process answers the scrape, the sums are the group's
        m = group.metrics()
        assert m["kvmesh_frontend_gateway_processes"] == [({}, 2.0)]
        assert sum(v for _, v in m["kvmesh_frontend_requests_total"]) == done + 40
        ttft = dict(
            (lbl["le"], v) for lbl, v in m["kvmesh_frontend_time_to_first_token_seconds_bucket"]
        )
        assert ttft["+Inf"] >= 40
        # The workers, which both processes see, once (not summed to 4).
        assert m["kvmesh_router_workers"] == [({"model": MODEL, "role": "aggregated"}, 2.0)]
    # Both took connections: each one's own requests counted (its router's decisions).
    own = []
    for flags in group.children().values():
        directory, index, _ = flags["gateway-group"].split(",")
        sock = Path(directory) / f"metrics-{index}.sock"
        out = unix_get(sock, "/metrics")
        own.append(
            sum(
                s.value
                for f in text_string_to_metric_families(out)
                for s in f.samples
                if s.name == "kvmesh_frontend_requests_total"
            )
        )
    assert len(own) == 2 and all(n > 0 for n in own) and sum(own) == done + 40


def test_the_kserve_grpc_port_is_shared_too(group: Group) -> None:
    for _ in range(6):  # a new connection each (tritonclient, the real KServe client)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{group.kserve_port}")
        try:
            assert client.is_server_live() and client.is_server_ready()
        finally:
            client.close()


def test_each_process_shares_its_bookings_with_the_other(group: Group) -> None:
    children = group.children()
    for index, flags in children.items():
        assert flags["router-peers"] == f"127.0.0.1:{children[1 - index]['router-sync-port']}"

    async def a_booking(port: str) -> rpb.SubscribeLoadEventsResponse:
        """The first booking change process `port` streams while requests come in."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpb_grpc.RouterServiceStub(channel)
            call = stub.SubscribeLoadEventBatches(
                rpb.SubscribeLoadEventBatchesRequest(subscriber_id="test")
            )
            await call.wait_for_connection()
            sender = asyncio.ensure_future(asyncio.to_thread(send_until, call))
            try:
                batch = await asyncio.wait_for(anext(aiter(call)), 30)
            finally:
                call.cancel()
                await sender
            return batch.events[0]

    def send_until(call: object) -> None:
        for _ in range(200):  # new connections: some reach the process subscribed to
            if call.done():  # type: ignore[attr-defined]
                return
            completed(group.port)

    for flags in children.values():  # each serves its router's bookings on its sync port
        event = asyncio.run(a_booking(flags["router-sync-port"]))
        assert event.worker_id in ("w0", "w1") and event.request_id


def test_a_killed_process_is_started_again(group: Group) -> None:
    children = group.children()
    victim = children[0]["pid"]
    os.kill(int(victim), signal.SIGKILL)
    killed = time.monotonic()
    answered = reset = 0
    while time.monotonic() < killed + 30:  # the survivor keeps the port answering meanwhile
        try:
            assert completed(group.port)
            answered += 1
        except ConnectionResetError:
            # Connections the killed process had not accepted yet are reset (unless the host
            # sets net.ipv4.tcp_migrate_req=1); nothing after it has gone.
            assert time.monotonic() - killed < 1.0
            reset += 1
        now = group.children()
        if len(now) == 2 and now[0]["pid"] != victim and answered >= 20:
            break
        time.sleep(0.02)
    assert reset <= 4 and answered >= 20
    poll(
        lambda: group.metrics()["kvmesh_frontend_gateway_processes"] == [({}, 2.0)],
        30,
        "the restarted process's metrics",
    )
    assert all(completed(group.port) for _ in range(10))


def test_sigterm_drains_streams_in_flight(group: Group) -> None:
    assert group.gateway.popen is not None
    req = chat(group.port, max_tokens=400, stream=True)
    with urllib.request.urlopen(req, timeout=60) as r:
        first = r.readline()
        assert first.startswith(b"data: ")
        group.gateway.popen.send_signal(signal.SIGTERM)
        rest = r.read().decode()
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]]
    assert "length" in finals
    assert group.gateway.popen.wait(30) == 0


def two_process_gateway(tiny_model: Path, tmp_path: Path, port: int) -> Proc:
    """A started gateway group of two processes on `port`, with no workers."""
    disc = ["--discovery", f"file://{tmp_path / 'registry'}", "--model", str(tiny_model)]
    gateway = Proc(
        "gateway",
        ["frontend", *disc, "--gateway-processes", "2", "--http-port", str(port)],
        tmp_path,
    )
    gateway.start()
    return gateway


def test_a_process_that_cannot_start_stops_the_group(tiny_model: Path, tmp_path: Path) -> None:
    """A port another program holds is not retried forever: the group exits with an error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        gateway = two_process_gateway(tiny_model, tmp_path, port)
        assert gateway.popen is not None
        try:
            assert gateway.popen.wait(60) != 0
        finally:
            gateway.kill()
    assert "while starting" in gateway.log.read_text()


def test_router_sync_needs_an_in_process_kv_router(tmp_path: Path) -> None:
    flags = ["--router-mode", "round-robin", "--router-sync-port", "0"]
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh", "frontend", "--discovery", f"file://{tmp_path}", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--router-sync-port serves an in-process KV router" in out.stderr


def test_the_processes_end_with_their_parent(tiny_model: Path, tmp_path: Path) -> None:
    """A parent killed with SIGKILL leaves no gateway serving on (PR_SET_PDEATHSIG)."""
    gateway = two_process_gateway(tiny_model, tmp_path, free_port())
    assert gateway.popen is not None
    try:
        parent = gateway.popen.pid
        poll(lambda: len(group_children(parent)) == 2, 60, "both gateway processes")
        pids = [int(flags["pid"]) for flags in group_children(parent).values()]
        gateway.kill()

        def gone() -> bool:
            return not any(Path(f"/proc/{pid}").exists() for pid in pids)

        poll(gone, 30, "the gateway processes to exit")
    finally:
        gateway.kill()


def test_gateways_on_their_own_find_each_other_in_discovery(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two gateways with --router-sync-port and --router-peers-discovery (as on two hosts) follow
    each other's bookings; one that stops is no longer followed."""
    disc = ["--discovery", f"file://{tmp_path / 'registry'}", "--model", str(tiny_model)]
    worker = Proc("w0", ["worker", *disc, "--engine", "mocker", "--worker-id", "w0"], tmp_path)
    ports = [free_port(), free_port()]
    sync = ["--router-sync-port", "0", "--router-peers-discovery"]
    gateways = [
        Proc(f"gw{i}", ["frontend", *disc, *sync, "--http-port", str(port)], tmp_path)
        for i, port in enumerate(ports)
    ]

    try:
        for p in (worker, *gateways):
            p.start()
        for port in ports:
            poll(lambda port=port: frontend_ready(port), 60, "a gateway")
        for port in ports:
            poll(
                lambda port=port: router_peers(port) == {"followed": 1.0, "connected": 1.0},
                30,
                "each gateway following the other",
            )
        gateways[1].stop()  # leaves discovery as it starts draining
        poll(
            lambda: router_peers(ports[0]) == {"followed": 0.0, "connected": 0.0},
            30,
            "the peer gone",
        )
    except BaseException:
        print("\n".join(p.tail() for p in (*gateways, worker)))
        raise
    finally:
        for p in (*gateways, worker):
            p.stop()


def test_a_groups_processes_register_in_discovery_with_it(tiny_model: Path, tmp_path: Path) -> None:
    """With --router-peers-discovery a group's processes are found in discovery like any
    gateway (a gateway on another host follows each of them) and find each other there (no
    loopback peers besides: a sibling is followed once, not under two addresses)."""
    disc = ["--discovery", f"file://{tmp_path / 'registry'}", "--model", str(tiny_model)]
    worker = Proc("w0", ["worker", *disc, "--engine", "mocker", "--worker-id", "w0"], tmp_path)
    group_port, single_port = free_port(), free_port()

    def gateway(name: str, port: int, *flags: str) -> Proc:
        argv = ["frontend", *disc, "--router-peers-discovery", "--http-port", str(port), *flags]
        return Proc(name, argv, tmp_path)

    group = gateway("group", group_port, "--gateway-processes", "2")
    single = gateway("single", single_port, "--router-sync-port", "0")

    try:
        for p in (worker, group, single):
            p.start()
        for port in (group_port, single_port):
            poll(lambda port=port: frontend_ready(port), 60, "a gateway")
        assert group.popen is not None
        children = group_children(group.popen.pid)
        assert all("router-peers" not in flags for flags in children.values())
        # the single gateway follows both processes; each process its sibling and the single
        # one (the group's /metrics sums its processes: 2 x 2)
        poll(lambda: router_peers(single_port) == {"followed": 2.0, "connected": 2.0}, 30, "single")
        poll(lambda: router_peers(group_port) == {"followed": 4.0, "connected": 4.0}, 30, "group")
        single.stop()
        poll(
            lambda: router_peers(group_port) == {"followed": 2.0, "connected": 2.0}, 30, "siblings"
        )
    except BaseException:
        print("\n".join(p.tail() for p in (group, single, worker)))
        raise
    finally:
        for p in (group, single, worker):
            p.stop()
