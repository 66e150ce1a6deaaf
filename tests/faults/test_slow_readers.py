"""Clients that open long streams and never read: the gateway stops taking their outputs once
the socket is full, their requests are paused on the workers (the workers stop generating for
them), gateway memory stays bounded, other clients keep their latency, and after
`stream_write_timeout_s` the silent clients are cut and every gauge returns to zero.

Two mocker workers in this process at a realistic pace; the real HTTP gateway; 40 raw sockets
with a small receive buffer that send a streaming request and read nothing."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.router.backend import MeshBackend
from kvmesh.router.kv_router import KvRouter
from kvmesh.workers.server import Worker

from .mesh import mocker_workers, start_pool

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SILENT = 40
CUT_S = 4.0
"""--stream-write-timeout-s of the gateway."""


class Mesh:
    def __init__(self, base: str, port: int, backend: MeshBackend, service: OpenAIService,
                 workers: list[Worker]) -> None:  # fmt: skip
        self.base, self.port, self.backend, self.service = base, port, backend, service
        self.workers = workers

    def running(self) -> int:
        return sum(w.engine.load().num_running for w in self.workers)


@pytest.fixture
async def mesh(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    workers = mocker_workers(tiny_model, tmp_path / "registry", 2, speedup_ratio=4.0)
    pool = await start_pool(workers, tmp_path / "registry")
    backend = MeshBackend(pool, KvRouter(pool))
    config = FrontendConfig(stream_write_timeout_s=CUT_S, send_buffer_bytes=32768)
    service = OpenAIService(backend, {"tiny": Tokenizer.from_pretrained(tiny_model)}, config)
    runner, port = await serve_http(build_app(service, config), "127.0.0.1", 0)
    try:
        yield Mesh(f"http://127.0.0.1:{port}", port, backend, service, workers)
    finally:
        await runner.cleanup()
        await pool.stop()
        for w in workers:
            await w.stop()


def silent_client(port: int) -> socket.socket:
    """A streaming request whose answer is never read."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps(
        {"model": "tiny", "prompt": "once upon a time", "max_tokens": 3500, "stream": True,
         "ignore_eos": True}
    ).encode()  # fmt: skip
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


async def timed_stream(http: aiohttp.ClientSession, base: str) -> float:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "stream": True}
    start = time.monotonic()
    async with http.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for _ in r.content:
            pass
    return time.monotonic() - start


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def test_silent_clients_are_paused_bounded_and_cut(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as http:
        baseline = min([await timed_stream(http, mesh.base) for _ in range(3)])
        rss0 = rss_mb()
        sockets = [silent_client(mesh.port) for _ in range(SILENT)]
        try:
            # Their sockets fill, then their requests are paused: the workers stop generating.
            async with asyncio.timeout(30):
                while mesh.backend.stats.pauses < SILENT or mesh.running():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            paused_at = time.monotonic()
            others = [await timed_stream(http, mesh.base) for _ in range(5)]
            rss1 = rss_mb()
            assert mesh.service.in_flight == SILENT  # still connected, not yet cut
            # Nobody reads: cut after CUT_S, every gauge back to zero.
            async with asyncio.timeout(CUT_S + 15):
                while mesh.service.in_flight:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            cut_after = time.monotonic() - paused_at
        finally:
            for s in sockets:
                s.close()
    print(
        f"{SILENT} silent clients: {mesh.backend.stats.pauses} pauses, workers idle; other "
        f"streams {max(others) * 1000:.0f} ms (alone {baseline * 1000:.0f} ms); RSS +"
        f"{rss1 - rss0:.0f} MB; cut {cut_after:.1f} s after the pause"
    )
    assert max(others) < 2 * baseline + 0.5
    assert rss1 - rss0 < 100
    assert mesh.running() == 0
    assert mesh.backend.admission.running == 0
    assert all(w.engine.load().kv_active_blocks == 0 for w in mesh.workers)
