"""A huge prompt never stalls the gateway: while a stream is running and /health is polled, a
10 MB chat message and a 200 KB completion prompt are refused (400 context_length_exceeded),
the first before tokenizing (it cannot fit whatever its tokens), the second tokenized on a
worker thread; /health and the stream keep their usual latency."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

import aiohttp
import pytest

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime.tinymodel import create_tiny_model

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}

STALL_S = 1.0
"""Longest /health answer or gap between stream events tolerated (tokenizing 10 MB on the event
loop stalled it for about 8 s)."""


async def test_a_10_mb_prompt_does_not_stall_the_gateway(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(create_tiny_model(tmp_path / "tiny-llama"))
    backend = FakeBackend(
        [model_info("tiny", context_length=4096)],
        tokens=list(range(100, 400)),
        delay_s=0.01,
    )
    config = FrontendConfig(max_request_bytes=16 * 1024 * 1024)
    runner, port = await serve_http(
        build_app(OpenAIService(backend, {"tiny": tok}, config)), "127.0.0.1", 0
    )
    base = f"http://127.0.0.1:{port}"
    health: list[float] = []
    gaps: list[float] = []
    done = asyncio.Event()

    async with aiohttp.ClientSession() as http:

        async def poll_health() -> None:
            while not done.is_set():
                t = time.perf_counter()
                async with http.get(base + "/health") as r:
                    assert r.status == 200
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        async def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "stream": True}
            async with http.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
                last = time.perf_counter()
                async for _line in r.content:
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

        async def big(path: str, body: dict[str, object]) -> tuple[float, dict[str, object]]:
            t = time.perf_counter()
            data = io.BytesIO(json.dumps(body).encode())
            async with http.post(base + path, data=data, headers=JSON) as r:
                assert r.status == 400
                error = (await r.json())["error"]
            return time.perf_counter() - t, error

        tasks = [asyncio.create_task(poll_health()), asyncio.create_task(stream())]
        try:
            await asyncio.sleep(0.3)
            huge = "All work and no play makes Jack a dull boy. " * 230_000  # ~10 MB
            t_huge, e_huge = await big(
                "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": huge}]},
            )
            t_big, e_big = await big(
                "/v1/completions", {"model": "tiny", "prompt": "hello world " * 17_000}
            )
            await asyncio.wait_for(tasks[1], 30)
        finally:
            done.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await runner.cleanup()
    print(
        f"10 MB refused in {t_huge * 1000:.0f} ms, 200 KB in {t_big * 1000:.0f} ms; /health "
        f"max {max(health) * 1000:.0f} ms over {len(health)}, stream max gap "
        f"{max(gaps) * 1000:.0f} ms"
    )
    for e in (e_huge, e_big):
        assert e["code"] == "context_length_exceeded", e
    assert "characters" in str(e_huge["message"])  # refused before tokenizing
    assert "tokens" in str(e_big["message"])
    assert max(health) < STALL_S and max(gaps) < STALL_S
