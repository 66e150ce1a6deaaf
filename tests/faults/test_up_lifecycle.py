"""Lifecycle of `kvmesh up` as a user meets it: Ctrl-C with streams in flight (drain, visible),
a second Ctrl-C (forced: streams end with an error event and [DONE]), `kill -9` of `up` itself,
stdout gone (a closed pipe), and a port already in use. After each, no process `up` started
survives."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.runtime.ports import free_port
from tests.procs import frontend_ready, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _children(pid: int) -> set[int]:
    """Pids whose parent is `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


class Up:
    """`kvmesh up` with one worker at a realistic pace; stdout and stderr on one pipe, read by a
    thread until `close_output` closes its read end."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self._out, w = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh",
                "up",
                "--log-level",
                "warning",
                "--http-port",
                str(self.port),
                "--workers",
                "1",
                "--speedup-ratio",
                "1",
                *extra,
            ],
            stdout=w,
            stderr=w,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        os.close(w)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.children: set[int] = set()

    def _read(self) -> None:
        try:
            while chunk := os.read(self._out, 65536):
                self.lines.append(chunk.decode(errors="replace"))
        except OSError:
            pass  # closed by close_output

    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self) -> None:
        poll(
            lambda: frontend_ready(self.port) or self.proc.poll() is not None,
            90,
            "kvmesh up to serve",
        )
        assert self.proc.poll() is None, self.output()
        poll(lambda: "Press Ctrl-C" in self.output(), 10, "the banner")
        self.children = _children(self.proc.pid)
        assert len(self.children) == 2, self.children  # the frontend and one worker

    def close_output(self) -> None:
        """The reader of up's stdout goes away (as `kvmesh up | tee` after Ctrl-C)."""
        os.close(self._out)

    def kill_all(self) -> None:
        for pid in _alive(self.children | {self.proc.pid}):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up_factory() -> Iterator[list[Up]]:
    made: list[Up] = []
    yield made
    for u in made:
        u.kill_all()
        u.proc.wait(10)
        with contextlib.suppress(OSError):
            os.close(u._out)


class Stream:
    """One streaming chat completion read on a thread: its SSE data lines."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.events: list[str] = []
        self.error: BaseException | None = None
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._thread = threading.Thread(target=self._run, args=(port, body), daemon=True)
        self._thread.start()

    def _run(self, port: int, body: dict[str, object]) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[6:])
            conn.close()
        except BaseException as exc:
            self.error = exc

    def tokens(self) -> int:
        return sum(1 for e in self.events if e.startswith("{") and '"content"' in e)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"


def _ended(up: Up, timeout_s: float) -> int:
    code = up.proc.wait(timeout_s)
    poll(lambda: not _alive(up.children), 15, "every child of kvmesh up to exit")
    return code


def test_ctrl_c_drains_streams_with_stdout_gone(up_factory: list[Up]) -> None:
    """Ctrl-C with streams in flight and the reader of up's output gone: the streams finish
    (every token, finish_reason, [DONE]), `up` exits 0, no process survives."""
    up = Up()
    up_factory.append(up)
    up.wait_up()
    streams = [Stream(up.port, 120) for _ in range(3)]
    poll(lambda: all(s.tokens() >= 5 for s in streams), 60, "tokens on every stream")
    up.close_output()
    up.proc.send_signal(signal.SIGINT)
    for s in streams:
        s.join(60)
        assert s.error is None, s.error
        assert s.events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in s.events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 120
    assert _ended(up, 60) == 0


def test_second_ctrl_c_forces_and_streams_end_with_an_error_event(up_factory: list[Up]) -> None:
    """Ctrl-C says what it waits for; a second Ctrl-C ends the streams at once with an error
    event and [DONE], and `up` exits non-zero with no process left."""
    up = Up()
    up_factory.append(up)
    up.wait_up()
    stream = Stream(up.port, 1500)
    poll(lambda: stream.tokens() >= 5, 60, "tokens on the stream")
    up.proc.send_signal(signal.SIGINT)
    poll(lambda: "Ctrl-C again to force" in up.output(), 15, "the drain to be announced")
    assert "frontend" in up.output().split("stopping:", 1)[1]
    time.sleep(0.5)
    up.proc.send_signal(signal.SIGINT)
    stream.join(30)
    assert stream.error is None, stream.error
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert stream.tokens() < 1500
    assert _ended(up, 30) == 1
    assert "forced" in up.output()


def test_kill_9_of_up_takes_the_mesh_down(up_factory: list[Up]) -> None:
    """`kill -9` of `kvmesh up`: its children get SIGTERM from the kernel and exit; nothing keeps
    serving."""
    up = Up()
    up_factory.append(up)
    up.wait_up()
    up.proc.kill()
    up.proc.wait(10)
    poll(lambda: not _alive(up.children), 60, "every child of the killed kvmesh up to exit")
    assert not frontend_ready(up.port)


def test_a_port_in_use_fails_fast_with_one_line(tmp_path: Path) -> None:
    """The HTTP port is taken: one clear line, exit 1, no banner, nothing started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "kvmesh", "up", "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"kvmesh up: port in use: --http-port {port} on 127.0.0.1: Address already in use"
    ]
    assert time.monotonic() - started < 30


def test_a_hung_worker_process_is_replaced(up_factory: list[Up]) -> None:
    """A worker that stops answering (SIGSTOP) is killed and a new one serves in its place."""
    up = Up()
    up_factory.append(up)
    up.wait_up()
    frontend_pid = max(up.children)  # started after the worker
    (worker,) = up.children - {frontend_pid}
    os.kill(worker, signal.SIGSTOP)
    poll(lambda: not _alive({worker}), 30, "the hung worker to be killed")
    # Said before the kill; the thread reading up's output may not have read it yet.
    poll(lambda: "stopped answering health checks" in up.output(), 10, "the kill to be told")
    poll(lambda: len(_children(up.proc.pid)) == 2, 30, "a replacement worker")
    poll(lambda: frontend_ready(up.port), 60, "the mesh to serve again")
    stream = Stream(up.port, 20)
    stream.join(60)
    assert stream.error is None and stream.events[-1] == "[DONE]"
    up.children = _children(up.proc.pid)
