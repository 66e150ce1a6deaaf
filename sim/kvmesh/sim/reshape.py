"""`kvmesh reshape`: a trace's requests re-timed into a day: low, then peak, then low again.

Arrivals follow a Poisson process whose rate goes from `--low-rps` at the start, up to
`--peak-rps` at the middle, and back down to `--low-rps` at the end:

    rate(t) = low + (peak - low) * sin(pi * t / duration)**2        (0 <= t <= duration)

with `--shape day` (the default); the other shapes, for planners' held-out cases:

    two-peaks: low + (peak - low) * sin(2 pi t / duration)**2    (peaks at 1/4 and 3/4)
    ramp:      low until 20 % of the day, a straight ramp to peak by 30 %, peak until 60 %,
               straight down to low by 70 %, low after (sharp ramps, a plateau)
    flash:     low, except a flash crowd at peak from 40 % to 50 % of the day (a step up and
               a step down, no ramp at all)

(drawn by thinning a `peak`-rate process, seeded: the same flags give the same file). The k-th
arrival gets the source trace's k-th request (its prompt and output lengths, its prefix
hash ids), in the source's order; when the day needs more requests than the trace holds, it
starts over from the first, with hash ids shifted past every id of the trace so a repeat
shares no prefix with the original (Azure traces have no hash ids: every prompt is unique
anyway). The result is written as Mooncake JSONL (kvmesh.sim.trace.write_trace), which `kvmesh
replay --trace` reads.

    kvmesh reshape --trace ../shared/ref/traces/AzureLLMInferenceTrace_conv.csv \\
        --out conv_day.jsonl --duration-s 600 --low-rps 8 --peak-rps 80
"""

from __future__ import annotations

import enum
import math
import random
import sys
from dataclasses import dataclass

from kvmesh.runtime.config import opt
from kvmesh.sim.config import ReplayError
from kvmesh.sim.trace import Trace, TraceRequest, load_trace, write_trace

__all__ = ["DayShape", "ReshapeConfig", "day_rate", "reshape_day", "run_reshape"]


class DayShape(enum.Enum):
    """How the arrival rate goes over the day (see the module doc)."""

    DAY = "day"
    TWO_PEAKS = "two-peaks"
    RAMP = "ramp"
    FLASH = "flash"


@dataclass
class ReshapeConfig:
    """Settings of `kvmesh reshape`."""

    trace: str = opt("", "the trace whose requests are re-timed (Mooncake JSONL or Azure CSV)")
    out: str = opt("", "where to write the day (Mooncake JSONL)")
    duration_s: float = opt(600.0, "length of the day, s")
    low_rps: float = opt(5.0, "arrival rate at the start and the end, requests/s")
    peak_rps: float = opt(50.0, "arrival rate at the middle, requests/s")
    seed: int = opt(0, "seed of the arrival process")
    shape: DayShape = opt(DayShape.DAY, "day, two-peaks, ramp (sharp) or flash (a flash crowd)")

    def __post_init__(self) -> None:
        self.shape = DayShape(self.shape)
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ReplayError("--duration-s must be a positive number")
        if not 0 <= self.low_rps <= self.peak_rps or not 0 < self.peak_rps < math.inf:
            raise ReplayError("need 0 <= --low-rps <= --peak-rps, and --peak-rps > 0")


def day_rate(
    t: float, duration_s: float, low_rps: float, peak_rps: float, shape: DayShape = DayShape.DAY
) -> float:
    """The arrival rate at `t` seconds into the day (see the module doc)."""
    x = t / duration_s
    if shape is DayShape.DAY:
        level = math.sin(math.pi * x) ** 2
    elif shape is DayShape.TWO_PEAKS:
        level = math.sin(2 * math.pi * x) ** 2
    elif shape is DayShape.RAMP:
        level = min(1.0, max(0.0, (x - 0.2) / 0.1), max(0.0, (0.7 - x) / 0.1))
    else:
        level = 1.0 if 0.4 <= x < 0.5 else 0.0
    return low_rps + (peak_rps - low_rps) * level


def reshape_day(
    trace: Trace,
    *,
    duration_s: float,
    low_rps: float,
    peak_rps: float,
    seed: int = 0,
    shape: DayShape = DayShape.DAY,
) -> Trace:
    """`trace`'s requests at the arrival times of one day (see the module doc)."""
    rng = random.Random(seed)
    source = trace.requests
    shift = 1 + max((h for r in source for h in r.hash_ids), default=-1)
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak_rps)
        if t >= duration_s:
            break
        if rng.random() * peak_rps > day_rate(t, duration_s, low_rps, peak_rps, shape):
            continue
        k = len(out)
        r = source[k % len(source)]
        offset = (k // len(source)) * shift
        out.append(
            TraceRequest(t * 1e3, r.input_length, r.output_length, [h + offset for h in r.hash_ids])
        )
    if not out:
        raise ReplayError("the day holds no request: raise --peak-rps or --duration-s")
    name = "day" if shape is DayShape.DAY else f"{shape.value} day"
    return Trace(f"{trace.path} ({name} of {duration_s:g} s, {low_rps:g}-{peak_rps:g} req/s)", out)


def run_reshape(config: ReshapeConfig) -> int:
    """`kvmesh reshape`: read, re-time, write; prints a one-line summary."""
    if not config.out:
        raise ReplayError("pass --out FILE: where to write the day")
    day = reshape_day(
        load_trace(config.trace),
        duration_s=config.duration_s,
        low_rps=config.low_rps,
        peak_rps=config.peak_rps,
        seed=config.seed,
        shape=config.shape,
    )
    write_trace(day, config.out)
    print(
        f"{config.out}: {len(day.requests)} requests over {config.duration_s:g} s "
        f"({config.shape.value}: {config.low_rps:g} -> {config.peak_rps:g} -> "
        f"{config.low_rps:g} req/s)",
        file=sys.stdout,
    )
    return 0
