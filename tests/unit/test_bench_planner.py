"""The planner benchmark's verdict (tests/benchmarks/bench_planner.py): the issue's three
criteria on one day, and the table's lines for days of other seeds. The benchmark itself runs as
a script (10-30 minutes here)."""

from __future__ import annotations

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
