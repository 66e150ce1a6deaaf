#!/usr/bin/env python3
"""Score routing policies over a matrix of workloads, arrivals, fleet sizes and loads, beside
round-robin and NVIDIA Dynamo's own offline replay (issue 10).

Cells: every workload x arrival x workers x load of the lists below.
  * workloads (kvmesh.sim.workloads, written once into OUT/traces, deterministic): the shared
    Mooncake synthetic trace (512-token hash ids; its own Poisson arrivals as "steady", retimed
    by the bursty process as "bursty"), and at 64-token hash ids the Azure conversation and
    code traces given sessions and shared system prompts, agentic tool loops, multi-tenant
    prefixes;
  * arrivals: steady (Poisson) and bursty (on-off, same mean; bursts of BURST_S simulated
    seconds at 3x the mean rate, lulls three times as long at 1/3 of it);
  * workers 2, 4, 8, 16, with 500 requests per worker (the synthetic trace: all 3,993);
  * loads: arrival speedup = factor x workers, so the load per worker stays put as the fleet
    grows; per workload the factors of "light" (round-robin barely queues), "moderate"
    (round-robin queues clearly) and "overload" (queues grow under every policy) come from a
    load sweep with Dynamo's replay at 4 workers (recorded in LOADS).
Per cell and policy: TTFT mean and p99, ITL p99, prefix reuse (prompt tokens served from cache),
load imbalance (requests on the busiest worker / mean) and, for kvmesh, busy-time imbalance.

Policies: `kv` (KV routing with the ttft policy and its defaults), `kv-cost` (the linear
cost), `round-robin`; Dynamo's `kv_router` and `round_robin` (median of 3 runs: its KV router is
not deterministic) when its venv exists (--dynamo-python). The report's first column is the
default policy (KvPolicyFlags.router_policy), the one the acceptance verdicts are about.

`--cv` chooses the default policy and its parameters by leave-one-workload-out
cross-validation over the CV cells (every workload, both arrivals, 4 workers, three loads, 500
requests per worker) and the points of GRID (both policies): for each held-out workload, the
point with the best score on the other workloads' cells is scored on the held-out one. Score of
a cell: geometric mean of TTFT mean and p99, each relative to round-robin's in the same cell
(lower is better). Round-robin is the floor: a fold chooses among the points never above it (TTFT
mean or p99) on its training cells, and the default among those never above it on any cell.
The defaults' rows are the matrix's own (params {}), so a CV run after a matrix run at 4
workers only replays the other points.

Usage (from the repository root; Dynamo optional; results are appended, so a run resumes):
    .venv/bin/python tests/benchmarks/routing_matrix.py --workers 4      # ~20 min a policy here
    .venv/bin/python tests/benchmarks/routing_matrix.py                  # 2-16 workers: hours
    .venv/bin/python tests/benchmarks/routing_matrix.py --cv             # choose the default
    .venv/bin/python tests/benchmarks/routing_matrix.py --cv --cv-points 2 5   # some points
    .venv/bin/python tests/benchmarks/routing_matrix.py --quick          # 2 workloads x 4 workers
    .venv/bin/python tests/benchmarks/routing_matrix.py --workloads conv --arrivals bursty \
        --seeds 1 2 --policies kv round-robin        # the same cells, other realizations
  --jobs N: simulations in parallel (default 2); --out DIR (default .cache/routing_matrix).
Simulated latencies do not depend on this machine's load; only wall times do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.router.kv_policy import KvPolicyFlags, KvPolicyKind
from kvmesh.router.routing import RouterMode
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.replay import simulate
from kvmesh.sim.trace import load_trace, write_trace
from kvmesh.sim.workloads import ArrivalKind, WorkloadConfig, WorkloadKind, generate, sharing

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVMESH_SHARED", ROOT.parent / "shared"))
"""The shared folder (ref/traces); KVMESH_SHARED overrides it (e.g. running from a copy)."""
SYNTHETIC = SHARED / "ref" / "traces" / "mooncake_synthetic_trace.jsonl"

WORKLOADS = {
    "synthetic": (WorkloadKind.MOONCAKE, 512),
    "conv": (WorkloadKind.CONV, 64),
    "code": (WorkloadKind.CODE, 64),
    "agentic": (WorkloadKind.AGENTIC, 64),
    "tenants": (WorkloadKind.TENANTS, 64),
}
"""name -> (kind, tokens per hash id)."""
LOADS = {
    "synthetic": {"light": 0.25, "moderate": 0.5, "overload": 0.75},
    "conv": {"light": 2.0, "moderate": 6.0, "overload": 8.0},
    "code": {"light": 4.0, "moderate": 10.0, "overload": 14.0},
    "agentic": {"light": 1.0, "moderate": 4.0, "overload": 7.0},
    "tenants": {"light": 0.5, "moderate": 1.5, "overload": 3.0},
}
"""Per workload: load -> factor (arrival speedup = factor x workers). Chosen by a sweep of
Dynamo's replay at 4 workers, steady arrivals: light, round-robin's TTFT mean within ~1.5x of an
idle fleet's; moderate, round-robin 2-8x worse than an idle fleet and KV routing still ahead;
overload, round-robin's queues grow through the trace."""
ARRIVALS = ("steady", "bursty")
WORKERS = (2, 4, 8, 16)
REQUESTS_PER_WORKER = 500
CV_REQUESTS_PER_WORKER = 500
"""The CV cells have the matrix's requests per worker (fewer would miss the regimes where request
slots run short), so they are the matrix's 4-worker cells."""
SYNTHETIC_REQUESTS = 3993
BURST_S = 5.0
"""Bursty arrivals: mean burst length in simulated seconds (3x the mean rate; lulls at 1/3 of
it last 3x as long), whatever the cell's speedup."""

GRID: list[tuple[str, dict[str, Any]]] = [
    ("kv-cost", {}),
    ("kv-cost", {"router_overlap_weight": 2.0}),
    ("kv", {}),
    ("kv", {"router_itl_weight": 0.0}),
    ("kv", {"router_itl_penalty_ratio": 1.0}),
    ("kv", {"router_itl_penalty_ratio": 1.5}),
    ("kv", {"router_itl_weight": 3.0}),
    ("kv", {"router_decode_delay_weight": 0.0}),
    ("kv", {"router_decode_delay_weight": 2.0}),
    ("kv", {"router_decode_delay_weight": 0.5}),
]
"""The points cross-validation chooses from: (policy, ReplayConfig overrides; {} = defaults).
cost: the overlap weight (blocks to prefill against blocks decoding); ttft: the ITL penalty
(weight x expected output tokens x ms of predicted ITL above a ratio of the best worker's,
capped; weight 0: TTFT and the delay term alone, the default until the penalty's ratio came;
ratio 1, 1.5 and the default 2; weight 3) and the weight of the delay a request's prefill adds
to the requests running on its worker (0: its own TTFT only; 0.5; the default 1; 2). A CV run costs
a matrix pass at 4 workers per point beyond the matrix's own (`--cv-points` runs some of them;
the others' rows, if present, still count)."""
DEFAULT_POLICY = "kv-cost" if KvPolicyFlags().router_policy is KvPolicyKind.COST else "kv"
"""The matrix policy that runs with the router's default policy."""


@dataclass(frozen=True)
class Cell:
    workload: str
    arrival: str
    workers: int
    load: str
    requests: int
    seed: int = 0
    """The workload generator's seed (0: the matrix's traces; others: the same cell realized
    again, other sessions and arrival times; not for the steady synthetic cells, a fixed file)."""

    @property
    def id(self) -> str:
        base = f"{self.workload}/{self.arrival}/w{self.workers}/{self.load}/n{self.requests}"
        return f"{base}/s{self.seed}" if self.seed else base

    @property
    def trace_block_size(self) -> int:
        return WORKLOADS[self.workload][1]

    @property
    def speedup(self) -> float:
        return round(LOADS[self.workload][self.load] * self.workers, 6)


def trace_path(out: Path, c: Cell) -> Path:
    if c.workload == "synthetic" and c.arrival == "steady":
        return SYNTHETIC
    name = f"{c.workload}_{c.arrival}_n{c.requests}"
    if c.arrival == "bursty":  # bursts last BURST_S of simulated time: scaled by the speedup
        name += f"_b{c.speedup * BURST_S:g}"
    if c.seed:
        name += f"_s{c.seed}"
    return out / "traces" / f"{name}.jsonl"


def prepare_trace(out: Path, c: Cell) -> Path:
    """Write the cell's trace (deterministic; kept if present)."""
    path = trace_path(out, c)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    kind, block_size = WORKLOADS[c.workload]
    config = WorkloadConfig(
        kind=kind,
        arrival=ArrivalKind(c.arrival),
        requests=c.requests,
        burst_s=c.speedup * BURST_S,
        block_size=block_size,
        azure_dir=str(SHARED / "ref" / "traces"),
        source=str(SYNTHETIC),
        out=str(path),
        seed=c.seed,
    )
    trace = generate(config)
    tmp = path.with_suffix(".tmp")
    write_trace(trace, str(tmp))
    tmp.rename(path)
    return path


def matrix_cells(
    workloads: Iterable[str],
    workers: Iterable[int],
    arrivals: Iterable[str] = ARRIVALS,
    loads: Iterable[str] = ("light", "moderate", "overload"),
    seeds: Iterable[int] = (0,),
) -> list[Cell]:
    cells = []
    for seed, w, a, n, load in itertools.product(seeds, workloads, arrivals, workers, loads):
        if seed and w == "synthetic" and a == "steady":
            continue  # a fixed file: no other realization
        requests = SYNTHETIC_REQUESTS if w == "synthetic" else REQUESTS_PER_WORKER * n
        cells.append(Cell(w, a, n, load, requests, seed))
    return cells


def cv_cells(workers: Iterable[int] = (4,)) -> list[Cell]:
    return [
        Cell(w, a, n, load, SYNTHETIC_REQUESTS if w == "synthetic" else CV_REQUESTS_PER_WORKER * n)
        for w, a, n, load in itertools.product(
            WORKLOADS, ARRIVALS, workers, ("light", "moderate", "overload")
        )
    ]


# -- kvmesh runs ------------------------------------------------------------------------------


def run_kvmesh(job: tuple[dict[str, Any], str, str, dict[str, Any]]) -> dict[str, Any]:
    """One kvmesh replay of a cell (in a worker process)."""
    cell, trace, policy, params = job
    config = ReplayConfig(
        trace=trace,
        workers=cell["workers"],
        speedup=cell["speedup"],
        trace_block_size=cell["trace_block_size"],
        limit=cell["requests"],
        router_policy="cost" if policy == "kv-cost" else "ttft",  # type: ignore[arg-type]
        **params,  # type: ignore[arg-type]
    )
    mode = RouterMode.ROUND_ROBIN if policy == "round-robin" else RouterMode.KV
    r = simulate(load_trace(trace, cell["requests"]), config, mode)
    return {
        "id": cell["id"],
        "policy": policy,
        "params": params,
        "ttft_mean": r.ttft_ms.mean,
        "ttft_p99": r.ttft_ms.p99,
        "itl_p99": r.itl_ms.p99,
        "reuse": r.prefix_hit_rate,
        "req_imbalance": r.imbalance["requests_max_over_mean"],
        "busy_imbalance": r.imbalance["busy_fraction_max_over_mean"],
        "completed": r.requests,
        "wall_s": r.wall_s,
    }


def key(row: dict[str, Any]) -> str:
    return json.dumps([row["id"], row["policy"], row.get("params", {})], sort_keys=True)


def run_jobs(
    jobs: list[tuple[dict[str, Any], str, str, dict[str, Any]]], path: Path, n: int
) -> list[dict[str, Any]]:
    """Run the kvmesh jobs not yet in `path` (n at a time), append them; return every row."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {key(r) for r in rows}
    todo = [j for j in jobs if key({"id": j[0]["id"], "policy": j[2], "params": j[3]}) not in done]
    if todo:
        print(
            f"kvmesh: {len(todo)} replays ({len(jobs) - len(todo)} already done)", file=sys.stderr
        )
    t0 = time.perf_counter()
    with (
        path.open("a") as f,
        multiprocessing.get_context("spawn").Pool(n, maxtasksperchild=4) as pool,
    ):
        for i, row in enumerate(pool.imap_unordered(run_kvmesh, todo), 1):
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
            print(
                f"[{i}/{len(todo)} {time.perf_counter() - t0:.0f}s] {row['id']} {row['policy']} "
                f"{row['params'] or ''} ttft {row['ttft_mean']:.0f} / p99 {row['ttft_p99']:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    return rows


def run_dynamo(
    cells: list[Cell], traces: dict[str, Path], out: Path, python: str
) -> list[dict[str, Any]]:
    """Dynamo's replay of every cell (dynamo_replay_cells.py in its venv); [] without it."""
    path = out / "dynamo.jsonl"
    if not python or not Path(python).exists():
        print(f"Dynamo not found at {python!r}: kvmesh only", file=sys.stderr)
        return []
    spec = [
        {
            "id": c.id,
            "trace": str(_limited(traces[c.id], c.requests, out)),
            "trace_block_size": c.trace_block_size,
            "workers": c.workers,
            "speedup": c.speedup,
        }
        for c in cells
    ]
    cells_json = out / "cells.json"
    cells_json.write_text(json.dumps(spec, indent=1))
    script = Path(__file__).with_name("dynamo_replay_cells.py")
    subprocess.run(
        [python, str(script), "--cells", str(cells_json), "--out", str(path)], check=True
    )
    return [json.loads(line) for line in path.read_text().splitlines()]


def _limited(path: Path, requests: int, out: Path) -> Path:
    """`path` cut to its first `requests` lines (Dynamo's replay has no limit of its own)."""
    with path.open() as f:
        lines = list(itertools.islice(f, requests))
    if len(lines) == sum(1 for _ in path.open()):
        return path
    cut = out / "traces" / f"{path.stem}_first{requests}.jsonl"
    if not cut.exists():
        cut.parent.mkdir(parents=True, exist_ok=True)
        cut.write_text("".join(lines))
    return cut


# -- reporting --------------------------------------------------------------------------------


def by_cell(rows: list[dict[str, Any]], policy_field: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["id"], r[policy_field]): r for r in rows if not r.get("params")}


def report(
    cells: list[Cell],
    kv_rows: list[dict[str, Any]],
    dyn_rows: list[dict[str, Any]],
    primary: str = DEFAULT_POLICY,
    before_rows: list[dict[str, Any]] | None = None,
) -> str:
    """The acceptance table (markdown) and the verdicts, for `primary` (the default policy)
    beside the other KV policy (or, given `before_rows`, the same policy's rows of an earlier
    run: "before"), round-robin and Dynamo."""
    kv = by_cell(kv_rows, "policy")
    dyn = by_cell(dyn_rows, "mode")
    other = "kv" if primary == "kv-cost" else "kv-cost"
    if before_rows is not None:
        other = f"{primary} before"
        kv.update(
            {(i, other): r for (i, p), r in by_cell(before_rows, "policy").items() if p == primary}
        )
    lines = [
        f"| workload | arrival | W | load | {primary} TTFT mean / p99 | {other} | round-robin "
        f"| Dynamo KV | Dynamo RR | {primary} / Dynamo mean | {primary} / Dynamo p99 "
        f"| ITL p99 {primary} / Dyn | reuse {primary} / {other} / Dyn % "
        f"| req imbalance {primary} / Dyn |",
        "|---|---|---:|---|---|---|---|---|---|---:|---:|---|---|---|",
    ]
    worse_dyn: list[str] = []
    worse_rr: list[str] = []
    ratios: list[float] = []
    p99_ratios: list[float] = []
    other_worse: list[str] = []
    other_ratios: list[float] = []
    other_p99_ratios: list[float] = []
    rr_ratios: list[float] = []
    rr_p99_ratios: list[float] = []
    other_worse_rr: list[str] = []
    for c in cells:
        k = kv.get((c.id, primary))
        if k is None:
            continue
        o = kv.get((c.id, other))
        rr = kv.get((c.id, "round-robin"))
        d = dyn.get((c.id, "kv_router"))
        drr = dyn.get((c.id, "round_robin"))

        def pair(r: dict[str, Any] | None, mean: str, p99: str) -> str:
            return "-" if r is None else f"{r[mean]:.0f} / {r[p99]:.0f}"

        ratio = p99_ratio = "-"
        if d is not None:
            x = k["ttft_mean"] / d["mean_ttft_ms"]
            y = k["ttft_p99"] / d["p99_ttft_ms"]
            ratios.append(x)
            p99_ratios.append(y)
            ratio, p99_ratio = f"{x:.2f}", f"{y:.2f}"
            if x > 1 or y > 1:
                worse_dyn.append(c.id)
            if o is not None:
                other_ratios.append(o["ttft_mean"] / d["mean_ttft_ms"])
                other_p99_ratios.append(o["ttft_p99"] / d["p99_ttft_ms"])
                if o["ttft_mean"] > d["mean_ttft_ms"] or o["ttft_p99"] > d["p99_ttft_ms"]:
                    other_worse.append(c.id)
        if rr is not None:
            rr_ratios.append(k["ttft_mean"] / rr["ttft_mean"])
            rr_p99_ratios.append(k["ttft_p99"] / rr["ttft_p99"])
            if k["ttft_mean"] > rr["ttft_mean"] or k["ttft_p99"] > rr["ttft_p99"]:
                worse_rr.append(c.id)
            if o is not None and (
                o["ttft_mean"] > rr["ttft_mean"] or o["ttft_p99"] > rr["ttft_p99"]
            ):
                other_worse_rr.append(c.id)
        reuse = f"{100 * k['reuse']:.1f}"
        reuse += f" / {100 * o['reuse']:.1f}" if o else " / -"
        reuse += f" / {100 * d['prefix_cache_reused_ratio']:.1f}" if d else " / -"
        itl = f"{k['itl_p99']:.0f} / " + (f"{d['p99_itl_ms']:.0f}" if d else "-")
        imb = f"{k['req_imbalance']:.2f} / " + (f"{d['req_imbalance']:.2f}" if d else "-")
        lines.append(
            f"| {c.workload} | {c.arrival} | {c.workers} | {c.load} | "
            f"{pair(k, 'ttft_mean', 'ttft_p99')} | {pair(o, 'ttft_mean', 'ttft_p99')} | "
            f"{pair(rr, 'ttft_mean', 'ttft_p99')} | {pair(d, 'mean_ttft_ms', 'p99_ttft_ms')} | "
            f"{pair(drr, 'mean_ttft_ms', 'p99_ttft_ms')} | {ratio} | {p99_ratio} | {itl} | "
            f"{reuse} | {imb} |"
        )
    lines.append("")

    def geo(xs: list[float]) -> float:
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    if ratios:
        lines.append(
            f"{primary} TTFT mean / Dynamo KV's: geometric mean {geo(ratios):.2f}, worst "
            f"{max(ratios):.2f} over {len(ratios)} cells; p99: geometric mean "
            f"{geo(p99_ratios):.2f}, worst {max(p99_ratios):.2f}"
        )
    lines.append(
        f"cells where {primary}'s TTFT mean or p99 exceeds Dynamo KV's: "
        f"{len(worse_dyn)} {worse_dyn}"
    )
    lines.append(
        f"cells where {primary}'s TTFT mean or p99 exceeds round-robin's: "
        f"{len(worse_rr)} {worse_rr}"
    )
    if rr_ratios:
        lines.append(
            f"{primary} TTFT mean / round-robin's: geometric mean {geo(rr_ratios):.2f}; p99: "
            f"geometric mean {geo(rr_p99_ratios):.2f}"
        )
    if other_ratios:
        lines.append(
            f"({other}: mean or p99 above Dynamo KV's in {len(other_worse)} cells "
            f"{other_worse}; TTFT mean / Dynamo KV's geometric mean {geo(other_ratios):.2f}, "
            f"p99 {geo(other_p99_ratios):.2f}; above round-robin's in {len(other_worse_rr)})"
        )
    return "\n".join(lines)


# -- cross-validation -------------------------------------------------------------------------


def point_key(policy: str, params: dict[str, Any]) -> str:
    return json.dumps([policy, params], sort_keys=True)


def cell_score(row: dict[str, Any], rr: dict[str, Any]) -> float:
    return math.sqrt((row["ttft_mean"] / rr["ttft_mean"]) * (row["ttft_p99"] / rr["ttft_p99"]))


def cross_validate(cells: list[Cell], rows: list[dict[str, Any]]) -> str:
    """Leave-one-workload-out over the GRID points present in `rows` (see the module doc)."""
    rr = {r["id"]: r for r in rows if r["policy"] == "round-robin" and not r.get("params")}
    ids = {c.id for c in cells}
    scores: dict[str, dict[str, float]] = {}  # point key -> cell id -> score
    for r in rows:
        if r["policy"] != "round-robin" and r["id"] in rr and r["id"] in ids:
            point = point_key(r["policy"], r.get("params", {}))
            scores.setdefault(point, {})[r["id"]] = cell_score(r, rr[r["id"]])
    scores = {p: v for p, v in scores.items() if len(v) == len(ids)}  # complete points only
    default = point_key(DEFAULT_POLICY, {})
    # The floor: cells where a point's TTFT mean or p99 is above round-robin's.
    above_rr: dict[str, set[str]] = {p: set() for p in scores}
    for r in rows:
        point = point_key(r["policy"], r.get("params", {}))
        if point in above_rr and r["id"] in ids:
            base = rr[r["id"]]
            if r["ttft_mean"] > base["ttft_mean"] or r["ttft_p99"] > base["ttft_p99"]:
                above_rr[point].add(r["id"])

    def eligible(cell_ids: list[str]) -> list[str]:
        """The points never above round-robin on `cell_ids` (all points if none is)."""
        ok = [p for p in scores if not above_rr[p] & set(cell_ids)]
        return ok or list(scores)

    def mean_log(point: str, cell_ids: list[str]) -> float:
        return sum(math.log(scores[point][i]) for i in cell_ids) / len(cell_ids)

    lines = [
        "leave-one-workload-out (score: geometric mean over cells of sqrt(mean ratio x p99 "
        "ratio), ratios to round-robin; lower is better; a fold chooses among the points never "
        "above round-robin on its training cells)"
    ]
    chosen: list[str] = []
    for held in WORKLOADS:
        train = [c.id for c in cells if c.workload != held]
        test = [c.id for c in cells if c.workload == held]
        if not train or not test:
            continue
        best = min(eligible(train), key=lambda p: mean_log(p, train))
        chosen.append(best)
        oracle = min(scores, key=lambda p: mean_log(p, test))
        vs = f"; default {math.exp(mean_log(default, test)):.3f}" if default in scores else ""
        floor = len(above_rr[best] & set(test))
        lines.append(
            f"  held out {held:9}: chosen {best} -> held-out score "
            f"{math.exp(mean_log(best, test)):.3f}{vs} "
            f"(best possible {math.exp(mean_log(oracle, test)):.3f} with {oracle}); "
            f"above round-robin in {floor} held-out cells"
        )
    everything = [c.id for c in cells]
    lines.append("all points on all CV cells (cells above round-robin):")
    for p in sorted(scores, key=lambda p: mean_log(p, everything)):
        lines.append(
            f"  {p}: {math.exp(mean_log(p, everything)):.3f} ({len(above_rr[p])}"
            f"{': ' + ' '.join(sorted(above_rr[p])) if above_rr[p] else ''})"
        )
    lines.append(f"folds chose: {sorted(set(chosen), key=chosen.index)}")
    final = min(eligible(everything), key=lambda p: mean_log(p, everything))
    lines.append(f"on all cells (never above round-robin) the choice is: {final}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "routing_matrix")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--cv", action="store_true", help="choose the default policy and its parameters"
    )
    parser.add_argument(
        "--cv-points",
        nargs="+",
        type=int,
        default=None,
        help="--cv: replay only these GRID points (indices; default all); points whose rows "
        "are all in OUT (e.g. from an earlier run) still count",
    )
    parser.add_argument(
        "--cv-workers",
        nargs="+",
        type=int,
        default=[4],
        help="--cv: the fleet sizes of the CV cells (default 4)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="an earlier run's kvmesh.jsonl: its default-policy rows replace the other KV "
        "policy's column (the default before a change)",
    )
    parser.add_argument("--quick", action="store_true", help="conv and agentic, 4 workers only")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--workers", nargs="+", type=int, default=list(WORKERS))
    parser.add_argument("--arrivals", nargs="+", default=list(ARRIVALS), choices=list(ARRIVALS))
    parser.add_argument(
        "--loads",
        nargs="+",
        default=["light", "moderate", "overload"],
        choices=["light", "moderate", "overload"],
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[0],
        help="the workload generator's seeds: other realizations of each cell (0: the matrix's "
        "own traces), to see whether a verdict holds beyond one trace per cell",
    )
    parser.add_argument("--policies", nargs="+", default=["kv", "kv-cost", "round-robin"])
    parser.add_argument(
        "--dynamo-python",
        default=os.environ.get("DYN_PY", "/tmp/dynamo_peer/venv/bin/python"),
        help="Dynamo's venv python ('' to skip Dynamo)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cv:
        cells = cv_cells(args.cv_workers)
    elif args.quick:
        cells = matrix_cells(["conv", "agentic"], [4])
    else:
        cells = matrix_cells(args.workloads, args.workers, args.arrivals, args.loads, args.seeds)
    traces = {c.id: prepare_trace(args.out, c) for c in cells}
    for path in sorted(set(traces.values())):
        tbs = 512 if path == SYNTHETIC or path.name.startswith("synthetic") else 64
        s = sharing(load_trace(str(path)), tbs)
        print(
            f"{path.name}: {s['requests']:.0f} requests, ISL {s['isl_mean']:.0f}, "
            f"OSL {s['osl_mean']:.0f}, "
            f"prefix bound {100 * s['prefix_bound_tokens']:.1f} %",
            file=sys.stderr,
        )
    jobs: list[tuple[dict[str, Any], str, str, dict[str, Any]]] = []
    for c in cells:
        cell = {
            "id": c.id,
            "workers": c.workers,
            "speedup": c.speedup,
            "trace_block_size": c.trace_block_size,
            "requests": c.requests,
        }
        if args.cv:
            jobs.append((cell, str(traces[c.id]), "round-robin", {}))
            points = GRID if args.cv_points is None else [GRID[i] for i in args.cv_points]
            jobs += [(cell, str(traces[c.id]), pol, params) for pol, params in points]
        else:
            jobs += [(cell, str(traces[c.id]), p, {}) for p in args.policies]
    rows = run_jobs(jobs, args.out / "kvmesh.jsonl", args.jobs)
    if args.cv:
        text = cross_validate(cells, rows)
        (args.out / "cv.txt").write_text(text + "\n")
        print(text)
        return
    dyn_rows = run_dynamo(cells, traces, args.out, args.dynamo_python) if args.dynamo_python else []
    before = None
    if args.before is not None:
        before = [json.loads(line) for line in args.before.read_text().splitlines()]
    text = report(cells, rows, dyn_rows, before_rows=before)
    (args.out / "matrix.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
