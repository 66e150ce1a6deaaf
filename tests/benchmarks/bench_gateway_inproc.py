"""Gateway-only throughput and latency: the real HTTP app in front of an instant fake backend.

The server process runs kvmesh.frontend.app with uvloop, the tiny model's tokenizer and chat
template, and FakeBackend streaming 8 tokens without ever waiting, so only the gateway's own
cost is measured. The client (this process, aiohttp, uvloop) runs two phases like
shared/peers/bench.py:

1. load: `-c` concurrent clients send `-n` streaming chat requests (200-word prompts from a few
   shared prefixes) over keep-alive connections; reports requests/s, latency and TTFT p50/p99;
2. sequential: one keep-alive connection sends requests one after another; reports p50/p99
   latency (a ~40 ms p50 would mean Nagle/delayed-ACK stalls).

    .venv/bin/python tests/benchmarks/bench_gateway_inproc.py [-n 4000] [-c 200] [--profile]
        [--tls] [--api-key]

`--tls`: HTTPS with a throwaway CA's certificate (the client verifies it); `--api-key`: the
gateway checks an API key on every request (the client sends it). Compare with and without
them for the cost of gateway security.

`--profile` runs the server under cProfile and prints its top functions afterwards.
Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

API_KEY = "sk-bench-key"

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau"
).split()


def _serve(args: argparse.Namespace) -> None:
    import uvloop

    from kvmesh.frontend.app import build_app, serve_http
    from kvmesh.frontend.auth import GatewayAuth
    from kvmesh.frontend.config import FrontendConfig
    from kvmesh.frontend.service import OpenAIService
    from kvmesh.frontend.testing import DEFAULT_TEXT, FakeBackend, model_info
    from kvmesh.frontend.tokenizer import Tokenizer
    from kvmesh.runtime.tinymodel import create_tiny_model
    from kvmesh.runtime.tls import DevPki, ReloadingTls, ServerSslContext

    async def main() -> None:
        model_dir = create_tiny_model(Path(args.model_dir))
        tok = Tokenizer.from_pretrained(model_dir)
        backend = FakeBackend(
            [model_info("tiny-llama")],
            tokens=tok.encode(DEFAULT_TEXT),
            eos_token_id=tok.eos_token_ids[-1],
            history=0,
        )
        config = FrontendConfig(http_port=0, api_key=[API_KEY] if args.api_key else [])
        service = OpenAIService(backend, {"tiny-llama": tok}, config)
        auth = GatewayAuth.from_config(config, {})
        tls = None
        if args.tls_dir:
            tls_dir = Path(args.tls_dir)
            pki = DevPki(tls_dir, tls_dir / "ca.pem", tls_dir / "ca-key.pem")
            tls = ServerSslContext(ReloadingTls(pki.files("gateway")))
        app = build_app(service, config, auth)
        runner, port = await serve_http(app, "127.0.0.1", 0, tls=tls)
        await asyncio.to_thread(Path(args.port_file).write_text, str(port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        await runner.cleanup()

    if args.profile == "pyinstrument":
        from pyinstrument import Profiler

        sampler = Profiler(interval=0.0002, async_mode="disabled")
        sampler.start()
        uvloop.run(main())
        sampler.stop()
        sys.stderr.write(
            sampler.output_text(
                unicode=False, color=False, show_all=bool(os.environ.get("BENCH_PROFILE_ALL"))
            )
        )
    elif args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        uvloop.run(main())
        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(35)
    else:
        uvloop.run(main())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


async def _drive(
    args: argparse.Namespace, port: int, pid: int, ca: Path | None
) -> list[dict[str, Any]]:
    import ssl

    import aiohttp

    scheme = "https" if ca is not None else "http"
    url = f"{scheme}://127.0.0.1:{port}/v1/chat/completions"
    ssl_context = ssl.create_default_context(cafile=str(ca)) if ca is not None else True
    rng = random.Random(0)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(8)]

    def body(i: int) -> bytes:
        msg = f"{prefixes[i % len(prefixes)]} question {i}: hello?"
        return json.dumps(
            {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": msg}],
                "max_tokens": args.max_tokens,
                "stream": True,
            }
        ).encode()

    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {API_KEY}"

    async def one(session: aiohttp.ClientSession, i: int, out: list[Any]) -> None:
        t0 = time.perf_counter()
        ttft = None
        chunks = 0
        ok = True
        try:
            async with session.post(url, data=body(i), headers=headers) as resp:
                ok = resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        chunks += 1
        except aiohttp.ClientError:
            ok = False
        out.append((ok and chunks > 1, time.perf_counter() - t0, ttft))

    async def run(session: aiohttp.ClientSession, n: int, c: int) -> tuple[list[Any], float]:
        out: list[Any] = []
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                await one(session, i, out)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(c, n))))
        return out, time.perf_counter() - t0

    def summary(
        phase: str, out: list[Any], wall: float, n: int, c: int, cpu: float
    ) -> dict[str, Any]:
        lat = sorted(1e3 * x[1] for x in out if x[0])
        ttft = sorted(1e3 * x[2] for x in out if x[0] and x[2] is not None)
        return {
            "phase": phase,
            "n": n,
            "concurrency": c,
            "max_tokens": args.max_tokens,
            "errors": sum(not x[0] for x in out),
            "wall_s": round(wall, 3),
            "req_per_s": round(n / wall, 1),
            "lat_ms_p50": round(_quantile(lat, 0.5), 2),
            "lat_ms_p99": round(_quantile(lat, 0.99), 2),
            "lat_ms_mean": round(statistics.fmean(lat), 2) if lat else None,
            "ttft_ms_p50": round(_quantile(ttft, 0.5), 2),
            "ttft_ms_p99": round(_quantile(ttft, 0.99), 2),
            "server_cpu_us_per_req": round(1e6 * cpu / n, 1),
        }

    results = []
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=args.concurrency, ssl=ssl_context)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await run(session, args.warmup, args.concurrency)
        cpu0 = _cpu_seconds(pid)
        out, wall = await run(session, args.n, args.concurrency)
        cpu = _cpu_seconds(pid) - cpu0
        results.append(summary("load", out, wall, args.n, args.concurrency, cpu))
    connector = aiohttp.TCPConnector(limit=1, ssl=ssl_context)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await run(session, 20, 1)
        cpu0 = _cpu_seconds(pid)
        out, wall = await run(session, args.sequential, 1)
        cpu = _cpu_seconds(pid) - cpu0
        results.append(summary("sequential", out, wall, args.sequential, 1, cpu))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4000, help="requests in the load phase")
    parser.add_argument("-c", "--concurrency", type=int, default=200)
    parser.add_argument("--sequential", type=int, default=500, help="requests, one at a time")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--profile",
        nargs="?",
        const="cprofile",
        choices=["cprofile", "pyinstrument"],
        help="profile the server (cProfile, or pyinstrument if installed)",
    )
    parser.add_argument("--tls", action="store_true", help="HTTPS (a throwaway certificate)")
    parser.add_argument("--api-key", action="store_true", help="check an API key per request")
    parser.add_argument("--tls-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="", help="tiny model dir (default: a temp dir)")
    args = parser.parse_args()
    if args.serve:
        _serve(args)
        return

    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        model_dir = args.model_dir or str(Path(tmp) / "tiny-llama")
        cmd = [sys.executable, __file__, "--serve", "--port-file", str(port_file)]
        cmd += ["--model-dir", model_dir] + ([f"--profile={args.profile}"] if args.profile else [])
        ca: Path | None = None
        if args.tls:
            from kvmesh.runtime.tls import write_dev_pki

            ca = write_dev_pki(Path(tmp) / "tls", ["gateway"]).ca
            cmd += ["--tls-dir", str(ca.parent)]
        cmd += ["--api-key"] if args.api_key else []
        server = subprocess.Popen(cmd, env=dict(os.environ))
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the gateway did not start")
                time.sleep(0.05)
            port = int(port_file.read_text())
            for result in uvloop.run(_drive(args, port, server.pid, ca)):
                print(json.dumps(result), flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
