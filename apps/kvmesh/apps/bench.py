"""`kvmesh bench`: a load generator for an OpenAI chat endpoint.

Two measurements: throughput with C concurrent keep-alive clients, and latency of sequential
single requests on one keep-alive connection (where Nagle/delayed-ACK stalls of ~40 ms show
up). Prints one JSON object per run.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

from kvmesh.runtime.config import opt


@dataclass
class BenchConfig:
    """Settings of `kvmesh bench`."""

    url: str = opt("http://127.0.0.1:8000", "base URL of the gateway")
    model: str = opt("", "model name; empty: the first one /v1/models lists")
    requests: int = opt(2000, "requests to send (after warmup)", flag="-n")
    concurrency: int = opt(200, "concurrent clients", flag="-c")
    max_tokens: int = opt(8, "max_tokens per request")
    stream: bool = opt(True, "streaming chat completions")
    warmup: int = opt(100, "warmup requests (not measured)")
    sequential: int = opt(200, "sequential single requests on one connection (0: skip)")
    prefix_groups: int = opt(8, "distinct shared prompt prefixes")
    prefix_words: int = opt(64, "words per shared prefix")
    seed: int = opt(0, "prompt generator seed")


WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()


def _q(values: list[float], f: float) -> float:
    return values[min(len(values) - 1, int(f * len(values)))] if values else float("nan")


class _Load:
    def __init__(self, cfg: BenchConfig, model: str) -> None:
        rng = random.Random(cfg.seed)
        self.cfg = cfg
        self.url = cfg.url.rstrip("/") + "/v1/chat/completions"
        self.prefixes = [
            " ".join(rng.choice(WORDS) for _ in range(cfg.prefix_words))
            for _ in range(max(1, cfg.prefix_groups))
        ]
        self.model = model

    def body(self, i: int) -> bytes:
        msg = f"{self.prefixes[i % len(self.prefixes)]} question {i}: hello?"
        return json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": msg}],
                "max_tokens": self.cfg.max_tokens,
                "stream": self.cfg.stream,
            }
        ).encode()

    async def one(self, session: aiohttp.ClientSession, i: int) -> tuple[bool, float, float | None]:
        t0 = time.perf_counter()
        ttft = None
        try:
            async with session.post(
                self.url, data=self.body(i), headers={"Content-Type": "application/json"}
            ) as r:
                ok = r.status == 200
                if self.cfg.stream:
                    async for line in r.content:
                        if ttft is None and line.startswith(b"data: "):
                            ttft = time.perf_counter() - t0
                else:
                    await r.read()
        except aiohttp.ClientError:
            ok = False
        return ok, time.perf_counter() - t0, ttft

    async def run(
        self, session: aiohttp.ClientSession, n: int, c: int
    ) -> tuple[list[tuple[bool, float, float | None]], float]:
        out: list[tuple[bool, float, float | None]] = []
        it = iter(range(n))

        async def client() -> None:
            for i in it:
                out.append(await self.one(session, i))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(c, n))))
        return out, time.perf_counter() - t0


def _summary(results: list[tuple[bool, float, float | None]], wall: float) -> dict[str, object]:
    lat = sorted(1e3 * r[1] for r in results if r[0])
    ttft = sorted(1e3 * r[2] for r in results if r[0] and r[2] is not None)
    return {
        "requests": len(results),
        "errors": sum(not r[0] for r in results),
        "wall_s": round(wall, 3),
        "req_per_s": round(len(results) / wall, 1) if wall else None,
        "lat_ms_p50": round(_q(lat, 0.5), 2),
        "lat_ms_p90": round(_q(lat, 0.9), 2),
        "lat_ms_p99": round(_q(lat, 0.99), 2),
        "lat_ms_max": round(lat[-1], 2) if lat else None,
        "lat_ms_mean": round(statistics.fmean(lat), 2) if lat else None,
        "ttft_ms_p50": round(_q(ttft, 0.5), 2),
        "ttft_ms_p99": round(_q(ttft, 0.99), 2),
    }


async def run_bench(cfg: BenchConfig) -> None:
    """Run the configured measurements and print JSON lines."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as probe:
        model = cfg.model
        if not model:
            async with probe.get(cfg.url.rstrip("/") + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
    load = _Load(cfg, model)
    conn = aiohttp.TCPConnector(limit=cfg.concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        if cfg.warmup:
            await load.run(session, cfg.warmup, cfg.concurrency)
        results, wall = await load.run(session, cfg.requests, cfg.concurrency)
        print(
            json.dumps(
                {
                    "mode": "concurrent",
                    "concurrency": cfg.concurrency,
                    "stream": cfg.stream,
                    "max_tokens": cfg.max_tokens,
                    **_summary(results, wall),
                }
            ),
            flush=True,
        )
    if cfg.sequential:
        conn = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            await load.run(session, 20, 1)
            results, wall = await load.run(session, cfg.sequential, 1)
            summary = _summary(results, wall)
            slow = sum(1 for r in results if r[1] > 0.035)
            print(
                json.dumps(
                    {
                        "mode": "sequential",
                        "stream": cfg.stream,
                        "max_tokens": cfg.max_tokens,
                        "over_35ms": slow,
                        **summary,
                    }
                ),
                flush=True,
            )
