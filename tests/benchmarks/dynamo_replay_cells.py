#!/usr/bin/env python3
"""NVIDIA Dynamo's offline replay on the cells of kvmesh's routing matrix (routing_matrix.py).

Runs in Dynamo's own venv (../shared/peers/install_dynamo.sh puts ai-dynamo 1.6.1 in
/tmp/dynamo_peer/venv); nothing here imports kvmesh. For each cell of the JSON list `--cells`
(`id`, `trace`, `trace_block_size`, `workers`, `speedup`) and each router mode it calls
`dynamo._core.run_mocker_trace_replay` (its mocker with default engine settings at block size
64, the same as kvmesh's replay; `kv_router` with the default KvRouterConfig) `--reps` times:
Dynamo's KV router is not deterministic from run to run, so the median of the reps is what the
matrix compares. One JSON line per (cell, mode) is appended to `--out`; cells already there are
skipped (a long run can be resumed).

    /tmp/dynamo_peer/venv/bin/python tests/benchmarks/dynamo_replay_cells.py \\
        --cells .cache/routing_matrix/cells.json --out .cache/routing_matrix/dynamo.jsonl
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("DYN_LOG", "error")  # the KV router logs every decision at INFO

KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "prefix_cache_reused_ratio")


def run(cell: dict, mode: str) -> dict:
    from dynamo._core import run_mocker_trace_replay  # Dynamo's venv only

    t0 = time.perf_counter()
    res = run_mocker_trace_replay(
        [cell["trace"]],
        extra_engine_args={"engine": {"block_size": 64}},
        num_workers=cell["workers"],
        router_mode=mode,
        arrival_speedup_ratio=cell["speedup"],
        trace_block_size=cell["trace_block_size"],
        capture_per_request=True,
    )
    out = {k: res.summary[k] for k in KEYS}
    out["completed"] = res.summary["completed_requests"]
    per_worker = Counter(p["decode_worker_idx"] for p in res.per_request)
    mean = len(res.per_request) / cell["workers"]
    out["req_imbalance"] = max(per_worker.values()) / mean if mean else 0.0
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cells", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", default=["kv_router", "round_robin"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cells = json.loads(args.cells.read_text())
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done.add((row["id"], row["mode"]))
    version = importlib.metadata.version("ai-dynamo")
    with args.out.open("a") as f:
        for cell in cells:
            for mode in args.modes:
                if (cell["id"], mode) in done:
                    continue
                runs = [run(cell, mode) for _ in range(args.reps)]
                row = {"id": cell["id"], "mode": mode, "ai_dynamo": version, "reps": len(runs)}
                for key in runs[0]:
                    row[key] = statistics.median(r[key] for r in runs)
                row["runs"] = runs
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(
                    f"[dynamo {cell['id']} {mode}] ttft {row['mean_ttft_ms']:.0f} / "
                    f"p99 {row['p99_ttft_ms']:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )


if __name__ == "__main__":
    main()
