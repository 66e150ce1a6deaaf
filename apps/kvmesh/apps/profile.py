"""`kvmesh profile`: measure an engine and write its performance profile (format:
kvmesh.planner.profile), which `kvmesh planner --profile`, `kvmesh up --planner sla --profile`
and `kvmesh replay --planner sla --profile` read.

Three ways, by flags:

  * `kvmesh profile --out mocker.json [mocker flags]`: the mocker, in virtual time (its real
    scheduler driven step by step: kvmesh.sim.profiler), in about a second;
  * `kvmesh profile --worker HOST:PORT [HOST:PORT ...] --out f.json`: running workers of any
    engine, over gRPC, by timing real requests (kvmesh.planner.profiler); they should be idle.
    Several workers (a prefill and a decode worker) give one profile with each one's role;
  * `kvmesh profile --engine torch --out f.json [worker flags]` (or `--engine mocker --live`):
    starts that worker as a child process on this machine (registered in a private file
    registry, which tells its address), profiles it over gRPC, stops it.

`--role prefill|decode` profiles a worker of that role (prefill: TTFT and throughput through
PrefillRemote; decode: the decode grid). `--plot PREFIX` also writes PNGs of every curve.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvmesh.planner.profile import PerfProfile, plot_profile
from kvmesh.planner.profiler import LiveProfileSettings, profile_worker
from kvmesh.runtime.config import Flags, from_args, opt, to_argv
from kvmesh.runtime.discovery import EventKind, open_discovery
from kvmesh.runtime.errors import InvalidRequest, Unavailable
from kvmesh.runtime.modeldir import ModelDirInfo, resolve_model_dir
from kvmesh.runtime.plotting import require_matplotlib
from kvmesh.runtime.process import ChildProcess, GlobalConfig, run
from kvmesh.sim.profiler import profile_mocker
from kvmesh.workers import main as worker_main
from kvmesh.workers.config import EngineKind, WorkerConfig
from kvmesh.workers.mocker.config import MockerConfig

__all__ = ["ProfileConfig", "flags", "run_profile"]

SET_BY_PROFILE = frozenset({"host", "advertise_host", "port", "discovery", "worker_id"})
"""Worker fields `kvmesh profile` sets itself when it starts the worker."""


@dataclass
class ProfileConfig:
    """Settings of `kvmesh profile` (the worker's flags follow: its engine and role)."""

    out: str = opt("profile.json", "where to write the profile (JSON)")
    worker: list[str] = opt(
        [],
        "profile the running worker(s) at HOST:PORT over gRPC (any engine) instead; several "
        "(e.g. a prefill and a decode worker): one profile with each one's role",
    )
    live: bool = opt(
        False, "mocker: start a real mocker worker and time requests, not virtual time"
    )
    plot: str = opt("", "also write PNG plots of each curve: PREFIX-ROLE-prefill.png, ...")
    profile_isl: list[int] = opt([128, 512, 2048, 8192], "over gRPC: prompt lengths measured")
    profile_contexts: list[int] = opt([512, 2048, 8192], "over gRPC: context lengths measured")
    profile_concurrency: list[int] = opt([1, 4, 16, 64], "over gRPC: concurrencies measured")
    profile_decode_tokens: int = opt(16, "over gRPC: tokens per request on the decode grid")
    startup_timeout_s: float = opt(300.0, "how long a started worker may take to register")

    def settings(self) -> LiveProfileSettings:
        """What to measure over gRPC."""
        if not (self.profile_isl and self.profile_contexts and self.profile_concurrency):
            raise InvalidRequest("--profile-isl/-contexts/-concurrency need at least one value")
        if min(*self.profile_isl, *self.profile_contexts, *self.profile_concurrency) < 1:
            raise InvalidRequest("profile points must be >= 1")
        return LiveProfileSettings(
            isl=tuple(sorted(set(self.profile_isl))),
            contexts=tuple(sorted(set(self.profile_contexts))),
            concurrency=tuple(sorted(set(self.profile_concurrency))),
            decode_tokens=max(2, self.profile_decode_tokens),
        )


def flags() -> Flags:
    """`kvmesh profile`'s flags: its own, then the worker's (but where it listens)."""
    return Flags.of(ProfileConfig) + worker_main.ENTRY.flags.without(*SET_BY_PROFILE)


async def _spawned_worker(
    config: WorkerConfig, engine: Any, log: GlobalConfig, settings: ProfileConfig
) -> PerfProfile:
    """Start the worker, wait for its registration, profile it, stop it."""
    registry = Path(tempfile.mkdtemp(prefix="kvmesh-profile-"))
    worker = replace(
        config, host="127.0.0.1", port=0, discovery=f"file://{registry}", worker_id="profiled"
    )
    argv = [sys.executable, "-m", "kvmesh", "worker", *to_argv(log), *to_argv(worker)]
    argv += to_argv(engine)
    child = ChildProcess(argv)
    try:
        address = await _registered(f"file://{registry}", child, settings.startup_timeout_s)
        return await profile_worker(address, settings.settings())
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), config.drain_timeout_s + 10)
        except TimeoutError:
            child.send_signal(signal.SIGKILL)
            await child.wait()
        shutil.rmtree(registry, ignore_errors=True)


async def _registered(discovery: str, child: ChildProcess, timeout_s: float) -> str:
    async def first() -> str:
        async for event in open_discovery(discovery).watch("worker"):
            if event.kind is EventKind.ADDED:
                return event.instance.address
        raise Unavailable("the worker never registered")

    async def died() -> str:
        code = await child.wait()
        raise Unavailable(f"the worker exited with {code} before it registered")

    tasks = [asyncio.create_task(first()), asyncio.create_task(died())]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout_s, return_when="FIRST_COMPLETED")
        if not done:
            raise Unavailable(f"the worker did not register within {timeout_s:g} s")
        return next(iter(done)).result()
    finally:
        for t in tasks:
            t.cancel()


async def _profile_workers(addresses: list[str], settings: LiveProfileSettings) -> PerfProfile:
    """Each worker in turn, their roles merged into one profile (a later one wins a role)."""
    profiles = [await profile_worker(a, settings) for a in addresses]
    roles = {role: rp for p in profiles for role, rp in p.roles.items()}
    first = profiles[0]
    return replace(first, roles=roles, source=", ".join(p.source for p in profiles))


def run_profile(ns: argparse.Namespace) -> int:
    """`kvmesh profile`: measure, write the profile (and plots), print where."""
    config = from_args(ProfileConfig, ns)
    worker = from_args(WorkerConfig, ns)
    engine = from_args(worker_main.ENGINES[worker.engine].config, ns)
    if config.plot:
        require_matplotlib()
    if config.worker:
        profile = run(_profile_workers(config.worker, config.settings()))
    elif worker.engine is EngineKind.MOCKER and not config.live:
        assert isinstance(engine, MockerConfig)
        info = ModelDirInfo.load(resolve_model_dir(worker.model))
        profile = profile_mocker(
            engine,
            max_model_len=engine.max_model_len or info.context_length,
            model=worker.served_model_name or info.name,
        )
    else:
        profile = run(_spawned_worker(worker, engine, from_args(GlobalConfig, ns), config))
    profile.save(config.out)
    print(f"{config.out}: {profile.engine} profile ({profile.source})")
    for path in plot_profile(profile, config.plot) if config.plot else []:
        print(f"  plot: {path}")
    return 0
