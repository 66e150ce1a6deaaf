"""Timing models: the polynomial against NVIDIA Dynamo's own mocker, and the JSON table profile.

The reference numbers are not re-typed coefficients: tests/fixtures/dynamo_mocker_timing.json
holds step durations that Dynamo 1.6.1's mocker reported for single requests, produced by
tests/benchmarks/dynamo_mocker_timing.py (its docstring says how; the file records the command
and the Dynamo version).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.mocker import (
    MockerConfig,
    MockerScheduler,
    PolynomialTiming,
    TableTiming,
    load_timing,
)

pytestmark = pytest.mark.unit

DYNAMO = json.loads(
    (Path(__file__).resolve().parent.parent / "fixtures" / "dynamo_mocker_timing.json").read_text()
)
CASES: list[dict[str, Any]] = DYNAMO["cases"]
BLOCK = DYNAMO["block_size"]
# Dynamo reports timestamps rounded to the nanosecond (1e-6 ms); a ttst is a difference of two.
TOL_MS = 2e-6


def _id(case: dict[str, Any]) -> str:
    return f"isl{case['input_length']}-blocks{case['num_gpu_blocks']}"


def test_fixture_provenance() -> None:
    assert DYNAMO["dynamo_version"] == "1.6.1"
    assert "dynamo_mocker_timing.py" in DYNAMO["command"]
    assert len(CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_prefill_matches_dynamo(case: dict[str, Any]) -> None:
    """Dynamo's time to first token of a lone prompt is one prefill step of all its tokens."""
    assert PolynomialTiming().prefill_ms(case["input_length"]) == pytest.approx(
        case["ttft_ms"], abs=TOL_MS
    )


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode_matches_dynamo(case: dict[str, Any]) -> None:
    """Dynamo's time to second token is one decode step; its KV usage input is the batch's
    tokens (prompt + first token) over the pool's token capacity."""
    usage = (case["input_length"] + 1) / (case["num_gpu_blocks"] * BLOCK)
    assert PolynomialTiming().decode_ms(usage) == pytest.approx(case["ttst_ms"], abs=TOL_MS)


def _scheduler_steps_ms(case: dict[str, Any]) -> list[float]:
    """Step durations of kvmesh's mocker scheduler serving the case's lone request."""
    sched = MockerScheduler(
        MockerConfig(num_gpu_blocks=case["num_gpu_blocks"], block_size=BLOCK),
        vocab_size=1000,
        excluded_token_ids=(),
        max_model_len=1 << 20,
    )
    prompt = [(7 * i) % 900 + 10 for i in range(case["input_length"])]
    stop = StopParams(max_tokens=2, ignore_eos=True)
    sched.add(EngineRequest("r", prompt, SamplingParams(temperature=0.0), stop), 0.0)
    steps = []
    while sched.has_work:
        steps.append(sched.step(0.0).duration_s * 1000)
    return steps


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_scheduler_prefill_step_matches_dynamo(case: dict[str, Any]) -> None:
    assert _scheduler_steps_ms(case)[0] == pytest.approx(case["ttft_ms"], abs=TOL_MS)


def test_scheduler_decode_step_matches_dynamo() -> None:
    """The decode step's KV usage counts token slots (prompt + first token over blocks x block
    size), not whole blocks: e.g. a 1-token prompt in 100 blocks of 64 is u = 2/6400."""
    got = [_scheduler_steps_ms(case)[1] for case in CASES]
    assert got == pytest.approx([case["ttst_ms"] for case in CASES], abs=TOL_MS)


def _prompt(hash_ids: list[int], length: int) -> list[int]:
    """Equal hash ids give equal token runs of the trace block size (as in a Mooncake replay)."""
    tb = DYNAMO["trace_block_size"]
    tokens = [(h * 7919 + 13 * i) % 997 + 3 for h in hash_ids for i in range(tb)]
    return tokens[:length]


def _replay_one_worker(num_gpu_blocks: int, rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """First-token and finish times (ms) of `rows` on one mocker scheduler in virtual time: a
    request that arrives during a step joins the next one."""
    sched = MockerScheduler(
        MockerConfig(num_gpu_blocks=num_gpu_blocks, block_size=BLOCK),
        vocab_size=1000,
        max_model_len=1 << 20,
    )
    pending = sorted(range(len(rows)), key=lambda i: rows[i]["timestamp_ms"])
    got: list[dict[str, float]] = [{} for _ in rows]
    now_ms = 0.0
    while pending or sched.has_work:
        while pending and rows[pending[0]]["timestamp_ms"] <= now_ms:
            i = pending.pop(0)
            row = rows[i]
            stop = StopParams(max_tokens=row["output_length"], ignore_eos=True)
            prompt = _prompt(row["hash_ids"], row["input_length"])
            sched.add(EngineRequest(str(i), prompt, SamplingParams(temperature=0.0), stop), 0.0)
        if not sched.has_work:
            now_ms = rows[pending[0]]["timestamp_ms"]
            continue
        result = sched.step(now_ms / 1e3)
        now_ms += result.duration_s * 1e3
        for out in result.outputs:
            times = got[int(out.request_id)]
            times.setdefault("first_token_ms", now_ms)
            if out.finish_reason is not None:
                times["finish_ms"] = now_ms
                assert out.usage is not None
                times["reused_input_tokens"] = out.usage.cached_tokens
    return got


@pytest.mark.parametrize("batch", DYNAMO["batches"], ids=lambda b: b["name"])
def test_batches_match_dynamo(batch: dict[str, Any]) -> None:
    """Steps that mix requests are timed as Dynamo times them: prefill time over the step's new
    tokens plus decode time at the decoding requests' context tokens (requests prefilling in the
    step add no decode usage), with cached prefixes and chunked prefill."""
    got = _replay_one_worker(batch["num_gpu_blocks"], batch["requests"])
    for want, have in zip(batch["requests"], got, strict=True):
        assert have["reused_input_tokens"] == want["reused_input_tokens"]
        assert have["first_token_ms"] == pytest.approx(want["first_token_ms"], abs=1e-5)
        assert have["finish_ms"] == pytest.approx(want["finish_ms"], abs=1e-5)


def test_polynomial_clamps_usage_and_skips_empty_prefill() -> None:
    poly = PolynomialTiming()
    assert poly.prefill_ms(0) == 0.0
    assert poly.decode_ms(7.0) == poly.decode_ms(1.0)  # usage is clamped to [0, 1]
    assert poly.decode_ms(-1.0) == poly.decode_ms(0.0)
    assert poly.decode_ms(1.0) > poly.decode_ms(0.5) > poly.decode_ms(0.0) >= 1.0


def test_table_interpolates_and_extrapolates() -> None:
    t = TableTiming([100, 1000], [10, 100], [0.0, 1.0], [5, 25])
    assert t.prefill_ms(550) == pytest.approx(55)
    assert t.prefill_ms(2000) == pytest.approx(200)  # extrapolated from the last segment
    assert t.prefill_ms(10) == pytest.approx(1)
    assert t.prefill_ms(0) == 0.0
    assert t.decode_ms(0.25) == pytest.approx(10)
    single = TableTiming([1], [7], [0.5], [0.2])
    assert single.prefill_ms(99) == 7 and single.decode_ms(0.9) == 1.0  # 1 ms floor


def test_load_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "prefill_tokens": [128, 1024, 8192],
                "prefill_ms": [18.5, 33.0, 160.0],
                "decode_kv_usage": [0.0, 0.5, 1.0],
                "decode_ms": [6.0, 25.0, 34.0],
            }
        )
    )
    model = load_timing(str(path))
    assert model.prefill_ms(1024) == pytest.approx(33.0)
    assert model.decode_ms(0.75) == pytest.approx(29.5)
    assert isinstance(load_timing(""), PolynomialTiming)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"prefill_tokens": [1]}),
        json.dumps(
            {
                "prefill_tokens": [2, 1],
                "prefill_ms": [1, 2],
                "decode_kv_usage": [0],
                "decode_ms": [1],
            }
        ),
        json.dumps(
            {"prefill_tokens": [1], "prefill_ms": [1, 2], "decode_kv_usage": [0], "decode_ms": [1]}
        ),
        json.dumps(
            {"prefill_tokens": ["x"], "prefill_ms": [1], "decode_kv_usage": [0], "decode_ms": [1]}
        ),
    ],
)
def test_bad_profiles_are_rejected(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        load_timing(str(path))
    with pytest.raises(ValueError):
        load_timing(str(tmp_path / "missing.json"))
