"""The planner benchmark's verdict (tests/benchmarks/bench_planner.py): the issue's three
criteria on one day, and the table's lines for days of other seeds. The benchmark itself runs as
a script (10-30 minutes here)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bp() -> ModuleType:
    return load_benchmark("bench_planner")


def result(bp: ModuleType, sla: tuple[float, float], seed: int = 0) -> dict[str, Any]:
    """A day whose reference is static 9 (96.66 %, 1.011 worker-h), the queue baseline at its
    load-test target 66 % at 0.558, and the planner at `sla` (SLO met, worker-hours)."""

    def row(met: float, hours: float) -> dict[str, float]:
        return {"slo_attainment": met, "worker_hours": hours}

    return {
        "case": bp.CASES["conv"],
        "seed": seed,
        "requests": 21189,
        "static": {8: row(0.8941, 0.899), 9: row(0.9666, 1.011)},
        "ref_n": 9,
        "sla": row(*sla),
        "sla_no_surge": row(0.98, 0.72),
        "queues": {41.8: row(0.66, 0.558)},
        "queue_target": 41.8,
    }


def test_verdict_checks_the_three_criteria(bp: ModuleType) -> None:
    assert bp.verdict(result(bp, (0.9710, 0.686))) == "meets the criteria"
    # 0.711 / 1.011 = 0.703x: over 0.7x, however close
    assert bp.verdict(result(bp, (0.9759, 0.711))) == "misses: 0.703x worker-hours (0.7x allowed)"
    assert bp.verdict(result(bp, (0.9402, 0.600))) == "misses: SLO met below the reference's"
    low = bp.verdict(result(bp, (0.6, 0.5)))
    assert "SLO met below the reference's" in low
    assert "SLO met not above the queue baseline's" in low


def test_table_names_each_seed_and_gives_its_verdict(bp: ModuleType) -> None:
    text = bp.table([result(bp, (0.9759, 0.711)), result(bp, (0.9710, 0.686), seed=1)])
    assert "| Azure conv (day): 21189 req" in text
    assert "| Azure conv (day) (seed 1): 21189 req" in text
    assert "| static 9 (ref) | 96.66 % | 1.011 | 1.00x |" in text
    assert "- Azure conv (day): SLA planner misses: 0.703x worker-hours (0.7x allowed)" in text
    assert "- Azure conv (day) (seed 1): SLA planner meets the criteria" in text


def test_clairvoyant_schedule_picks_each_intervals_size(bp: ModuleType) -> None:
    """Two 10 s intervals: 100 requests, then 10. One worker serves half of the first interval's
    within the SLO and all of the second's; two serve all of both."""

    def static(*met: float) -> dict[str, Any]:
        rates = (10.0, 1.0)
        timeline = [
            {"t_s": 10.0 * i, "arrival_rps": r, "slo_met": m}
            for i, (r, m) in enumerate(zip(rates, met, strict=True))
        ]
        return {"timeline": timeline}

    hull = bp.clairvoyant({1: static(0.5, 1.0), 2: static(1.0, 1.0)})
    # one worker all day: 60 of 110; two for the busy interval only: all 110, for 30
    # worker-seconds (two all day buys nothing more: not on the hull)
    assert hull == [
        (pytest.approx(20 / 3600), pytest.approx(60 / 110)),
        (pytest.approx(30 / 3600), pytest.approx(1.0)),
    ]
    assert bp.clairvoyant_at(hull, 25 / 3600) == pytest.approx(60 / 110)
    assert bp.clairvoyant_at(hull, 40 / 3600) == pytest.approx(1.0)
    assert math.isnan(bp.clairvoyant_at(hull, 10 / 3600))  # less than one worker all day
    assert bp.clairvoyant({}) == []


def test_table_gives_the_clairvoyant_schedule_where_it_ran(bp: ModuleType) -> None:
    day = result(bp, (0.9759, 0.711))
    day["clairvoyant"] = [(0.6, 0.95), (0.70, 0.9701), (0.75, 0.98)]
    text = bp.table([day, result(bp, (0.9710, 0.686), seed=1)])
    assert (
        "- Azure conv (day): SLA planner misses: 0.703x worker-hours (0.7x allowed); "
        "clairvoyant schedule (sizes 1-9, no start-up): 97.01 % at the planner's 0.711 "
        "worker-h, 97.01 % at 0.7x the reference's (within reach of the reference's 96.66 %)"
    ) in text
    assert "- Azure conv (day) (seed 1): SLA planner meets the criteria\n" in text + "\n"
    # a hull that never fits 0.7x the reference's hours says so
    day["clairvoyant"] = [(0.75, 0.98)]
    assert "no schedule of these sizes within 0.7x the reference's (out of reach" in bp.table([day])
