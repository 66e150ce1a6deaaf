#!/usr/bin/env python3
"""How well the ttft policy predicts the TTFT a request then sees (issue 10).

Replays cells of the routing matrix (tests/benchmarks/routing_matrix.py: same traces, loads and
workers) with the KV router's default policy and compares, per request, the TTFT the policy
predicted on the worker it chose (KvScheduler's Selection.cost with the ITL penalty off and
without the decode-delay term) with the TTFT the request saw in the replay. Per cell and over
all cells: bias (mean of predicted - realized), mean absolute error, that error over the mean
realized TTFT, and the 90th percentile of the absolute error, in simulated ms; then the same
over all cells by the state of the chosen worker when the request was routed (idle, decoding
only, prefill queued: where the prediction errs differs by state, e.g. a busy worker's step in
progress, which the request waits out before its own).

    .venv/bin/python tests/benchmarks/ttft_prediction_error.py                     # 4 workers
    .venv/bin/python tests/benchmarks/ttft_prediction_error.py --cells conv/steady  # a subset

`--cells` keeps the cells whose id contains any of the given strings; traces are written to
(and read from) routing_matrix.py's --out folder.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routing_matrix as rm  # the benchmark next to this one

from kvmesh.router.kv_policy import KvPolicyKind
from kvmesh.router.kv_scheduler import KvScheduler
from kvmesh.sim.cluster import Cluster
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.policies import KvPolicy, Route
from kvmesh.sim.replay import AggregatedReplay
from kvmesh.sim.trace import load_trace


class RecordingPolicy(KvPolicy):
    """The replay's KV policy, keeping the predicted TTFT of every routed request: the score of
    the worker it chose without the decode-delay term (what its prefill costs the others, not
    part of its own TTFT) and without the ITL penalty."""

    def __init__(self, config: ReplayConfig, worker_ids: list[str]) -> None:
        super().__init__(config.kv_router(), worker_ids, config.mocker)
        self.predicted_ms: dict[str, float] = {}
        self.state: dict[str, str] = {}
        """The chosen worker's state when the request was routed (STATES)."""

    def route(
        self,
        request_id: str,
        prompt: list[int],
        now: float,
        *,
        candidates: Sequence[int] | None = None,
        expected_output_tokens: int = 0,
    ) -> Route:
        cfg = self.sched.config
        ids = None if candidates is None else [self.worker_ids[c] for c in candidates]
        delay, cfg.decode_delay_weight = cfg.decode_delay_weight, 0.0
        itl, cfg.itl_weight = cfg.itl_weight, 0.0
        try:  # select books nothing: the same state, scored by TTFT alone
            own = self.sched.select(
                prompt, now, candidates=ids, expected_output_tokens=expected_output_tokens
            ).costs
        finally:
            cfg.decode_delay_weight = delay
            cfg.itl_weight = itl
        states = {wid: _state(self.sched, wid, now) for wid in own}
        r = super().route(
            request_id,
            prompt,
            now,
            candidates=candidates,
            expected_output_tokens=expected_output_tokens,
        )
        self.predicted_ms[request_id] = own[self.worker_ids[r.worker]]
        self.state[request_id] = states[self.worker_ids[r.worker]]
        return r


STATES = ("idle", "decoding only", "prefill queued")


def _state(sched: KvScheduler, worker_id: str, now: float) -> str:
    load = sched.worker(worker_id)
    assert load is not None
    prefill, decode, _ = load.view(now, sched.config.load_max_age_s)
    return STATES[2] if prefill > 0 else STATES[1] if decode > 0 else STATES[0]


def errors(c: rm.Cell, out: Path) -> tuple[list[float], list[float], list[str]]:
    """(predicted - realized, realized) TTFT in ms of every request of the cell that got one,
    and the state of the worker it was routed to (STATES)."""
    trace_path = str(rm.prepare_trace(out, c))
    config = ReplayConfig(
        trace=trace_path,
        workers=c.workers,
        speedup=c.speedup,
        trace_block_size=c.trace_block_size,
        limit=c.requests,
    )
    if config.router_policy is not KvPolicyKind.TTFT:
        raise SystemExit("the default policy is not the ttft policy")
    worker_ids = [f"w{i}" for i in range(c.workers)]
    policy = RecordingPolicy(config, worker_ids)
    cluster = Cluster(load_trace(trace_path, c.requests), config, worker_ids, policy)
    cluster.run(AggregatedReplay(cluster))
    t = cluster.timeline
    diffs: list[float] = []
    real: list[float] = []
    states: list[str] = []
    for i, arrival in enumerate(t.arrival):
        predicted = policy.predicted_ms.get(f"r{i}")
        if predicted is None or math.isnan(t.first_at[i]):
            continue
        ttft = (t.first_at[i] - arrival) * 1e3
        diffs.append(predicted - ttft)
        real.append(ttft)
        states.append(policy.state[f"r{i}"])
    return diffs, real, states


def line(name: str, diffs: list[float], real: list[float]) -> str:
    abs_err = sorted(abs(d) for d in diffs)
    mae = statistics.fmean(abs_err)
    mean = statistics.fmean(real)
    p90 = abs_err[int(0.9 * len(abs_err))]
    return (
        f"| {name} | {len(diffs)} | {mean:.0f} | {statistics.fmean(diffs):+.1f} | {mae:.1f} "
        f"| {mae / mean:.2f} | {p90:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=rm.ROOT / ".cache" / "routing_matrix")
    parser.add_argument("--workloads", nargs="+", default=list(rm.WORKLOADS))
    parser.add_argument("--workers", nargs="+", type=int, default=[4])
    parser.add_argument("--cells", nargs="*", default=[], help="keep ids containing any of these")
    args = parser.parse_args()
    cells = [
        c
        for c in rm.matrix_cells(args.workloads, args.workers)
        if not args.cells or any(s in c.id for s in args.cells)
    ]
    print(
        "| cell | requests | realized TTFT mean ms | bias ms | MAE ms | MAE / mean | p90 abs ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    all_diffs: list[float] = []
    all_real: list[float] = []
    all_states: list[str] = []
    for c in cells:
        diffs, real, states = errors(c, args.out)
        print(line(c.id, diffs, real), flush=True)
        all_diffs += diffs
        all_real += real
        all_states += states
    if len(cells) > 1:
        print(line("all", all_diffs, all_real))
    print("\n| chosen worker's state (all cells) | requests | realized TTFT mean ms | bias ms "
          "| MAE ms | MAE / mean | p90 abs ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for state in STATES:
        keep = [i for i, s in enumerate(all_states) if s == state]
        if keep:
            print(line(state, [all_diffs[i] for i in keep], [all_real[i] for i in keep]))


if __name__ == "__main__":
    main()
