"""Process plumbing every entry point shares: what a process entry point declares (`Entry`), the
flags every command takes (`GlobalConfig`), running a coroutine on uvloop, waiting for a signal,
and starting child processes without fork (`ChildProcess`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvmesh.runtime.config import Flags, opt

T = TypeVar("T")


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


@dataclass
class GlobalConfig:
    """Flags every kvmesh command takes, before or after the command's name."""

    log_level: LogLevel = opt(
        LogLevel.INFO, "log verbosity (kvmesh up passes it to the processes it starts)"
    )


def setup_logging(config: GlobalConfig) -> None:
    """Log to stderr at the configured level."""
    logging.basicConfig(
        level=config.log_level.value.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on uvloop (asyncio's loop if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        return asyncio.run(coro)
    return uvloop.run(coro)


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class ChildProcess:
    """A child process in its own session (Ctrl-C reaches only its parent), started with
    posix_spawn, never fork.

    A parent with live gRPC threads must not fork: gRPC's fork handlers would run (or, with
    calls in flight, refuse to and log `skipping fork() handlers`), and the child would start
    as a copy of a process holding gRPC's threads and channels. posix_spawn starts the child
    from exec without copying the parent or running any fork handler (glibc: a vfork-style
    clone), and `exited` is driven by a pidfd on the running event loop (uvloop or asyncio's),
    with no SIGCHLD handler. Create it on the loop that waits for it.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Start `argv` with this process's environment plus `env` (e.g. secrets, which a
        command line would show to every user of the machine)."""
        self.pid = os.posix_spawn(
            argv[0],
            list(argv),
            {**os.environ, **env} if env else os.environ,
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
