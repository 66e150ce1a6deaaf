"""`kvmesh replay`: load a trace, replay it once per router mode (and disaggregated), print
tables or JSON lines, plot TTFT CDFs."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from kvmesh.planner.config import PlannerPolicy
from kvmesh.planner.profile import PerfProfile
from kvmesh.runtime.plotting import pyplot, require_matplotlib
from kvmesh.sim.config import ReplayConfig, ReplayError
from kvmesh.sim.disagg import DisaggStats, simulate_disaggregated
from kvmesh.sim.planned import simulate_planned
from kvmesh.sim.profiler import profile_mocker
from kvmesh.sim.replay import simulate
from kvmesh.sim.results import ModeResult
from kvmesh.sim.trace import load_trace, prefix_hit_bound

# -- output ---------------------------------------------------------------------------------


class _ProgressBar:
    """One self-overwriting line on a terminal: bar, requests done, simulated time, wall time."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream = stream
        self.label = label
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int, sim_s: float) -> None:
        frac = done / total if total else 1.0
        width = 30
        fill = int(frac * width)
        self.stream.write(
            f"\r{self.label:>12} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests, "
            f"sim {sim_s:7.1f} s, wall {time.perf_counter() - self.t0:5.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r\033[K")
        self.stream.flush()


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _tier_rate(tier: str) -> Callable[[ModeResult], str]:
    return lambda r: _pct(r.tier_hit_rates.get(tier, 0.0))


def format_table(results: list[ModeResult]) -> str:
    """Human-readable comparison of the modes, then each mode's per-worker balance."""
    first = results[0]
    lines = [
        f"kvmesh replay: {first.trace}, {first.requests_total} requests, {first.workers} workers, "
        f"arrivals x{first.speedup:g}, block {first.block_size}, "
        f"{first.num_gpu_blocks} blocks/worker"
        + (f", host tier {first.kv_host_blocks}" if first.kv_host_blocks else "")
        + (f", disk tier {first.kv_disk_blocks}" if first.kv_disk_blocks else ""),
        "",
    ]
    rows: list[tuple[str, Callable[[ModeResult], str]]] = [
        ("requests done", lambda r: f"{r.requests}/{r.requests_total}"),
        ("throughput req/s", lambda r: f"{r.throughput_rps:.3f}"),
        ("output tok/s", lambda r: f"{r.output_tokens_per_s:.1f}"),
        ("TTFT mean ms", lambda r: f"{r.ttft_ms.mean:.1f}"),
        ("TTFT p50 ms", lambda r: f"{r.ttft_ms.p50:.1f}"),
        ("TTFT p90 ms", lambda r: f"{r.ttft_ms.p90:.1f}"),
        ("TTFT p99 ms", lambda r: f"{r.ttft_ms.p99:.1f}"),
        ("ITL mean ms", lambda r: f"{r.itl_ms.mean:.2f}"),
        ("ITL p50 ms", lambda r: f"{r.itl_ms.p50:.2f}"),
        ("ITL p99 ms", lambda r: f"{r.itl_ms.p99:.2f}"),
        ("E2E mean ms", lambda r: f"{r.e2e_ms.mean:.1f}"),
        ("E2E p99 ms", lambda r: f"{r.e2e_ms.p99:.1f}"),
        ("prefix hit rate", lambda r: _pct(r.prefix_hit_rate)),
        ("  bound (blocks)", lambda r: _pct(r.prefix_hit_rate_bound)),
        *(
            (f"  from {tier}", _tier_rate(tier))
            for tier in ("device", "host", "disk")
            if any(tier in r.tier_hit_rates for r in results) and first.kv_host_blocks
        ),
        ("preemptions", lambda r: str(r.preemptions)),
        ("req imbalance", lambda r: f"{r.imbalance['requests_max_over_mean']:.2f}"),
        ("busy imbalance", lambda r: f"{r.imbalance['busy_fraction_max_over_mean']:.2f}"),
        ("simulated s", lambda r: f"{r.duration_s:.1f}"),
        ("wall s", lambda r: f"{r.wall_s:.1f}"),
    ]
    width = max(12, *(len(r.mode) for r in results))
    lines.append(f"{'':18}" + "".join(f"{r.mode:>{width + 2}}" for r in results))
    for label, fmt in rows:
        lines.append(f"{label:18}" + "".join(f"{fmt(r):>{width + 2}}" for r in results))
    for r in results:
        lines += ["", f"{r.mode}: per worker", "  worker  requests  prompt tokens  cached    busy"]
        for w in r.per_worker:
            hit = w.cached_tokens / w.prompt_tokens if w.prompt_tokens else 0.0
            lines.append(
                f"  {w.worker:6}  {w.requests:8}  {w.prompt_tokens:13}  {_pct(hit):>6}  "
                f"{_pct(w.busy_fraction):>6}"
            )
    return "\n".join(lines)


def write_plot(results: list[ModeResult], path: str) -> None:
    """TTFT CDF per mode as a PNG (matplotlib, an optional dependency: kvmesh[plot])."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = sorted(1e3 * t for t in r.ttft_s)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=f"{r.mode} (mean {r.ttft_ms.mean:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, simulated)")
    ax.set_ylabel("fraction of requests")
    first = results[0]
    ax.set_title(f"{Path(first.trace).name}: {first.workers} workers, arrivals x{first.speedup:g}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_timeline_plot(runs: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Load, replicas and latency over time as a PNG, one line per run (`kvmesh replay --json`
    objects): arrival rate; replicas (serving; dotted: serving + starting + draining); TTFT p90
    and ITL p90 of the requests arriving in each interval, with the SLO targets."""
    plt = pyplot()
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(9, 10))
    first = runs[0]
    rows0 = first["timeline"]
    t0 = rows0[0]["t_s"] if rows0 else 0.0
    axes[0].plot([(r["t_s"] - t0) / 60 for r in rows0], [r["arrival_rps"] for r in rows0],
                 color="black")  # fmt: skip
    axes[0].set_ylabel("arrivals (req/s)")
    for run in runs:
        rows = run["timeline"]
        x = [(r["t_s"] - t0) / 60 for r in rows]
        label = (
            f"{run['mode']}: {run['worker_hours']:.2f} worker-h, "
            f"SLO met by {100 * run['slo_attainment']:.1f} %"
        )
        (line,) = axes[1].step(x, [r["serving"] for r in rows], where="post", label=label)
        total = [r["serving"] + r["starting"] + r["draining"] for r in rows]
        axes[1].step(x, total, where="post", linestyle=":", color=line.get_color())
        axes[2].plot(x, [r["ttft_p90_ms"] for r in rows], color=line.get_color())
        axes[3].plot(x, [r["itl_p90_ms"] for r in rows], color=line.get_color())
    axes[1].set_ylabel("workers (dotted: +starting, draining)")
    axes[1].legend(fontsize=8, loc="upper left")
    axes[2].axhline(first["ttft_slo_ms"], color="red", linestyle="--", linewidth=1)
    axes[2].set_ylabel("TTFT p90 (ms)")
    axes[2].set_yscale("log")
    axes[3].axhline(first["itl_slo_ms"], color="red", linestyle="--", linewidth=1)
    axes[3].set_ylabel("ITL p90 (ms, per request)")
    axes[3].set_xlabel("time (min, simulated)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or Path(str(first["trace"]).split(" (")[0]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _std(stream: TextIO | None) -> TextIO:
    if stream is None:  # e.g. pythonw: no console
        raise ReplayError("no standard output to write the results to")
    return stream


@contextmanager
def _progress_bar(err: TextIO, label: str, show: bool) -> Iterator[_ProgressBar | None]:
    bar = _ProgressBar(err, label) if show else None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def _disagg_summary(stats: DisaggStats) -> tuple[dict[str, int], str]:
    """The `disagg` object of the JSON line, and the note under the table."""
    local = stats.local_prefills_total
    reasons = ", ".join(f"{n} {r.value}" for r, n in stats.local_prefills.items() if n)
    note = (
        f"{stats.remote_prefills} remote prefills, {local} local ({reasons or 'none'}), "
        f"{stats.transfer_fallbacks} transfer fallbacks, "
        f"{stats.kv_transfer_bytes / 1e9:.2f} GB of KV moved"
    )
    row = {
        "remote_prefills": stats.remote_prefills,
        "local_prefills": local,
        "transfer_fallbacks": stats.transfer_fallbacks,
        "kv_transfer_bytes": stats.kv_transfer_bytes,
    }
    return row, note


def run_replay(
    config: ReplayConfig, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """`kvmesh replay`: load the trace, replay it once per router mode (and disaggregated with
    --prefill-workers), print the results."""
    out = out if out is not None else _std(sys.stdout)
    err = err if err is not None else _std(sys.stderr)
    if config.plot:
        require_matplotlib()
    trace = load_trace(config.trace, config.limit)
    bound_blocks, bound_tokens = prefix_hit_bound(trace, config.trace_block_size)
    show = config.progress and not config.json and err.isatty()
    results: list[ModeResult] = []
    notes: list[str] = []

    def report(result: ModeResult, extra: dict[str, Any]) -> None:
        result.prefix_hit_rate_bound = bound_blocks
        result.prefix_hit_rate_bound_tokens = bound_tokens
        results.append(result)
        if config.json:
            out.write(json.dumps({**result.to_json(), **extra}) + "\n")
            out.flush()

    profile = None
    if config.planner is PlannerPolicy.SLA:
        path = config.planning.profile
        profile = (
            PerfProfile.load(path)
            if path
            else profile_mocker(config.mocker, max_model_len=config.mocker.max_model_len)
        )
    for mode in config.router:
        with _progress_bar(err, mode.value, show) as bar:
            if config.planner is not None:
                report(simulate_planned(trace, config, mode, profile, progress=bar), {})
            else:
                report(simulate(trace, config, mode, progress=bar), {})
    if config.prefill_workers:
        with _progress_bar(err, f"kv-disagg-{config.prefill_workers}p", show) as bar:
            result, stats = simulate_disaggregated(trace, config, progress=bar)
        row, note = _disagg_summary(stats)
        report(result, {"disagg": row})
        notes.append(f"{result.mode}: {note}")
    if not config.json:
        out.write(format_table(results) + "\n")
        for note in notes:
            out.write(f"\n{note}\n")
    if config.plot:
        if config.planner is not None:
            write_timeline_plot([r.to_json() for r in results], config.plot)
            what = "load, replicas and latency over time"
        else:
            write_plot(results, config.plot)
            what = "TTFT CDF"
        if not config.json:
            out.write(f"\n{what} written to {config.plot}\n")
    return 0
