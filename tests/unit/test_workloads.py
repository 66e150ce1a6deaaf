"""Generated workloads (kvmesh.sim.workloads, `kvmesh workload`): deterministic, with the prefix
sharing and arrival patterns their documentation promises."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from kvmesh.apps.cli import main
from kvmesh.sim.config import ReplayError
from kvmesh.sim.trace import TraceRequest, load_trace, write_trace
from kvmesh.sim.workloads import (
    ArrivalKind,
    WorkloadConfig,
    WorkloadKind,
    arrival_times,
    generate,
    sharing,
    with_sessions,
)

pytestmark = pytest.mark.unit

BS = 64


def azure_dir(tmp_path: Path, rows: int = 400, seed: int = 1) -> Path:
    """A small Azure-format trace pair (conv and code) with growing-enough prompts."""
    rng = random.Random(seed)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(rows):
        sec = 10 + i // 4
        lines.append(
            f"2023-11-16 18:{sec // 60:02d}:{sec % 60:02d}.{i % 4}000000,"
            f"{rng.randint(50, 4000)},{rng.randint(1, 300)}"
        )
    for name in ("conv", "code"):
        (tmp_path / f"AzureLLMInferenceTrace_{name}.csv").write_text("\n".join(lines) + "\n")
    return tmp_path


def full_blocks(r: TraceRequest) -> list[int]:
    return r.hash_ids[: r.input_length // BS]


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_generation_is_deterministic_in_the_seed(kind: WorkloadKind, tmp_path: Path) -> None:
    src = tmp_path / "mooncake.jsonl"
    write_trace(generate(WorkloadConfig(kind=WorkloadKind.TENANTS, requests=60)), str(src))
    kw = {"kind": kind, "requests": 60, "azure_dir": str(azure_dir(tmp_path)), "source": str(src)}
    a = generate(WorkloadConfig(**kw))  # type: ignore[arg-type]
    b = generate(WorkloadConfig(**kw))  # type: ignore[arg-type]
    c = generate(WorkloadConfig(seed=9, **kw))  # type: ignore[arg-type]
    assert a.requests == b.requests and len(a.requests) == 60
    assert a.requests != c.requests
    times = [r.timestamp_ms for r in a.requests]
    assert times == sorted(times) and times[0] == 0
    for r in a.requests:  # (the mooncake source here has 64-token blocks too)
        assert len(r.hash_ids) == -(-r.input_length // BS)


def test_conversations_keep_the_azure_lengths_and_grow_turn_by_turn(tmp_path: Path) -> None:
    cfg = WorkloadConfig(kind=WorkloadKind.CONV, requests=400, azure_dir=str(azure_dir(tmp_path)))
    rows = load_trace(str(tmp_path / "AzureLLMInferenceTrace_conv.csv"), 400).requests
    trace = generate(cfg)
    assert [(r.input_length, r.output_length) for r in trace.requests] == [
        (r.input_length, r.output_length) for r in rows
    ]
    # A later turn repeats every full block of an earlier prompt of its session, and is long
    # enough for that prompt, its output and a new message. Sharing more full blocks than the
    # longest system prompt (1,200 tokens) holds can only be such a continuation.
    turns = 0
    for j, r in enumerate(trace.requests):
        for q in trace.requests[:j]:
            prev = full_blocks(q)
            if len(prev) > 1200 // BS and r.hash_ids[: len(prev)] == prev:
                assert r.input_length >= q.input_length + q.output_length + 16
                assert r.timestamp_ms - q.timestamp_ms >= 2000  # think time
                turns += 1
    assert turns > 20
    # New sessions start on one of the shared system prompts: few distinct first blocks.
    firsts = {r.hash_ids[0] for r in trace.requests if r.input_length >= 1300}
    assert len(firsts) <= 32
    s = sharing(trace, BS)
    assert 0.2 < s["prefix_bound_tokens"] < 0.9


def test_sessions_never_continue_into_a_shorter_prompt() -> None:
    rows = [TraceRequest(1000.0 * i, n, 50, []) for i, n in enumerate([500, 400, 3000, 3000, 90])]
    cfg = WorkloadConfig(
        kind=WorkloadKind.CONV, follow=1.0, system_prompts=1, system_tokens=[128, 128]
    )
    trace = with_sessions(rows, cfg, random.Random(0), "x")
    system = trace.requests[0].hash_ids[:2]
    assert all(r.hash_ids[:2] == system for r in trace.requests[:4])
    # request 2 continues request 0 (the only one a full think time old); 4 is too short for
    # any session and starts a new one, sharing the system prompt's full blocks it covers
    assert trace.requests[2].hash_ids[: 500 // BS] == full_blocks(trace.requests[0])
    assert trace.requests[4].hash_ids[:1] == system[:1]


def test_agent_steps_extend_their_previous_step(tmp_path: Path) -> None:
    trace = generate(WorkloadConfig(kind=WorkloadKind.AGENTIC, requests=300))
    extends = 0
    for j, r in enumerate(trace.requests):
        for q in reversed(trace.requests[:j]):
            prev = full_blocks(q)
            if (
                len(prev) > 40
                and r.hash_ids[: len(prev)] == prev
                and len(r.hash_ids) > len(prev) + 1
            ):
                assert r.timestamp_ms > q.timestamp_ms
                assert r.input_length > q.input_length + q.output_length
                extends += 1
                break
    assert extends > 150
    assert sharing(trace, BS)["prefix_bound_tokens"] > 0.7
    assert max(r.input_length for r in trace.requests) <= 32768


def test_tenants_share_their_prefix() -> None:
    cfg = WorkloadConfig(kind=WorkloadKind.TENANTS, requests=500, tenants=10)
    trace = generate(cfg)
    assert len({r.hash_ids[0] for r in trace.requests}) <= 10
    assert sharing(trace, BS)["prefix_bound_tokens"] > 0.8


def test_arrivals_keep_their_mean_and_bursts_are_bursty() -> None:
    n, rate = 20_000, 10.0
    steady = arrival_times(ArrivalKind.STEADY, n, rate, random.Random(1))
    bursty = arrival_times(ArrivalKind.BURSTY, n, rate, random.Random(1), burst_s=5.0)
    for times in (steady, bursty):
        assert times == sorted(times) and len(times) == n
        assert (n - 1) / times[-1] == pytest.approx(rate, rel=0.15)

    def dispersion(times: list[float]) -> float:  # variance / mean of arrivals per second
        counts = [0] * (int(times[-1]) + 1)
        for t in times:
            counts[int(t)] += 1
        return statistics.pvariance(counts) / statistics.mean(counts)

    assert dispersion(steady) == pytest.approx(1.0, abs=0.2)  # Poisson
    assert dispersion(bursty) > 5.0
    with pytest.raises(ValueError):
        arrival_times(ArrivalKind.TRACE, 3, 1.0, random.Random())


def test_mooncake_retiming_keeps_the_requests(tmp_path: Path) -> None:
    src = tmp_path / "m.jsonl"
    write_trace(generate(WorkloadConfig(kind=WorkloadKind.TENANTS, requests=300)), str(src))
    original = load_trace(str(src)).requests
    for arrival in ArrivalKind:
        got = generate(
            WorkloadConfig(
                kind=WorkloadKind.MOONCAKE, requests=300, source=str(src), arrival=arrival
            )
        )
        assert [(r.input_length, r.hash_ids) for r in got.requests] == [
            (r.input_length, r.hash_ids) for r in original
        ]
        span = got.requests[-1].timestamp_ms
        if arrival is ArrivalKind.STEADY:  # the same mean rate (bursts make a short span vary)
            assert span == pytest.approx(original[-1].timestamp_ms, rel=0.3)
        if arrival is ArrivalKind.TRACE:
            assert got.requests == original


def test_cli_writes_a_replayable_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.jsonl"
    with pytest.raises(SystemExit) as exit_:
        main(["workload", "--kind", "tenants", "--requests", "30", "--out", str(out)])
    assert exit_.value.code == 0
    assert "30 requests" in capsys.readouterr().out
    assert len(load_trace(str(out)).requests) == 30


@pytest.mark.parametrize(
    "args",
    [
        ["--kind", "tenants"],  # no --out
        ["--kind", "agentic", "--arrival", "trace", "--out", "x"],
        ["--requests", "0", "--out", "x"],
        ["--follow", "1.5", "--out", "x"],
        ["--system-tokens", "5", "--out", "x"],
        ["--kind", "conv", "--azure-dir", "/nonexistent", "--out", "x"],
    ],
)
def test_bad_settings_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["workload", *args])
    assert exit_.value.code == 2
    assert "kvmesh workload: error:" in capsys.readouterr().err


def test_a_short_source_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="fewer than --requests"):
        generate(
            WorkloadConfig(
                kind=WorkloadKind.CONV, requests=500, azure_dir=str(azure_dir(tmp_path, 100))
            )
        )
