"""kvmesh across hosts of a real (virtual) network: five network namespaces on one bridge
(tests/netns.py), each with its own address on 10.231.7.0/24:

    etcd   10.231.7.2   Debian's etcd-server
    fe     10.231.7.3   `kvmesh frontend` (in-process router, round-robin)
    w1/w2  10.231.7.4/5 `kvmesh worker --engine mocker --host 0.0.0.0 --advertise-host <own IP>`
    cl     10.231.7.6   the client (tests/netns_agent.py): OpenAI requests to the frontend,
                        GetLoadMetrics to the workers (which one served a request)

Every process talks to the others over the veth links, never over loopback. Requests flow
client -> frontend -> worker; then w1's link goes down at the bridge (cut off, still running):
its etcd lease expires within the TTL (+ etcd's expiry slack), the frontend drops it, and
every request goes to w2 at the first attempt. When the link comes back, w1 registers again
and serves requests again.

Skipped, saying why, where namespaces cannot be made (no root / CAP_NET_ADMIN) or etcd is
missing. Every namespace is deleted on every path (fixture finally; stale ones of dead test
processes at the next run).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netns
from tests.etcd_server import ETCD_BINARY, MISSING_REASON, EtcdServer
from tests.procs import Proc, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 2
"""Worker lease TTL (s); etcd deletes an expired lease's keys within about 0.5 s after it."""
EXPIRY_SLACK_S = 1.0
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/kvmesh"


class Agent:
    """tests/netns_agent.py running on a test host."""

    def __init__(self, wrap: list[str], log: Path) -> None:
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "tests.netns_agent"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the agent died: {self.proc.poll()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class Cluster:
    def __init__(self, lab: netns.NetLab, tiny_model: Path, logdir: Path) -> None:
        self.lab = lab
        self.ips = {h: lab.add_host(h) for h in ("etcd", "fe", "w1", "w2", "cl")}
        self.agent = Agent(lab.wrap("cl"), logdir / "agent.log")
        self.etcd = EtcdServer(
            logdir / "etcd",
            host=self.ips["etcd"],
            wrap=lab.wrap("etcd"),
            healthy=lambda: self.http_ok(f"http://{self.etcd.endpoint}/health", 1),
        )
        self.etcd_url = f"etcd://{self.ips['etcd']}:{self.etcd.client_port}?ttl={TTL}"
        self.http = f"http://{self.ips['fe']}:8000"
        self.workers: dict[str, Proc] = {}
        for w in ("w1", "w2"):
            self.workers[w] = Proc(
                w,
                ["worker", "--engine", "mocker", "--model", str(tiny_model),
                 "--host", "0.0.0.0", "--port", "9000", "--advertise-host", self.ips[w],
                 "--worker-id", w, "--discovery", self.etcd_url, "--speedup-ratio", "1000000"],
                logdir,
                wrap=lab.wrap(w),
            )  # fmt: skip
        self.frontend = Proc(
            "frontend",
            ["frontend", "--http-host", "0.0.0.0", "--http-port", "8000",
             "--model", str(tiny_model), "--discovery", self.etcd_url,
             "--router-mode", "round-robin"],
            logdir,
            wrap=lab.wrap("fe"),
        )  # fmt: skip

    def procs(self) -> list[Proc]:
        return [self.frontend, *self.workers.values()]

    def http_ok(self, url: str, timeout_s: float) -> bool:
        return self.agent.ask(op="http", url=url, timeout_s=timeout_s).get("status") == 200

    def registered(self, worker: str) -> bool:
        """Whether etcd holds the worker's registration (etcd's JSON gateway, asked from cl)."""
        key = f"{PREFIX}/v1/instances/worker/{worker}".encode()
        answer = self.agent.ask(
            op="http",
            url=f"http://{self.etcd.endpoint}/v3/kv/range",
            body={"key": base64.b64encode(key).decode()},
            timeout_s=2,
        )
        assert answer.get("status") == 200, answer
        return bool(json.loads(answer["body"]).get("kvs"))

    def served(self, worker: str) -> int | None:
        """The worker's requests_finished_total; None when it cannot be reached."""
        answer = self.agent.ask(op="load", address=f"{self.ips[worker]}:9000", timeout_s=2)
        value = answer.get("requests_finished_total")
        return None if value is None else int(value)

    def chat(self, timeout_s: float = 10) -> dict[str, Any]:
        return self.agent.ask(
            op="http",
            url=f"{self.http}/v1/chat/completions",
            body={
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": "Hello over the wire!"}],
                "max_tokens": 4,
            },
            timeout_s=timeout_s,
        )

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs()) + "\n--- etcd\n" + self.etcd.log_tail()


@pytest.fixture
def cluster(tiny_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    if ETCD_BINARY is None:
        pytest.skip(MISSING_REASON)
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces on this machine: {why}")
    lab = netns.NetLab()
    c: Cluster | None = None
    try:
        c = Cluster(lab, tiny_model, tmp_path)
        c.etcd.start()
        for p in c.procs():
            p.start()
        try:
            poll(lambda: c is not None and c.http_ok(f"{c.http}/health", 2), 60,
                 "the frontend to see a worker", 0.2)  # fmt: skip
            poll(lambda: c is not None and all(c.registered(w) for w in c.workers), 30,
                 "both workers in etcd", 0.2)  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None
        yield c
    finally:
        if c is not None:
            for p in c.procs():
                p.stop()
            c.etcd.stop()
            c.agent.close()
        lab.close()


def test_requests_cross_hosts_and_a_cut_off_worker_leaves_and_returns(cluster: Cluster) -> None:
    c = cluster
    # Requests flow client -> frontend -> both workers, one at a time (round-robin).
    before = {w: c.served(w) for w in c.workers}
    assert None not in before.values(), before
    for _ in range(6):
        answer = c.chat()
        assert answer.get("status") == 200, answer
        assert json.loads(answer["body"])["choices"][0]["finish_reason"] in ("length", "stop")
    after = {w: c.served(w) for w in c.workers}
    gained = {w: (after[w] or 0) - (before[w] or 0) for w in c.workers}
    assert gained == {"w1": 3, "w2": 3}, gained

    # w1's host is cut off: it keeps running, but nothing it sends arrives.
    c.lab.cut("w1")
    cut_at = time.monotonic()
    poll(lambda: not c.registered("w1"), TTL + 3, "w1's lease to expire", 0.1)
    gone_s = time.monotonic() - cut_at
    assert gone_s < TTL + EXPIRY_SLACK_S, f"w1 left etcd {gone_s:.2f} s after the cut"
    assert c.served("w1") is None  # unreachable indeed
    time.sleep(0.3)  # the frontend's watch delivers the deletion
    w2_before = c.served("w2") or 0
    slow = []
    for _ in range(6):
        answer = c.chat(timeout_s=5)
        assert answer.get("status") == 200, (answer, c.logs())
        slow += [answer["elapsed_s"]] if answer["elapsed_s"] > 1.0 else []
    assert (c.served("w2") or 0) - w2_before == 6, "a request was routed to the cut-off w1"
    assert not slow, f"requests waited on the cut-off worker: {slow}"
    left_s = time.monotonic() - cut_at

    # The link comes back: w1 registers again (new lease) and the frontend routes to it.
    c.lab.restore("w1")
    restored_at = time.monotonic()
    poll(lambda: c.registered("w1"), 30, "w1 to register again", 0.2)
    back_s = time.monotonic() - restored_at
    w1_before = c.served("w1")
    assert w1_before is not None

    def w1_serves() -> bool:
        assert c.chat(timeout_s=5).get("status") == 200
        return (c.served("w1") or 0) > w1_before

    poll(w1_serves, 15, "requests to reach w1 again", 0.1)
    print(
        f"cut -> w1 out of etcd {gone_s:.2f} s (ttl {TTL} s), all 6 requests on w2 by "
        f"{left_s:.2f} s; link back -> w1 registered in {back_s:.2f} s, "
        f"serving in {time.monotonic() - restored_at:.2f} s"
    )
