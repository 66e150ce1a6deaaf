"""etcd discovery against a real etcd server on loopback (tests/etcd_server.py): leases, watches,
a killed owner's registration expiring, etcd restarts and partitions, and real worker processes
feeding a WorkerPool. Skipped only when the `etcd` binary is missing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aetcd
import pytest

from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.runtime.discovery import (
    Discovery,
    DiscoveryEvent,
    EtcdDiscovery,
    EventKind,
    Instance,
    open_discovery,
)
from kvmesh.runtime.errors import InvalidRequest, Unavailable
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.tls import TlsError, write_dev_pki
from tests.etcd_server import ETCD_BINARY, MISSING_REASON, EtcdServer, TcpProxy

TTL = 2
"""Lease TTL of these tests (s); etcd deletes an expired lease's keys within ~0.5 s after it."""
EXPIRY_SLACK_S = 1.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if ETCD_BINARY is None:
        pytest.skip(MISSING_REASON)
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def raw(etcd: EtcdServer) -> AsyncIterator[Any]:
    """A plain etcd client, to look at and change etcd behind kvmesh's back."""
    client = aetcd.Client("127.0.0.1", etcd.client_port, timeout=3)
    yield client
    await client.close()


def etcd_discovery(url: str) -> EtcdDiscovery:
    disc = open_discovery(f"{url}?ttl={TTL}")
    assert isinstance(disc, EtcdDiscovery)
    return disc


class Watcher:
    """Follows `discovery.watch(component)` in a task: every event, and the live set."""

    def __init__(self, discovery: EtcdDiscovery, component: str = "worker") -> None:
        self.events: list[DiscoveryEvent] = []
        self.live: dict[str, Instance] = {}
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(discovery.watch(component)))

    async def _run(self, events: AsyncIterator[DiscoveryEvent]) -> None:
        async for ev in events:
            self.events.append(ev)
            if ev.kind is EventKind.ADDED:
                self.live[ev.instance.instance_id] = ev.instance
            else:
                self.live.pop(ev.instance.instance_id, None)
            self._changed.set()

    async def until(self, pred: Callable[[], bool], timeout_s: float = 5.0) -> float:
        """Wait until `pred()` holds; returns the seconds it took."""
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"timed out; live {sorted(self.live)}, events {self.events}"
            ) from None
        return time.monotonic() - start

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def lease_of(raw: Any, key: bytes) -> int | None:
    """The lease holding `key`; None when the key does not exist."""
    kv = await raw.get(key)
    return None if kv is None else int(kv.lease)


async def poll(pred: Callable[[], Any], timeout_s: float, what: str) -> float:
    """Await `pred()` (a coroutine factory) until it is truthy; returns the seconds it took."""
    start = time.monotonic()
    while not await pred():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


# --- URL forms (no server needed) -------------------------------------------------------------


@pytest.mark.unit
def test_etcd_url_forms() -> None:
    d = open_discovery("etcd://127.0.0.1:2379")
    assert isinstance(d, EtcdDiscovery)
    assert (d.endpoints, d.prefix, d.ttl_s) == ([("127.0.0.1", 2379)], "/kvmesh", 5)
    assert d.key("worker", "w1") == b"/kvmesh/v1/instances/worker/w1"
    d = open_discovery("etcd://a:1,b,[::1]:3?prefix=/x/y/&ttl=7")
    assert isinstance(d, EtcdDiscovery)
    assert (d.endpoints, d.prefix, d.ttl_s) == ([("a", 1), ("b", 2379), ("[::1]", 3)], "/x/y", 7)
    assert d.key("router", "r") == b"/x/y/v1/instances/router/r"
    d = open_discovery("etcd://h:1", ttl_s=2.5)
    assert isinstance(d, EtcdDiscovery) and d.ttl_s == 3
    for bad in (
        "etcd://",
        "etcd://h:1?ttl=0",
        "etcd://h:1?ttl=1.5",
        "etcd://h:1?bogus=1",
        "etcd://h:port",
        "etcd://h:1/some/path",
    ):
        with pytest.raises(InvalidRequest):
            open_discovery(bad)


@pytest.mark.integration
async def test_unreachable_etcd_is_a_clear_error() -> None:
    disc = etcd_discovery(f"etcd://127.0.0.1:{free_port()}")
    with pytest.raises(Unavailable, match=r"is etcd running at 127\.0\.0\.1:"):
        await disc.register(Instance("w1", "127.0.0.1:1"))


@pytest.mark.integration
def test_worker_without_etcd_exits_with_a_message(tiny_model: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh", "worker", "--model", str(tiny_model),
         "--discovery", f"etcd://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    first, *_ = proc.stderr.splitlines()
    assert first.startswith("kvmesh worker: error: cannot register worker"), proc.stderr
    assert "is etcd running at 127.0.0.1:" in first
    # No traceback from discovery. (The worker's gRPC server, started before it registers, may
    # still complain from its __del__ as the process exits.)
    assert "discovery.py" not in proc.stderr and "aetcd" not in proc.stderr, proc.stderr


# --- against a real etcd ----------------------------------------------------------------------


@pytest.mark.integration
async def test_register_watch_close(etcd: EtcdServer, raw: Any) -> None:
    disc = etcd_discovery(etcd.url)
    watcher = Watcher(disc)
    w1 = Instance("w1", "127.0.0.1:1", model="m", role="prefill")
    reg1 = await disc.register(w1)
    await watcher.until(lambda: "w1" in watcher.live)
    assert watcher.events == [DiscoveryEvent(EventKind.ADDED, w1)]
    # The key layout and value other tools can read.
    kv = await raw.get(b"/kvmesh/v1/instances/worker/w1")
    assert json.loads(kv.value) == {
        "instance_id": "w1", "address": "127.0.0.1:1", "component": "worker",
        "model": "m", "role": "prefill",
    }  # fmt: skip
    assert kv.lease and 0 < (await raw.get_lease_info(kv.lease)).TTL <= TTL

    # Other components and other prefixes are not this watch's business.
    router = await disc.register(Instance("r1", "127.0.0.1:9", component="router"))
    other = await etcd_discovery(f"{etcd.url}?prefix=/elsewhere").register(Instance("x", "h:1"))
    reg2 = await disc.register(Instance("w2", "127.0.0.1:2"))
    await watcher.until(lambda: "w2" in watcher.live)
    assert set(watcher.live) == {"w1", "w2"}

    await reg1.close()
    took = await watcher.until(lambda: "w1" not in watcher.live)
    assert took < 1.0
    assert watcher.events[-1] == DiscoveryEvent(EventKind.REMOVED, w1)
    assert await raw.get(b"/kvmesh/v1/instances/worker/w1") is None
    await reg1.close()  # idempotent
    for reg in (reg2, router, other):
        await reg.close()
    await watcher.until(lambda: not watcher.live)
    await watcher.close()


@pytest.mark.integration
async def test_watch_started_later_sees_existing_instances(etcd: EtcdServer) -> None:
    disc = etcd_discovery(etcd.url)
    regs = [await disc.register(Instance(f"w{i}", f"127.0.0.1:{i + 1}")) for i in range(3)]
    watchers = [Watcher(disc), Watcher(etcd_discovery(etcd.url))]
    for w in watchers:
        await w.until(lambda w=w: len(w.live) == 3)
        assert [e.kind for e in w.events] == [EventKind.ADDED] * 3
    await regs[1].close()
    for w in watchers:
        await w.until(lambda w=w: set(w.live) == {"w0", "w2"})
        await w.close()
    for reg in regs:
        await reg.close()


_OWNER = """
import asyncio, sys
from kvmesh.runtime.discovery import Instance, open_discovery

async def main() -> None:
    await open_discovery(sys.argv[1]).register(Instance(sys.argv[2], "127.0.0.1:1"))
    print("registered", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.integration
async def test_killed_owner_disappears_within_ttl(etcd: EtcdServer) -> None:
    disc = etcd_discovery(etcd.url)
    watcher = Watcher(disc)
    alive = await disc.register(Instance("alive", "127.0.0.1:2"))
    registered_at = time.monotonic()
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OWNER, f"{etcd.url}?ttl={TTL}", "doomed", stdout=subprocess.PIPE
    )
    try:
        assert owner.stdout is not None
        assert await owner.stdout.readline() == b"registered\n"
        await watcher.until(lambda: {"alive", "doomed"} <= set(watcher.live))
        await asyncio.sleep(TTL / 2)  # the owner refreshes its lease once or twice meanwhile
        owner.send_signal(signal.SIGKILL)
        took = await watcher.until(lambda: "doomed" not in watcher.live, TTL + 3)
    finally:
        with contextlib.suppress(ProcessLookupError):
            owner.kill()
        await owner.wait()
    print(f"SIGKILL -> REMOVED: {took:.2f} s (ttl {TTL} s)")
    assert took < TTL + EXPIRY_SLACK_S
    # Meanwhile the refreshed registration outlived its TTL more than once.
    await asyncio.sleep(max(0.0, registered_at + 2 * TTL + 0.5 - time.monotonic()))
    assert "alive" in watcher.live
    assert [e.instance.instance_id for e in watcher.events if e.kind is EventKind.REMOVED] == [
        "doomed"
    ]
    await alive.close()
    await watcher.close()


@pytest.mark.integration
async def test_etcd_restart_watchers_reconcile_and_registrations_return(
    etcd: EtcdServer, raw: Any
) -> None:
    disc = etcd_discovery(etcd.url)
    watcher = Watcher(disc)
    reg_a = await disc.register(Instance("a", "127.0.0.1:1"))
    key_a = disc.key("worker", "a")
    # A registration without a lease, which an etcd that lost its data will not have.
    await raw.put(
        disc.key("worker", "x"), json.dumps({"instance_id": "x", "address": "h:1"}).encode()
    )
    await watcher.until(lambda: set(watcher.live) == {"a", "x"})
    lease_before = await lease_of(raw, key_a)

    # 1. Restart with its data: leases survive, the watch resumes.
    await asyncio.to_thread(etcd.restart)
    reg_b = await disc.register(Instance("b", "127.0.0.1:2"))
    took = await watcher.until(lambda: set(watcher.live) == {"a", "b", "x"})
    print(f"etcd restart -> watch resumed, saw a new instance: {took:.2f} s")
    assert await lease_of(raw, key_a) == lease_before

    # 2. Restart with an empty data dir: every key and lease is gone, revisions start over.
    seen = len(watcher.events)
    await asyncio.to_thread(etcd.restart, wipe=True)
    await reg_b.close()  # its lease is gone already: nothing to revoke, no error
    took = await watcher.until(lambda: set(watcher.live) == {"a"}, 10)
    # 'a' re-registered within the TTL the watcher gives a missing instance: it never left.
    assert "a" not in {e.instance.instance_id for e in watcher.events[seen:]}
    print(f"wiped etcd -> watcher reconciled: {took:.2f} s")
    took = await poll(
        lambda: lease_of(raw, key_a), TTL + 3, "registration 'a' to come back under a new lease"
    )
    print(f"wiped etcd -> registration back: {took:.2f} s")
    assert await lease_of(raw, key_a) != lease_before
    reg_c = await disc.register(Instance("c", "127.0.0.1:3"))
    await watcher.until(lambda: set(watcher.live) == {"a", "c"})
    for reg in (reg_a, reg_c):
        await reg.close()
    await watcher.until(lambda: not watcher.live)
    await watcher.close()


@pytest.mark.integration
async def test_partition_watch_catches_up_and_lost_lease_reregisters(
    etcd: EtcdServer, raw: Any
) -> None:
    proxy = TcpProxy(etcd.client_port)
    await proxy.restore()
    cut_off = etcd_discovery(f"etcd://{proxy.endpoint}")
    direct = etcd_discovery(etcd.url)
    watcher = Watcher(cut_off)
    reg_p = await cut_off.register(Instance("p", "127.0.0.1:1"))
    reg_d1 = await direct.register(Instance("d1", "127.0.0.1:2"))
    await watcher.until(lambda: set(watcher.live) == {"p", "d1"})
    key_p = cut_off.key("worker", "p")
    lease_before = await lease_of(raw, key_p)
    events_before = len(watcher.events)

    await proxy.cut()
    await reg_d1.close()
    reg_d2 = await direct.register(Instance("d2", "127.0.0.1:3"))
    took = await poll(
        lambda: _gone(raw, key_p), TTL + 3, "the cut-off registration's lease to expire"
    )
    print(f"partition -> cut-off registration expired after {took:.2f} s")
    assert len(watcher.events) == events_before, "a cut-off watch cannot have seen anything"

    await proxy.restore()
    took = await watcher.until(lambda: set(watcher.live) == {"p", "d2"}, 10)
    print(f"partition healed -> watcher reconciled in {took:.2f} s")
    await poll(lambda: lease_of(raw, key_p), TTL + 3, "'p' to register again")
    assert await lease_of(raw, key_p) != lease_before
    for reg in (reg_p, reg_d2):
        await reg.close()
    await watcher.until(lambda: not watcher.live)
    await watcher.close()
    await proxy.cut()


async def _gone(raw: Any, key: bytes) -> bool:
    return await raw.get(key) is None


@pytest.mark.integration
async def test_second_endpoint_is_used_when_the_first_is_down(etcd: EtcdServer) -> None:
    disc = etcd_discovery(f"etcd://127.0.0.1:{free_port()},{etcd.endpoint}")
    await _register_and_leave(disc)


async def _register_and_leave(disc: Discovery) -> None:
    """A worker registers and deregisters; a watcher of `disc` sees both."""
    watcher = Watcher(disc)
    reg = await disc.register(Instance("w1", "127.0.0.1:1"))
    await watcher.until(lambda: "w1" in watcher.live)
    await reg.close()
    await watcher.until(lambda: not watcher.live)
    await watcher.close()


# --- real worker processes and the router's WorkerPool -----------------------------------------


@pytest.mark.integration
async def test_worker_processes_join_and_killed_worker_leaves_the_pool(
    etcd: EtcdServer, tiny_model: Path, tmp_path: Path
) -> None:
    url = f"{etcd.url}?ttl={TTL}"
    procs: dict[str, asyncio.subprocess.Process] = {}
    logs: list[Any] = []
    for i in range(3):
        log = (tmp_path / f"wk{i}.log").open("wb")
        logs.append(log)
        procs[f"wk{i}"] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh", "--log-level", "warning", "worker",
            "--engine", "mocker", "--model", str(tiny_model), "--discovery", url,
            "--worker-id", f"wk{i}", "--speedup-ratio", "1000000",
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    pool = WorkerPool(etcd_discovery(etcd.url))
    left: dict[str, float] = {}

    def on_change(handle: WorkerHandle, joined: bool) -> None:
        if not joined:
            left[handle.instance_id] = time.monotonic()

    pool.add_listener(on_change)
    await pool.start()
    try:
        try:
            await pool.wait_for(3, timeout_s=30)
        except TimeoutError:
            logs_text = "\n".join((tmp_path / f"wk{i}.log").read_text() for i in range(3))
            raise AssertionError(f"workers did not join:\n{logs_text}") from None
        assert sorted(w.worker_id for w in pool.workers()) == ["wk0", "wk1", "wk2"]
        assert {w.info.served_model_name for w in pool.workers()} == {"tiny-llama"}

        killed_at = time.monotonic()
        procs["wk0"].send_signal(signal.SIGKILL)
        await poll(_async(lambda: "wk0" in left), TTL + 3, "wk0 to leave the pool")
        took = left["wk0"] - killed_at
        print(f"worker SIGKILL -> left the pool: {took:.2f} s (ttl {TTL} s)")
        assert took < TTL + EXPIRY_SLACK_S

        stopped_at = time.monotonic()
        procs["wk1"].send_signal(signal.SIGTERM)  # graceful: deregisters first
        await poll(_async(lambda: "wk1" in left), 5, "wk1 to leave the pool")
        took = left["wk1"] - stopped_at
        print(f"worker SIGTERM -> left the pool: {took:.2f} s")
        assert took < 1.5
        assert [w.worker_id for w in pool.workers()] == ["wk2"]
        assert await asyncio.wait_for(procs["wk1"].wait(), 10) == 0
    finally:
        await pool.stop()
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        for log in logs:
            log.close()


def _async(pred: Callable[[], bool]) -> Callable[[], Any]:
    async def check() -> bool:
        return pred()

    return check


# --- etcd over TLS ----------------------------------------------------------------------------


@pytest.mark.integration
async def test_etcd_over_tls_with_client_certificates(tmp_path: Path) -> None:
    """etcd with --client-cert-auth: a URL with cacert/cert/key registers and watches; plaintext
    clients and certificates of another CA are refused; bad TLS options are clear errors."""
    if ETCD_BINARY is None:
        pytest.skip(MISSING_REASON)
    pki = write_dev_pki(tmp_path / "pki", [])
    server = EtcdServer(tmp_path / "etcd", tls=pki)
    server.start()
    try:
        disc = open_discovery(f"{server.url}&ttl={TTL}")
        assert isinstance(disc, EtcdDiscovery) and disc.tls is not None
        await _register_and_leave(disc)

        plain = open_discovery(f"etcd://{server.endpoint}?ttl={TTL}")
        with pytest.raises(Unavailable):
            await plain.register(Instance("w2", "127.0.0.1:2"))
        other = write_dev_pki(tmp_path / "other", ["etcd-client"])
        foreign = open_discovery(
            f"etcd://{server.endpoint}?ttl={TTL}&cacert={pki.ca}"
            f"&cert={other.cert('etcd-client')}&key={other.key('etcd-client')}"
        )
        with pytest.raises(Unavailable):
            await foreign.register(Instance("w3", "127.0.0.1:3"))
    finally:
        server.stop()
    with pytest.raises(InvalidRequest, match="needs cacert="):
        open_discovery(f"etcd://h:1?cert={pki.cert('etcd')}&key={pki.key('etcd')}")
    with pytest.raises(TlsError, match=r"etcd key= .*etcd-client-key\.pem does not match"):
        open_discovery(
            f"etcd://h:1?cacert={pki.ca}&cert={pki.cert('etcd')}&key={pki.key('etcd-client')}"
        )
