"""The SLA planner against static pools and a reactive queue-length autoscaler, in `kvmesh
replay` (virtual time, mocker workers, the live routing and planner code).

For each trace: reshape it into a day (low -> peak -> low, `kvmesh reshape`), then replay it
with the exact command line of the issue's contract:

    kvmesh replay --trace DAY --router kv --block-size 64 --ttft-slo-ms X --itl-slo-ms Y --json \\
        [--workers N | --planner sla --min-workers 1 --max-workers B --worker-startup-s S]

  * static pools of N workers, N going up until the pool meets the SLO for >= 95 % of the
    requests (the smallest such pool is the reference);
  * the SLA planner (its defaults: Kalman predictor, the mocker's profile measured in virtual
    time), min 1 worker, max 2x the reference;
  * the reactive baseline (`--planner queue`, HPA/KEDA on in-flight requests per worker), with
    the target a load test would set: the requests one worker holds in flight at the SLO, per
    the same profile (and, for the record, half and twice that).

Prints a Markdown table (SLO attainment, worker-hours, ratio to the reference) and writes a
PNG per trace (load, replicas, latency over the day). About 10-30 minutes on 2 cores.

    python tests/benchmarks/bench_planner.py --out /tmp/planner-bench [--traces conv,mooncake]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.planner.model import WorkerModel
from kvmesh.runtime.types import Role
from kvmesh.sim.main import write_timeline_plot
from kvmesh.sim.profiler import profile_mocker
from kvmesh.sim.reshape import reshape_day
from kvmesh.sim.trace import load_trace, write_trace
from kvmesh.workers.mocker.config import MockerConfig

TRACES = Path(__file__).resolve().parents[3] / "shared" / "ref" / "traces"


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    duration_s: float
    low_rps: float
    peak_rps: float
    ttft_slo_ms: float
    itl_slo_ms: float
    startup_s: float
    first_guess: int
    """Static pool size to start the search from (the search goes up, and down if it passes)."""


CASES = {
    "conv": Case(
        "Azure conv (day)", "AzureLLMInferenceTrace_conv.csv", 400.0, 5.0, 100.0,
        250.0, 15.0, 10.0, 9,
    ),
    "code": Case(
        "Azure code (day)", "AzureLLMInferenceTrace_code.csv", 400.0, 4.0, 80.0,
        300.0, 15.0, 10.0, 6,
    ),
    "mooncake": Case(
        "Mooncake synthetic (day)", "mooncake_synthetic_trace.jsonl", 600.0, 0.8, 16.0,
        3000.0, 30.0, 10.0, 8,
    ),
}  # fmt: skip


def replay(case: Case, day: Path, *extra: str) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "kvmesh", "replay", "--trace", str(day), "--router", "kv",
        "--block-size", "64", "--ttft-slo-ms", str(case.ttft_slo_ms),
        "--itl-slo-ms", str(case.itl_slo_ms), "--json", *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    print(
        f"  {' '.join(extra):70} SLO {100 * row['slo_attainment']:6.2f} %  "
        f"{row['worker_hours']:7.3f} worker-h  ({time.perf_counter() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return row


def queue_target(case: Case, day_path: Path) -> float:
    """In-flight requests one worker holds at the SLO (mean ISL/OSL of the day), per the
    mocker's profile: what a load test would give an HPA/KEDA setup as its target."""
    trace = load_trace(str(day_path))
    isl = sum(r.input_length for r in trace.requests) / len(trace.requests)
    osl = sum(r.max_tokens for r in trace.requests) / len(trace.requests)
    profile = profile_mocker(MockerConfig())
    model = WorkerModel(
        profile.prefill_curve(Role.AGGREGATED), profile.decode_grid(Role.AGGREGATED)
    )
    cap = model.capacity(isl, osl, case.ttft_slo_ms, case.itl_slo_ms)
    lat = model.latency(cap, isl, osl)
    return max(1.0, round(cap * (lat.ttft_ms + (osl - 1) * lat.itl_ms) / 1e3, 1))


def run_case(key: str, case: Case, out: Path, jobs: int) -> dict[str, Any]:
    day = reshape_day(
        load_trace(str(TRACES / case.source)),
        duration_s=case.duration_s,
        low_rps=case.low_rps,
        peak_rps=case.peak_rps,
        seed=0,
    )
    path = out / f"{key}_day.jsonl"
    write_trace(day, str(path))
    print(f"{case.name}: {len(day.requests)} requests over {case.duration_s:g} s", file=sys.stderr)
    # Every replay of the day is independent: they run `jobs` at a time. The static search
    # starts with first_guess - 1 .. + 1 and extends upward (or downward) until it brackets
    # the smallest pool meeting the SLO for >= 95 %; the planned runs go alongside it, their
    # maximum 2x the first guess.
    pool = ThreadPoolExecutor(jobs)
    planned = ["--min-workers", "1", "--max-workers", str(2 * case.first_guess),
               "--worker-startup-s", str(case.startup_s)]  # fmt: skip
    target = queue_target(case, path)
    sla_f = pool.submit(replay, case, path, "--planner", "sla", *planned)
    queue_f = {
        t: pool.submit(replay, case, path, "--planner", "queue", *planned, "--queue-target", str(t))
        for t in (target, round(target / 2, 1), round(target * 2, 1))
    }
    static_f = {
        n: pool.submit(replay, case, path, "--workers", str(n))
        for n in range(max(1, case.first_guess - 1), case.first_guess + 2)
    }
    static: dict[int, dict[str, Any]] = {}
    while True:
        static.update({n: f.result() for n, f in static_f.items()})
        meets = [n for n, r in static.items() if r["slo_attainment"] >= 0.95]
        if meets and (min(meets) - 1 in static or min(meets) == 1):
            break
        n = min(meets) - 1 if meets else max(static) + 1
        static_f = {n: pool.submit(replay, case, path, "--workers", str(n))}
    ref_n = min(meets)
    ref = static[ref_n]
    sla = sla_f.result()
    queues = {t: f.result() for t, f in queue_f.items()}
    pool.shutdown()
    runs = [dict(ref, mode=f"static {ref_n}"), dict(sla, mode="sla planner"),
            dict(queues[target], mode=f"queue (target {target:g})")]  # fmt: skip
    write_timeline_plot(runs, str(out / f"{key}_day.png"), title=case.name)
    return {
        "case": case,
        "requests": len(day.requests),
        "static": static,
        "ref_n": ref_n,
        "sla": sla,
        "queues": queues,
        "queue_target": target,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| trace | policy | SLO met | worker-hours | vs static ref |",
        "|---|---|---:|---:|---:|",
    ]
    for res in results:
        case: Case = res["case"]
        ref = res["static"][res["ref_n"]]
        name = (
            f"{case.name}: {res['requests']} req, {case.low_rps:g}->{case.peak_rps:g}->"
            f"{case.low_rps:g} req/s over {case.duration_s:g} s; TTFT <= {case.ttft_slo_ms:g} "
            f"ms, ITL <= {case.itl_slo_ms:g} ms, start-up {case.startup_s:g} s"
        )
        rows = [(f"static {n}" + (" (ref)" if n == res["ref_n"] else ""), r)
                for n, r in sorted(res["static"].items())]  # fmt: skip
        rows.append(("SLA planner", res["sla"]))
        rows += [(f"queue, target {t:g}" + (" (load test)" if t == res["queue_target"] else ""),
                  r) for t, r in res["queues"].items()]  # fmt: skip
        for i, (policy, r) in enumerate(rows):
            lines.append(
                f"| {name if i == 0 else ''} | {policy} | {100 * r['slo_attainment']:.2f} % | "
                f"{r['worker_hours']:.3f} | {r['worker_hours'] / ref['worker_hours']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="/tmp/planner-bench", help="days, plots, results")
    parser.add_argument("--traces", default="conv,mooncake", help=f"of {', '.join(CASES)}")
    parser.add_argument("--jobs", type=int, default=4, help="replays run at once")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_case(k, CASES[k], out, args.jobs) for k in args.traces.split(",")]
    text = table(results)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps(
            [{k: v for k, v in r.items() if k != "case"} | {"case": r["case"].__dict__}
             for r in results],
            default=str,
        )
    )  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
