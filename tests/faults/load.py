"""Long load runs of the fault suite against real `kvmesh up` meshes (tests/faults/test_load.py
runs bounded versions in CI).

  python -m tests.faults.load requests --requests 10000 --concurrency 500 --rounds 4
      N requests at concurrency C against `kvmesh up` with instant mocker workers, in rounds:
      status counts, errors, latency, and the frontend's RSS after each round.
  python -m tests.faults.load requests --requests 3000 --concurrency 300 --speedup-ratio 1 \\
      --up-args="--max-num-seqs 32 --queue-timeout-s 2"
      the same at a realistic pace, with limits that the load exceeds: 429s with Retry-After.
  python -m tests.faults.load startups --count 50
      N start-ups of `kvmesh up --discovery etcd://...` (a real etcd): each must serve a request
      and stop with exit 0, with no crash in its output and no process left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvmesh.runtime.ports import free_port
from tests.procs import frontend_ready, poll

CRASH_MARKERS = (
    "Traceback",
    "Segmentation fault",
    "Fatal Python error",
    "ev_epoll1_linux",
    "core dumped",
)


@dataclass
class Up:
    """One `kvmesh up` process, its output in a file."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @classmethod
    def start(cls, logdir: Path, *args: str) -> Up:
        port = free_port()
        log = logdir / f"up-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvmesh", "up", "--log-level", "warning",
                 "--http-port", str(port), *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        return cls(proc, port, log)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120) -> float:
        start = time.monotonic()
        poll(
            lambda: frontend_ready(self.port) or self.proc.poll() is not None,
            timeout_s,
            "kvmesh up to serve",
            0.1,
        )
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvmesh up exited:\n{self.output()}")
        return time.monotonic() - start

    def children(self) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                            found.append(int(entry))
                except OSError:
                    continue
        return found

    def frontend_rss_mb(self) -> float:
        for pid in self.children():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"frontend" in f.read().split(b"\0")[3:4][0]:
                    with open(f"/proc/{pid}/statm") as g:
                        return int(g.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        raise RuntimeError("no frontend process")

    def stop(self, timeout_s: float = 60) -> int:
        children = self.children()
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        poll(lambda: not any(os.path.exists(f"/proc/{p}") for p in children), 30, "children")
        return code

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Round:
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    retry_after_missing: int = 0
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> str:
        lat = sorted(self.latencies) or [0.0]
        p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
        missing = self.retry_after_missing
        return (
            f"statuses {dict(self.statuses)} errors {dict(self.errors)} "
            f"p50 {p50 * 1000:.0f} ms p99 {p99 * 1000:.0f} ms"
            + (f" 429 without Retry-After: {missing}" if missing else "")
        )


async def run_round(base: str, requests: int, concurrency: int, max_tokens: int) -> Round:
    """`requests` streaming chat completions, `concurrency` at a time."""
    result = Round()
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    todo = iter(range(requests))
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:

        async def worker() -> None:
            for _ in todo:
                start = time.monotonic()
                try:
                    async with http.post(base + "/v1/chat/completions", json=body) as r:
                        data = await r.read()
                        result.statuses[r.status] += 1
                        if r.status == 429 and "Retry-After" not in r.headers:
                            result.retry_after_missing += 1
                        if r.status == 200 and not data.rstrip().endswith(b"data: [DONE]"):
                            result.errors["no [DONE]"] += 1
                        elif r.status == 200 and b'"error"' in data:
                            result.errors["in-band error"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    result.errors[type(exc).__name__] += 1
                result.latencies.append(time.monotonic() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


def load(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        up = Up.start(
            Path(tmp), "--workers", "2", "--speedup-ratio", str(args.speedup_ratio),
            *shlex.split(args.up_args),
        )  # fmt: skip
        try:
            up.wait_ready()
            rss = [up.frontend_rss_mb()]
            print(f"frontend RSS at start {rss[0]:.0f} MB", flush=True)
            per_round = args.requests // args.rounds
            failed = 0
            for i in range(args.rounds):
                t = time.monotonic()
                r = asyncio.run(run_round(up.base, per_round, args.concurrency, args.max_tokens))
                rss.append(up.frontend_rss_mb())
                print(
                    f"round {i + 1}: {per_round} requests at c={args.concurrency} in "
                    f"{time.monotonic() - t:.1f} s: {r.summary()}; frontend RSS {rss[-1]:.0f} MB",
                    flush=True,
                )
                failed += sum(r.errors.values()) + r.retry_after_missing
                failed += sum(n for s, n in r.statuses.items() if s not in (200, 429))
            code = up.stop()
            print(f"RSS over rounds (MB): {[round(x) for x in rss]}; kvmesh up exited {code}")
            return 1 if failed or code else 0
        finally:
            if up.proc.poll() is None:
                os.killpg(up.proc.pid, signal.SIGKILL)


def startups(args: argparse.Namespace) -> int:
    from tests.etcd_server import EtcdServer

    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        etcd.start()
        crashes = 0
        try:
            for i in range(args.count):
                up = Up.start(Path(tmp), "--discovery", etcd.url, "--workers", "2")
                why = ""
                try:
                    ready_s = up.wait_ready()
                    r = asyncio.run(run_round(up.base, 1, 1, 8))
                    if r.statuses != {200: 1} or r.errors:
                        why = r.summary()
                    code = up.stop()
                    if code:
                        why += f" exit {code}"
                except Exception as exc:
                    why = repr(exc)
                    ready_s = float("nan")
                finally:
                    if up.proc.poll() is None:
                        os.killpg(up.proc.pid, signal.SIGKILL)
                out = up.output()
                crash = next((m for m in CRASH_MARKERS if m in out), "")
                if why or crash:
                    crashes += 1
                    print(f"start-up {i + 1}: FAILED {why} {crash}\n{out[-3000:]}", flush=True)
                else:
                    print(f"start-up {i + 1}: ok (serving after {ready_s:.1f} s)", flush=True)
        finally:
            etcd.stop()
        print(f"{args.count} start-ups with etcd discovery: {crashes} failed")
        return 1 if crashes else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("requests")
    r.add_argument("--requests", type=int, default=10000)
    r.add_argument("--concurrency", type=int, default=500)
    r.add_argument("--rounds", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=8)
    r.add_argument("--speedup-ratio", type=float, default=1e9)
    r.add_argument("--up-args", default="", help="more flags for kvmesh up")
    s = sub.add_parser("startups")
    s.add_argument("--count", type=int, default=50)
    args = parser.parse_args()
    return load(args) if args.what == "requests" else startups(args)


if __name__ == "__main__":
    sys.exit(main())
