"""`kvmesh replay --prefill-workers N`: the disaggregated simulation (kvmesh.sim.disagg)
finishes every request with no block left pinned, is deterministic, accounts the transfer in
the first inter-token gap, prefills locally below the threshold, and shows up in the CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvmesh.apps.cli import main
from kvmesh.router.backend import DisaggConfig, LocalPrefill
from kvmesh.router.routing import RouterMode
from kvmesh.sim.config import ReplayConfig, ReplayError
from kvmesh.sim.disagg import simulate_disaggregated
from kvmesh.sim.main import run_replay
from kvmesh.sim.replay import simulate
from kvmesh.sim.trace import load_trace
from kvmesh.workers.mocker import MockerConfig

from .test_replay import synthetic_rows, write_trace

pytestmark = pytest.mark.unit


@pytest.fixture
def trace_path(tmp_path: Path) -> str:
    return write_trace(tmp_path / "t.jsonl", synthetic_rows(120, gap_ms=60.0))


def config(trace: str, local_prefill_tokens: int = 512, **kw: object) -> ReplayConfig:
    mocker = MockerConfig(block_size=64, num_gpu_blocks=4096)
    disagg = DisaggConfig(disagg_local_prefill_tokens=local_prefill_tokens)
    return ReplayConfig(trace=trace, workers=4, mocker=mocker, disagg=disagg, **kw)  # type: ignore[arg-type]


def test_every_request_finishes_and_nothing_stays_pinned(trace_path: str) -> None:
    cfg = config(trace_path, 0, prefill_workers=2)
    trace = load_trace(trace_path)
    result, stats = simulate_disaggregated(trace, cfg)
    assert result.requests == 120 and result.rejected == result.unfinished == 0
    assert result.mode == "kv-disagg-2p2d"
    assert stats.remote_prefills == 120 and stats.local_prefills_total == 0
    assert stats.blocks_in_use_at_end == 0
    assert stats.kv_transfer_bytes > 0
    assert [w.worker for w in result.per_worker] == ["p0", "p1", "d0", "d1"]
    again, _ = simulate_disaggregated(trace, cfg)
    assert again.ttft_ms == result.ttft_ms and again.itl_ms == result.itl_ms  # deterministic


def test_the_transfer_shows_in_the_first_token_gap(trace_path: str) -> None:
    trace = load_trace(trace_path, limit=1)  # one request alone: no queueing anywhere
    slow = MockerConfig(block_size=64, num_gpu_blocks=4096, kv_transfer_latency_ms=500.0)
    fast = MockerConfig(block_size=64, num_gpu_blocks=4096, kv_transfer_latency_ms=0.0)
    remote = DisaggConfig(disagg_local_prefill_tokens=0)
    base = ReplayConfig(trace=trace_path, workers=2, prefill_workers=1, mocker=fast, disagg=remote)
    delayed = ReplayConfig(
        trace=trace_path, workers=2, prefill_workers=1, mocker=slow, disagg=remote
    )
    a, _ = simulate_disaggregated(trace, base)
    b, _ = simulate_disaggregated(trace, delayed)
    assert b.ttft_ms == a.ttft_ms  # the first token comes from the prefill worker
    assert b.itl_ms.max - a.itl_ms.max == pytest.approx(500.0, abs=1e-6)


def test_short_uncached_parts_prefill_on_the_decode_worker(trace_path: str) -> None:
    trace = load_trace(trace_path)
    result, stats = simulate_disaggregated(trace, config(trace_path, 10**9, prefill_workers=1))
    assert stats.remote_prefills == 0
    assert stats.local_prefills == {
        **dict.fromkeys(LocalPrefill, 0),
        LocalPrefill.SHORT_PROMPT: 120,
    }
    assert result.per_worker[0].requests == 0  # the prefill worker never worked
    assert stats.blocks_in_use_at_end == 0
    # Same work as aggregated kv routing over the three decode workers.
    agg = simulate(
        trace,
        ReplayConfig(trace=trace_path, workers=3, mocker=config(trace_path).mocker),
        RouterMode.KV,
    )
    assert result.requests == agg.requests == 120


def test_cli_compares_aggregated_and_disaggregated(trace_path: str) -> None:
    out = io.StringIO()
    assert run_replay(config(trace_path, prefill_workers=1, json=True), out=out) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["mode"] for r in rows] == ["kv", "kv-disagg-1p3d"]
    assert rows[1]["disagg"]["remote_prefills"] + rows[1]["disagg"]["local_prefills"] == 120
    text = io.StringIO()
    run_replay(config(trace_path, prefill_workers=1, progress=False), out=text)
    assert "kv-disagg-1p3d" in text.getvalue() and "GB of KV moved" in text.getvalue()
    with pytest.raises(ReplayError):
        config(trace_path, prefill_workers=4)


def test_a_saturated_prefill_pool_sends_prefills_to_the_decode_workers(trace_path: str) -> None:
    """The replay decides with the gateway's conditional disaggregation, saturation included:
    with at most one prefill in flight per prefill worker, a burst overflows to local prefill."""
    trace = load_trace(trace_path)
    free, free_stats = simulate_disaggregated(trace, config(trace_path, 0, prefill_workers=1))
    capped_cfg = config(trace_path, 0, prefill_workers=1)
    capped_cfg.disagg.disagg_max_prefill_inflight = 1
    capped, stats = simulate_disaggregated(trace, capped_cfg)
    assert free_stats.remote_prefills == 120 and free_stats.local_prefills_total == 0
    saturated = stats.local_prefills[LocalPrefill.PREFILL_SATURATED]
    assert 0 < saturated < 120
    assert stats.remote_prefills + saturated == 120
    assert stats.local_prefills_total == saturated
    assert capped.requests == free.requests == 120 and stats.blocks_in_use_at_end == 0
    assert capped.per_worker[0].requests == stats.remote_prefills  # p0 got only those


def test_cli_takes_the_gateways_disagg_flags(
    trace_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", trace_path, "--workers", "2", "--prefill-workers", "1"]
    with pytest.raises(SystemExit) as info:
        main(
            [
                *argv,
                "--disagg-local-prefill-tokens",
                "0",
                "--disagg-max-prefill-inflight",
                "1",
                "--json",
            ]
        )
    assert info.value.code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    disagg = rows[1]["disagg"]
    assert (
        disagg["local_prefills"] > 0 and disagg["remote_prefills"] + disagg["local_prefills"] == 120
    )
    with pytest.raises(SystemExit) as info:
        main([*argv, "--disagg-local-prefill-tokens", "-1"])
    assert info.value.code == 2
    assert "disagg thresholds must be >= 0" in capsys.readouterr().err
