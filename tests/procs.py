"""kvmesh processes for integration tests: start one with its output in a log file, stop it,
read its log; `poll`, to wait for a condition with a deadline; `frontend_ready`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def poll(fn: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Call `fn` until it returns something other than None/False; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def frontend_ready(port: int) -> bool:
    """Whether the frontend on 127.0.0.1:`port` answers /health with 200 (a worker is live)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Proc:
    """One kvmesh process, its output in a log file.

    `wrap`: a command prefix (e.g. `ip netns exec NS` to run it in another network namespace;
    `ip netns exec` execs the command, so signals reach kvmesh itself).
    """

    def __init__(
        self, name: str, argv: list[str], logdir: Path, *, wrap: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.argv = argv
        self.wrap = list(wrap)
        self.log = logdir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "kvmesh", "--log-level", "warning", *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self) -> str:
        try:
            return f"--- {self.name}\n" + self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""
