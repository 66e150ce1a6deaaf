"""Bounded versions of the long load runs in tests/faults/load.py: requests at high concurrency
against `kvmesh up` with instant mockers (zero errors, frontend RSS bounded), and start-ups of
`kvmesh up --discovery etcd` (no crash, clean exit, nothing left behind)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from tests.etcd_server import ETCD_BINARY, MISSING_REASON

from .load import Up, run_round, startups

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_requests_at_high_concurrency(tmp_path: Path) -> None:
    up = Up.start(tmp_path, "--workers", "2", "--speedup-ratio", "1e9")
    try:
        up.wait_ready()
        before = up.frontend_rss_mb()
        rounds = [asyncio.run(run_round(up.base, 600, 150, 8)) for _ in range(2)]
        after = up.frontend_rss_mb()
        for r in rounds:
            assert r.statuses == {200: 600} and not r.errors, r.summary()
        assert after - before < 150, (before, after)
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def test_start_ups_with_etcd_discovery() -> None:
    if ETCD_BINARY is None:
        pytest.skip(MISSING_REASON)
    assert startups(argparse.Namespace(count=2)) == 0
