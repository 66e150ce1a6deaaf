"""Process plumbing every entry point shares: what a process entry point declares (`Entry`), the
flags every command takes (`GlobalConfig`), running a coroutine on uvloop, waiting for a signal,
starting child processes without fork (`ChildProcess`), ending with the parent that started
them (`die_with_parent`), and freezing the start-up heap (`freeze_heap`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvmesh.runtime.config import Flags, opt, to_argv
from kvmesh.runtime.telemetry import LOG_CONTEXT

T = TypeVar("T")

PARENT_PID_ENV = "KVMESH_PARENT_PID"
"""Set by ChildProcess to the pid of the process that started the child (`die_with_parent`)."""

CORE_SLOT_ENV = "KVMESH_CORE_SLOT"
"""`i/n`: `kvmesh up` started this worker as one of n sharing this machine's cores, in slot i.
Engines that bind their threads to cores take slot i's share (`core_slice`) instead of binding
every worker to the same ones (vLLM on CPUs: kvmesh.workers.adapters.vllm_adapter)."""


def core_slice(slot: str | None, cores: Iterable[int]) -> list[int] | None:
    """Slot `i/n`'s cores among `cores`: the i-th of n equal runs of them in order (the rest of
    a division left out). None: no slot, a malformed one, a single slot, or fewer cores than
    slots (nothing to split)."""
    if not slot:
        return None
    index, _, count = slot.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        return None
    ordered = sorted(cores)
    if n < 2 or not 0 <= i < n or len(ordered) < n:
        return None
    share = len(ordered) // n
    return ordered[i * share : (i + 1) * share]


def usable_cpus() -> int:
    """The CPUs this process may use: those it may run on (affinity), fewer where its cgroup's
    CPU quota allows less (a container's CPU limit: cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus or 1, math.ceil(quota))
    return max(1, cpus or 1)


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time per period the cgroup mounted at `root` allows (None: no quota, or
    no cgroup)."""
    with contextlib.suppress(OSError, ValueError):
        quota, _, period = (root / "cpu.max").read_text().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        v1 = root / "cpu"
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota_us <= 0 else quota_us / int((v1 / "cpu.cfs_period_us").read_text())
    return None


_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Entry:
    """A process entry point, in its component: `kvmesh <name>` runs `main` with the flags of
    `flags` (the config dataclasses `main` builds from them)."""

    name: str
    help: str
    flags: Flags
    main: Callable[[argparse.Namespace], int]
    """Runs the process until it stops; returns its exit code."""


class LogLevel(enum.Enum):
    """Verbosity of a process's log."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.Enum):
    """How log lines are written."""

    TEXT = "text"
    JSON = "json"
    """One JSON object per line, with trace_id, span_id and request_id on every line logged
    while a request is handled (kvmesh.runtime.telemetry.LOG_CONTEXT)."""


@dataclass
class GlobalConfig:
    """Flags every kvmesh command takes, before or after the command's name (kvmesh up passes
    them to the processes it starts)."""

    log_level: LogLevel = opt(LogLevel.INFO, "log verbosity")
    log_format: LogFormat = opt(
        LogFormat.TEXT,
        "text, or json: one object per line with trace_id, span_id and request_id",
    )
    log_content: bool = opt(
        False,
        "log each request's prompt and output text (at INFO; for debugging: never on by "
        "default, prompts and outputs stay out of logs otherwise)",
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the request's trace_id,
    span_id and request_id when one is being handled, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = LOG_CONTEXT.get()
        if ctx is not None:
            if ctx.trace_id:
                out["trace_id"] = ctx.trace_id
                out["span_id"] = ctx.span_id
            if ctx.request_id:
                out["request_id"] = ctx.request_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(config: GlobalConfig) -> None:
    """Log to stderr at the configured level and format."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level.value.upper(), handlers=[handler])


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on uvloop (asyncio's loop if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        return asyncio.run(coro)
    return uvloop.run(coro)


def freeze_heap() -> None:
    """Move every object alive now out of the collector's sight, once a process has started.

    What a serving process imports and builds at start-up (transformers, tokenizers, protobuf
    descriptors, an engine: up to millions of objects) lives as long as the process. Left to the
    collector, every full collection walks all of it: pauses of 0.1-1.2 s were measured in a vLLM
    worker on two cores, with the outputs of every stream waiting behind them. Objects made
    later are collected as usual. vLLM's own server does the same after start-up. The youngest
    generation is collected every YOUNG_OBJECTS (net) objects from then on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])


YOUNG_OBJECTS = 10_000
"""Container objects made (net) between two collections of the youngest generation, set by
`freeze_heap`. Python's 700 is about seven requests' worth at a gateway: what a request makes
and the spans kept for the exporter's next batch outlive that and get walked again by the older
generations' collections. At 10,000 most of it is gone (refcounts) before the collector looks;
callgrind of `kvmesh up` (tests/benchmarks/bench_tracing_cpu.sh) with tracing at 100 %, one run
each (runs spread about +-1 point): the frontend's extra instructions per request -9 %, the
workers' -22 %; no change with tracing off."""


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM (call it again to wait for the next one)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def die_with_parent() -> None:
    """In a process a ChildProcess started (PARENT_PID_ENV set): get SIGTERM when that parent
    dies, however it dies (`kill -9` included), so the process drains and exits instead of
    serving on under PID 1. Children run in their own sessions, so a terminal's signals never
    reach them; this is what ties them to their parent. Linux: the kernel's parent-death signal
    (prctl PR_SET_PDEATHSIG); elsewhere a thread watching the parent pid. No-op otherwise."""
    value = os.environ.pop(PARENT_PID_ENV, "")
    if not value.isdigit():
        return
    parent = int(value)
    armed = False
    if sys.platform == "linux":
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def kvmesh_argv(command: str, *configs: Any) -> list[str]:
    """The argv of `kvmesh <command>` (this interpreter) with the non-default fields of
    `configs` as flags (a GlobalConfig among them too: the global flags follow the command)."""
    return [sys.executable, "-m", "kvmesh", command, *(a for c in configs for a in to_argv(c))]


class ChildProcess:
    """A child process in its own session (Ctrl-C reaches only its parent), started with
    posix_spawn, never fork.

    A parent with live gRPC threads must not fork: gRPC's fork handlers would run (or, with
    calls in flight, refuse to and log `skipping fork() handlers`), and the child would start
    as a copy of a process holding gRPC's threads and channels. posix_spawn starts the child
    from exec without copying the parent or running any fork handler (glibc: a vfork-style
    clone), and `exited` is driven by a pidfd on the running event loop (uvloop or asyncio's),
    with no SIGCHLD handler. Create it on the loop that waits for it. The child gets SIGTERM when
    this process dies (PARENT_PID_ENV: a kvmesh child calls `die_with_parent`).
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Start `argv` with this process's environment plus `env` (e.g. secrets, which a
        command line would show to every user of the machine)."""
        self.pid = os.posix_spawn(
            argv[0],
            list(argv),
            {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
            setsid=True,
            setsigmask=(),
            # As subprocess does: Python ignores these, and an ignored signal stays ignored
            # across exec.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
        self.returncode: int | None = None
        """The exit code once the child has exited (-N: killed by signal N), else None."""
        self._exited = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._pidfd = -1
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3, macOS): alive() polls
            pass
        else:
            self._pidfd = pidfd
            self._loop.add_reader(pidfd, self._reap)

    def _reap(self) -> None:
        if self.returncode is not None:
            return
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        self._exited.set()

    def alive(self) -> bool:
        """Whether the child has not exited yet."""
        if self._pidfd < 0:
            self._reap()
        return self.returncode is None

    def send_signal(self, sig: int) -> None:
        """Send `sig` to a child that has not exited (it cannot reach a reused pid)."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    async def wait(self) -> int:
        """Wait for the child to exit; returns its exit code."""
        while self.alive():
            if self._pidfd >= 0:
                await self._exited.wait()
            else:
                await asyncio.sleep(0.05)
        assert self.returncode is not None
        return self.returncode
