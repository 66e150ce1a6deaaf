"""End to end: `kvmesh up` (frontend + 2 mocker workers as real processes) and the official
`openai` client, over loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from kvmesh.runtime.ports import free_port

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


class Mesh:
    def __init__(self, proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
        self.proc, self.base, self.log = proc, base, log
        self._client: openai.OpenAI | None = None

    def client(self) -> openai.OpenAI:
        """One OpenAI client per mesh (closed by stop_mesh)."""
        if self._client is None:
            self._client = openai.OpenAI(
                base_url=self.base + "/v1", api_key="unused", max_retries=0
            )
        return self._client

    def metrics(self, *prefixes: str) -> dict[str, float]:
        """The gateway's /metrics samples (name{labels} -> value) whose names start with one of
        `prefixes` (all of them when none is given)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and line.startswith(prefixes or ("",)):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def wait_workers(self, timeout_s: float = 60.0, **roles: int) -> None:
        """Wait until the gateway's pool has joined at least this many workers of each role
        (`kvmesh_router_workers`): /health is 200 with one worker of any role, and a request
        sent before a prefill worker joined prefills locally."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics("kvmesh_router_workers{")
            have = {role: sum(v for k, v in m.items() if f'role="{role}"' in k) for role in roles}
            if all(have[r] >= n for r, n in roles.items()):
                return
            assert time.monotonic() < deadline, (have, self.log.read_text())
            time.sleep(0.1)


def start_mesh(
    tmp: Path, *args: str, ready_timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> Mesh:
    port = free_port()
    log = tmp / f"up-{port}.log"
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh",
                "up",
                "--log-level",  # a global flag, after the command's name
                "warning",
                "--http-port",
                str(port),
                "--workers",
                "2",
                "--speedup-ratio",
                "1000000",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while _get(base + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            # the whole session (its workers too), reaped: no process left running, and no
            # "still running" ResourceWarning from this Popen failing a later test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"kvmesh up did not become healthy:\n{log.read_text()}")
        time.sleep(0.2)
    return Mesh(proc, base, log)


def stop_mesh(mesh: Mesh) -> int:
    if mesh._client is not None:
        mesh._client.close()
    mesh.proc.send_signal(signal.SIGINT)
    try:
        return mesh.proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(mesh.proc.pid, signal.SIGKILL)
        raise


MAX_N = 5  # `kvmesh up --max-n`: a frontend flag `up` passes through


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("up"), "--max-n", str(MAX_N))
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def test_models_and_health(mesh: Mesh) -> None:
    models = mesh.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _get(mesh.base + "/live")[0] == 200
    status, body = _get(mesh.base + "/metrics")
    assert status == 200 and b"kvmesh" in body


def test_streamed_chat_with_usage(mesh: Mesh) -> None:
    client = mesh.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    unary = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert unary.choices[0].message.content == text, "greedy output is deterministic"
    assert unary.usage is not None and unary.usage.prompt_tokens == usage.prompt_tokens
    assert unary.choices[0].finish_reason == "length"


def test_text_completions_usage_counts_prompt_tokens(mesh: Mesh, tok: Tokenizer) -> None:
    client = mesh.client()
    prompt = "The quick brown fox"
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert res.usage is not None and res.usage.completion_tokens == 5
    n_prompt = len(tok.encode(prompt, add_special_tokens=False).ids)
    assert res.usage.prompt_tokens in (n_prompt, n_prompt + 1)  # + BOS if the tokenizer adds one
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == res.choices[0].text


def test_seeded_sampling_and_n(mesh: Mesh) -> None:
    client = mesh.client()
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.8, seed=42)
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(n=3, **kw)  # type: ignore[call-overload]
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage is not None and many.usage.completion_tokens == 24


def test_frontend_flags_reach_the_frontend(mesh: Mesh) -> None:
    with pytest.raises(openai.BadRequestError, match=f"'n' must be <= {MAX_N}"):
        mesh.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, n=MAX_N + 1
        )


def test_no_grpc_fork_handler_lines(mesh: Mesh) -> None:
    """`kvmesh up` starts its children without fork, so gRPC has no fork handlers to skip."""
    # up prints its banner once its own health poll sees the gateway, which may be after the
    # fixture's poll did (a loaded CI run read an empty log).
    deadline = time.monotonic() + 30
    while "kvmesh is up" not in (log := mesh.log.read_text()):
        assert time.monotonic() < deadline, log
        time.sleep(0.1)
    assert "fork" not in log, log


def test_bad_requests_get_openai_errors(mesh: Mesh) -> None:
    client = mesh.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 6000, max_tokens=4)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    req = urllib.request.Request(
        mesh.base + "/v1/chat/completions",
        data=b"{not json",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=5)
    assert http.value.code == 400
    assert "error" in json.loads(http.value.read())


def test_standalone_router_process(tiny_model: Path, tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path, "--router-process")
    try:
        res = mesh.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert res.usage is not None and res.usage.completion_tokens == 4
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()


def test_scale_the_worker_pool(tiny_model: Path, tmp_path: Path) -> None:
    """ScalingService of `kvmesh up`: scale up, scale down (drain), bad requests rejected."""
    import grpc

    from kvmesh.api.common.v1 import common_pb2 as cpb
    from kvmesh.api.scaling.v1 import scaling_service_pb2 as spb
    from kvmesh.api.scaling.v1 import scaling_service_pb2_grpc as spb_grpc

    control = free_port()
    mesh = start_mesh(tmp_path, "--control-port", str(control))
    channel = grpc.insecure_channel(f"127.0.0.1:{control}")
    stub = spb_grpc.ScalingServiceStub(channel)

    def pool() -> spb.PoolStatus:
        return stub.ListPools(spb.ListPoolsRequest()).pools[0]

    def wait_for(ready: int, draining: int = 0) -> spb.PoolStatus:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            p = pool()
            if p.ready_replicas == ready and p.draining_replicas == draining:
                return p
            time.sleep(0.1)
        raise AssertionError(f"pool never reached {ready} ready: {pool()}")

    try:
        wait_for(2)
        up = stub.Scale(spb.ScaleRequest(role=cpb.WORKER_ROLE_AGGREGATED, replicas=3))
        assert (up.previous_replicas, up.target_replicas) == (2, 3)
        assert wait_for(3).target_replicas == 3
        stub.Scale(spb.ScaleRequest(role=cpb.WORKER_ROLE_AGGREGATED, replicas=1, reason="test"))
        wait_for(1)
        res = mesh.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert res.usage is not None and res.usage.completion_tokens == 4
        with pytest.raises(grpc.RpcError) as info:
            stub.Scale(spb.ScaleRequest(role=cpb.WORKER_ROLE_PREFILL, replicas=1))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            stub.Scale(spb.ScaleRequest(model="other", role=cpb.WORKER_ROLE_AGGREGATED))
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            stub.Scale(spb.ScaleRequest(role=cpb.WORKER_ROLE_AGGREGATED, replicas=1000))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
        assert stop_mesh(mesh) == 0, mesh.log.read_text()


def test_kv_routing_sends_shared_prefixes_to_the_same_worker(mesh: Mesh) -> None:
    """The default router is KV-aware: a long shared prefix is served from one worker's cache,
    visible as prompt_tokens_details.cached_tokens and in the router metrics."""
    client = mesh.client()
    prefix = "alpha beta gamma delta " * 100
    cached = []
    for i in range(4):
        res = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{prefix} question {i}"}],
            max_tokens=2,
        )
        assert res.usage is not None and res.usage.prompt_tokens_details is not None
        cached.append(res.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] == 0 or cached[0] < cached[1]
    assert all(c >= 256 for c in cached[1:]), cached  # 4+ shared 64-token blocks every time
    _, body = _get(mesh.base + "/metrics")
    assert b"kvmesh_router_overhead_seconds_bucket" in body
