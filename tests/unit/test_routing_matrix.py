"""Smoke test of the routing matrix harness (tests/benchmarks/routing_matrix.py): one tiny cell
through its trace preparation, its kvmesh replays, its report and its cross-validation. The
matrix itself runs as a script (about an hour here)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvmesh.sim.trace import load_trace
from tests.conftest import load_benchmark

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rm() -> ModuleType:
    return load_benchmark("routing_matrix")


def test_one_cell_end_to_end(rm: Any, tmp_path: Path) -> None:
    cell = rm.Cell("tenants", "bursty", 2, "moderate", 80)
    assert cell.speedup == 2 * rm.LOADS["tenants"]["moderate"] and cell.trace_block_size == 64
    path = rm.prepare_trace(tmp_path, cell)
    assert path == rm.prepare_trace(tmp_path, cell)  # kept, not rewritten
    assert len(load_trace(str(path)).requests) == 80
    # --seeds: the same cell realized again, its own id and trace
    again = rm.Cell("tenants", "bursty", 2, "moderate", 80, seed=1)
    assert again.id == f"{cell.id}/s1" and again.speedup == cell.speedup
    other = rm.prepare_trace(tmp_path, again)
    assert other != path and other.read_text() != path.read_text()
    assert len(load_trace(str(other)).requests) == 80
    ids = {c.id for c in rm.matrix_cells(["synthetic"], [4], seeds=[0, 1])}
    assert "synthetic/steady/w4/light/n3993" in ids and "synthetic/bursty/w4/light/n3993/s1" in ids
    assert "synthetic/steady/w4/light/n3993/s1" not in ids  # a fixed file: no other realization
    job = {"id": cell.id, "workers": 2, "speedup": cell.speedup, "trace_block_size": 64,
           "requests": 80}  # fmt: skip
    rows = [rm.run_kvmesh((job, str(path), p, {})) for p in ("kv", "kv-cost", "round-robin")]
    for row in rows:
        assert row["completed"] == 80 and row["ttft_mean"] > 0 and 0 <= row["reuse"] <= 1
    by_policy = dict(zip(("kv", "kv-cost", "round-robin"), rows, strict=True))
    primary, rr = by_policy[rm.DEFAULT_POLICY], by_policy["round-robin"]
    # A Dynamo row as dynamo_replay_cells.py writes it, here made slightly better than the
    # default policy's.
    dyn = {"id": cell.id, "mode": "kv_router", "mean_ttft_ms": primary["ttft_mean"] * 0.9,
           "p99_ttft_ms": primary["ttft_p99"], "p99_itl_ms": 10.0,
           "prefix_cache_reused_ratio": 0.5, "req_imbalance": 1.1}  # fmt: skip
    text = rm.report([cell], rows, [dyn])
    assert f"| tenants | bursty | 2 | moderate | {primary['ttft_mean']:.0f} / " in text
    assert "geometric mean 1.11" in text and "p99: geometric mean 1.00" in text
    assert f"exceeds Dynamo KV's: 1 ['{cell.id}']" in text
    worse_rr = primary["ttft_mean"] > rr["ttft_mean"] or primary["ttft_p99"] > rr["ttft_p99"]
    assert f"exceeds round-robin's: {int(worse_rr)}" in text
    # --before: an earlier run's default-policy rows take the other policy's column
    earlier = {**primary, "ttft_mean": 2 * dyn["mean_ttft_ms"]}
    text = rm.report([cell], rows, [dyn], before_rows=[earlier, rr])
    assert f"| {rm.DEFAULT_POLICY} before |" in text
    assert f"({rm.DEFAULT_POLICY} before: mean or p99 above Dynamo KV's in 1 cells" in text
    assert "geometric mean 2.00, p99 1.00" in text


def test_cross_validation_picks_by_the_other_workloads(rm: Any) -> None:
    cells = [rm.Cell(w, "steady", 4, "moderate", 1000) for w in rm.WORKLOADS]
    good = {"router_itl_weight": 5.0, "router_itl_penalty_cap_ms": 300.0}
    rows = []
    for c in cells:
        rows.append({"id": c.id, "policy": "round-robin", "params": {}, "ttft_mean": 100.0,
                     "ttft_p99": 400.0})  # fmt: skip
        # ("kv", good) wins everywhere but on conv, where the default is better
        g, b = (90.0, 80.0) if c.workload == "conv" else (50.0, 70.0)
        rows.append({"id": c.id, "policy": "kv", "params": good, "ttft_mean": g, "ttft_p99": 4 * g})
        rows.append({"id": c.id, "policy": rm.DEFAULT_POLICY, "params": {}, "ttft_mean": b,
                     "ttft_p99": 4 * b})  # fmt: skip
    # an incomplete point (one cell only) is left out
    rows.append({"id": cells[0].id, "policy": "kv", "params": {"x": 1}, "ttft_mean": 1.0,
                 "ttft_p99": 1.0})  # fmt: skip
    text = rm.cross_validate(cells, rows)
    assert 'held out conv     : chosen ["kv", {"router_itl_penalty_cap_ms": 300.0' in text
    assert "held-out score 0.900; default 0.800 (best possible 0.800" in text
    assert '"x": 1' not in text
    assert text.splitlines()[-2].startswith("folds chose: [")
    assert "above round-robin in 0 held-out cells" in text
    # The floor: a point above round-robin in a training cell is not chosen, however it scores.
    worse = {**rows[1], "ttft_p99": 401.0}  # ("kv", good) on synthetic: p99 above round-robin
    text = rm.cross_validate(cells, [rows[0], worse, *rows[2:]])
    assert 'held out conv     : chosen ["kv", {}]' in text
    assert 'held out synthetic: chosen ["kv", {"router_itl_penalty_cap_ms": 300.0' in text
    assert "above round-robin in 1 held-out cells" in text
    assert (
        text.splitlines()[-1] == 'on all cells (never above round-robin) the choice is: ["kv", {}]'
    )


def test_prediction_error_pairs_each_prediction_with_the_realized_ttft(
    rm: Any, tmp_path: Path
) -> None:
    module = load_benchmark("ttft_prediction_error")
    cell = rm.Cell("agentic", "steady", 2, "light", 60)
    diffs, real, states = module.errors(cell, tmp_path)
    assert len(diffs) == len(real) == len(states) == 60 and min(real) > 0
    # An idle fleet's first request: the prediction is the timing model's prefill, exactly.
    assert abs(diffs[0]) < 1e-6 and states[0] == "idle"
    assert set(states) <= set(module.STATES) and len(set(states)) > 1
    assert "| x | 60 |" in module.line("x", diffs, real)
