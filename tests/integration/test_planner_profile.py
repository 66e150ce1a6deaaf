"""`kvmesh profile` over gRPC against a real worker process (here a mocker it starts itself),
checked against the mocker's virtual-time profile: what the live worker shows can only be
slower than the simulated step times it sleeps, and not by much."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.planner.profile import PerfProfile
from kvmesh.runtime.types import Role
from kvmesh.sim.profiler import profile_mocker
from kvmesh.workers.mocker.config import MockerConfig

pytestmark = pytest.mark.integration


def test_profile_a_live_worker_over_grpc(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    argv = [sys.executable, "-m", "kvmesh", "profile", "--live", "--out", str(out),
            "--profile-isl", "128", "1024", "--profile-contexts", "256",
            "--profile-concurrency", "1", "4", "--profile-decode-tokens", "8",
            "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    live = PerfProfile.load(out)
    assert live.engine == "mocker" and live.source.startswith("grpc 127.0.0.1:")
    virtual = profile_mocker(MockerConfig(), max_model_len=2048)
    lp, vp = live.prefill_curve(Role.AGGREGATED), virtual.prefill_curve(Role.AGGREGATED)
    for isl, ttft in zip(lp.isl, lp.ttft_ms, strict=True):
        sim = vp.ttft_at(isl)
        assert 0.9 * sim <= ttft <= 4 * sim + 100, (isl, ttft, sim)  # a loaded CI host
    ld, vd = live.decode_grid(Role.AGGREGATED), virtual.decode_grid(Role.AGGREGATED)
    for conc in ld.concurrency:
        itl, sim = ld.itl_at(256, conc), vd.itl_at(256, conc)
        assert 0.9 * sim <= itl <= 4 * sim + 25, (conc, itl, sim)
    assert lp.throughput_tokens_per_s[-1] > 0
