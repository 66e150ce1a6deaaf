"""`kvmesh up`: a whole mesh on one machine, as separate processes, with no etcd.

Starts N workers, optionally a standalone router, and the frontend, all pointed at an embedded
file registry (a temporary directory). Waits for the gateway to report healthy, prints how to
call it, and on Ctrl-C / SIGTERM shuts down in order: frontend first (drains), then router and
workers (each drains), killing whatever is still alive after the grace period.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvmesh.config import opt, to_argv
from kvmesh.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.router.routing import RouterMode
from kvmesh.workers.server import EngineKind, engine_arg_groups


@dataclass
class UpConfig:
    """Settings of `kvmesh up`."""

    engine: EngineKind = opt(EngineKind.MOCKER, "engine every worker runs")
    model: str = opt("", "local Hugging Face model directory; empty: the built-in tiny model")
    served_model_name: str = opt("", "model name clients use; empty: the directory's name")
    workers: int = opt(2, "number of worker processes")
    http_host: str = opt("127.0.0.1", "gateway bind address")
    http_port: int = opt(8000, "gateway HTTP port")
    router_mode: RouterMode = opt(RouterMode.ROUND_ROBIN, "routing policy")
    router_process: bool = opt(
        False, "run the router as its own process (kvmesh router) instead of inside the frontend"
    )
    discovery: str = opt("", "discovery URL; empty: an embedded file registry in a temp dir")
    startup_timeout_s: float = opt(60.0, "how long to wait for the mesh to become healthy")
    shutdown_timeout_s: float = opt(15.0, "grace period for children to exit before SIGKILL")


class Child:
    """A child process in its own session, so Ctrl-C reaches only the supervisor."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"kvmesh up: {self.name} did not exit in time; killing it", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()


def _kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh", *args]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_up(config: UpConfig, ns: argparse.Namespace) -> int:
    """Run the mesh until interrupted; returns the process exit code."""
    model_dir = resolve_model_dir(config.model)
    served = config.served_model_name or ModelDirInfo.load(model_dir).name
    registry = None
    discovery = config.discovery
    if not discovery:
        registry = Path(tempfile.mkdtemp(prefix="kvmesh-registry-"))
        discovery = f"file://{registry}"
    log_level = ["--log-level", getattr(ns, "log_level", "info")]
    engine_flags: list[str] = []
    for group in engine_arg_groups():
        engine_flags += to_argv(
            group(**{k: getattr(ns, k) for k in group.__dataclass_fields__ if hasattr(ns, k)})
        )
    common = ["--model", str(model_dir), "--served-model-name", served, "--discovery", discovery]

    children: list[Child] = []
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i in range(config.workers):
            argv = _kvmesh(
                *log_level,
                "worker",
                "--engine",
                config.engine.value,
                *common,
                "--worker-id",
                f"worker-{i}-{os.getpid()}",
                *engine_flags,
            )
            children.append(Child(f"worker-{i}", argv))
        router_args: list[str] = []
        if config.router_process:
            port = _free_port("127.0.0.1")
            children.append(
                Child(
                    "router",
                    _kvmesh(
                        *log_level,
                        "router",
                        "--port",
                        str(port),
                        "--discovery",
                        discovery,
                        "--router-mode",
                        config.router_mode.value,
                    ),
                )
            )
            router_args = ["--router-address", f"127.0.0.1:{port}"]
        frontend = Child(
            "frontend",
            _kvmesh(
                *log_level,
                "frontend",
                "--http-host",
                config.http_host,
                "--http-port",
                str(config.http_port),
                *common,
                "--router-mode",
                config.router_mode.value,
                *router_args,
            ),
        )
        children.append(frontend)

        host = "127.0.0.1" if config.http_host in ("0.0.0.0", "::") else config.http_host
        base = f"http://{host}:{config.http_port}"
        deadline = time.monotonic() + config.startup_timeout_s
        while not _healthy(base + "/health"):
            dead = [c.name for c in children if not c.alive()]
            if dead or stopping or time.monotonic() > deadline:
                why = (
                    f"{', '.join(dead)} exited"
                    if dead
                    else "interrupted"
                    if stopping
                    else "timed out"
                )
                print(f"kvmesh up: mesh did not become healthy ({why})", file=sys.stderr)
                return 1
            time.sleep(0.2)
        _banner(base, served, config)
        while not stopping:
            if not frontend.alive():
                print("kvmesh up: the frontend exited; shutting down", file=sys.stderr)
                return 1
            for c in children:
                if c is not frontend and not c.alive() and c.proc.returncode is not None:
                    print(f"kvmesh up: {c.name} exited with {c.proc.returncode}", file=sys.stderr)
                    c.proc.returncode = None  # report once
                    children.remove(c)
                    break
            time.sleep(0.2)
        return 0
    finally:
        _shutdown(children, config.shutdown_timeout_s)
        if registry is not None:
            shutil.rmtree(registry, ignore_errors=True)


def _shutdown(children: list[Child], timeout_s: float) -> None:
    # Frontend first so no new work arrives, then everything else.
    ordered = sorted(children, key=lambda c: c.name != "frontend")
    for group in (ordered[:1], ordered[1:]):
        for c in group:
            c.terminate()
        deadline = time.monotonic() + timeout_s
        for c in group:
            c.wait(deadline)


def _banner(base: str, model: str, config: UpConfig) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
            "stream": True,
        }
    )
    print(
        f"\nkvmesh is up: {config.workers} {config.engine.value} worker(s), "
        f"router {config.router_mode.value}{' (own process)' if config.router_process else ''}\n"
        f"  OpenAI API : {base}/v1   (model {model!r})\n"
        f"  health     : {base}/health    metrics: {base}/metrics\n\n"
        f"  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{body}'\n\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )
