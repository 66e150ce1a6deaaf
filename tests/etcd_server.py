"""A real etcd server on loopback ports for tests (Debian's `etcd-server` package), and a TCP
proxy in front of it to cut a client off without stopping etcd.

Tests that need etcd skip, with the reason, only when the `etcd` binary is not on PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from kvmesh.runtime.ports import free_port
from kvmesh.runtime.tls import DevPki

ETCD_BINARY = shutil.which("etcd")
MISSING_REASON = (
    "the etcd binary is not on PATH (install Debian's etcd-server: apt-get install etcd-server)"
)


class EtcdServer:
    """One etcd member on 127.0.0.1 (or `host`), its data (and log) under `workdir`.

    Short heartbeat and election timings make it the leader at once and allow 1 s leases.
    `wrap`: a command prefix to run etcd under (e.g. `ip netns exec NS` for another network
    namespace); `healthy`: how to check it from here when 127.0.0.1 cannot reach it. `tls`: serve
    clients over TLS with `pki`'s `etcd` certificate and require client certificates that `pki`'s
    CA signed (etcd's --client-cert-auth).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
        healthy: Callable[[], bool] | None = None,
        tls: DevPki | None = None,
    ) -> None:
        if ETCD_BINARY is None:
            raise RuntimeError(MISSING_REASON)
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.log_path = workdir / "etcd.log"
        self.host = host
        self.wrap = list(wrap)
        self.tls = tls
        self._healthy = healthy or self.healthy
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """host:port of the client API."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        """The kvmesh discovery URL of this server (over TLS: as the `etcd-client` identity)."""
        if self.tls is None:
            return f"etcd://{self.endpoint}"
        cert, key = self.tls.cert("etcd-client"), self.tls.key("etcd-client")
        return f"etcd://{self.endpoint}?cacert={self.tls.ca}&cert={cert}&key={key}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start etcd and wait until /health says it is healthy."""
        assert ETCD_BINARY is not None
        scheme = "https" if self.tls is not None else "http"
        client = f"{scheme}://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
        tls = []
        if self.tls is not None:
            for identity in ("etcd", "etcd-client"):
                if not self.tls.cert(identity).exists():
                    self.tls.issue(identity)
            tls = [
                f"--cert-file={self.tls.cert('etcd')}",
                f"--key-file={self.tls.key('etcd')}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        argv = [
            *self.wrap,
            ETCD_BINARY,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--heartbeat-interval=20",
            "--election-timeout=200",
            "--logger=zap",
            "--log-level=warn",
            *tls,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(kill=True)
                raise RuntimeError(f"etcd did not become healthy:\n{self.log_tail()}")
            time.sleep(0.02)

    def healthy(self) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(self.tls.cert("etcd-client"), self.tls.key("etcd-client"))
        scheme = "https" if self.tls is not None else "http"
        url = f"{scheme}://{self.endpoint}/health"
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop etcd (SIGTERM, or SIGKILL when `kill`) and wait for it to exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, *, wipe: bool = False) -> None:
        """Stop etcd and start it again on the same ports; `wipe`: with an empty data dir (all
        keys and leases gone, revisions start over)."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class TcpProxy:
    """A loopback TCP proxy to `target_port`; `cut()` drops every connection and refuses new
    ones (a network partition), `restore()` accepts again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def restore(self) -> None:
        """(Re)start accepting connections."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def cut(self) -> None:
        """Stop accepting and close every open connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pumps:
                t.cancel()
                self._tasks.discard(t)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
