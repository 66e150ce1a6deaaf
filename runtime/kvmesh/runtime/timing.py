"""How long an engine's scheduler step takes: the timing model the mocker simulates with
(kvmesh.workers.mocker) and a latency-predicting router predicts with (kvmesh.router), so it
lives below both.

A step that prefills T new tokens (summed over every request prefilling in the step) and has
decode work at KV usage u (the decoding requests' context tokens over the pool's token slots,
num_gpu_blocks x block_size, as Dynamo's mocker counts it; see kvmesh.workers.mocker.scheduler)
lasts

    prefill_ms(T) + decode_ms(u)

where prefill_ms is 0 when the step prefills nothing and decode_ms is 0 when no request decodes in
the step. This is what the Dynamo mocker does: a forward pass costs its prefill plus its decode,
and the first token of a prefill (sampled at the end of the prefill) adds no decode time.

Default model: the Dynamo mocker polynomial (`PerfModel::Polynomial`):

    prefill_ms(T) = 4.209989e-7 * T**2 + 1.518344e-2 * T + 16.50142          (T > 0)
    decode_ms(u)  = max(1.0, -25.74 * u**2 + 54.01 * u + 5.74)                (u clamped to [0, 1])

Table model: a JSON file (MockerConfig.timing_profile) measured on real hardware:

    {
      "prefill_tokens": [128, 1024, 8192],     # new prefill tokens in a step, increasing
      "prefill_ms":     [18.5, 33.0, 160.0],   # step prefill time at those token counts
      "decode_kv_usage": [0.0, 0.5, 1.0],      # KV usage fraction, increasing
      "decode_ms":       [6.0, 25.0, 34.0]     # decode time at those usages
    }

Values between points are linearly interpolated; outside the table they are linearly extrapolated
from the nearest segment (a single point means a constant). Results are floored at 0 for prefill
and at 1 ms for decode (as Dynamo does, so token-emitting steps never take zero time).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from pathlib import Path
from typing import Protocol

__all__ = [
    "PolynomialTiming",
    "TableTiming",
    "TimingModel",
    "load_timing",
]


class TimingModel(Protocol):
    """Step duration model; both methods return milliseconds."""

    def prefill_ms(self, new_tokens: int) -> float:
        """Time to prefill `new_tokens` tokens in one step (0 when new_tokens == 0)."""
        ...

    def decode_ms(self, kv_usage: float) -> float:
        """Time of the decode part of a step at KV usage fraction `kv_usage`."""
        ...


class PolynomialTiming:
    """The Dynamo mocker's polynomial model (see the module docstring)."""

    __slots__ = ()

    def prefill_ms(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142

    def decode_ms(self, kv_usage: float) -> float:
        u = min(max(kv_usage, 0.0), 1.0)
        return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


class _Table:
    """Piecewise-linear function through (xs, ys), extrapolated linearly at both ends."""

    __slots__ = ("xs", "ys")

    def __init__(self, xs: list[float], ys: list[float], name: str) -> None:
        if len(xs) != len(ys) or not xs:
            raise ValueError(f"timing profile: {name} needs two non-empty lists of equal length")
        if any(not math.isfinite(v) for v in (*xs, *ys)):
            raise ValueError(f"timing profile: {name} values must be finite numbers")
        if any(b <= a for a, b in itertools.pairwise(xs)):
            raise ValueError(f"timing profile: {name} x values must be strictly increasing")
        self.xs = xs
        self.ys = ys

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        i = bisect.bisect_right(xs, x)
        i = min(max(i, 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class TableTiming:
    """Timing interpolated from measured tables (format in the module docstring)."""

    __slots__ = ("_decode", "_prefill")

    def __init__(
        self,
        prefill_tokens: list[float],
        prefill_ms: list[float],
        decode_kv_usage: list[float],
        decode_ms: list[float],
    ) -> None:
        self._prefill = _Table(prefill_tokens, prefill_ms, "prefill")
        self._decode = _Table(decode_kv_usage, decode_ms, "decode")

    def prefill_ms(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return max(0.0, self._prefill(float(new_tokens)))

    def decode_ms(self, kv_usage: float) -> float:
        return max(1.0, self._decode(kv_usage))


def load_timing(path: str) -> TimingModel:
    """The table model read from `path`, or the polynomial model when `path` is empty."""
    if not path:
        return PolynomialTiming()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read timing profile {path!r}: {e}") from e
    keys = ("prefill_tokens", "prefill_ms", "decode_kv_usage", "decode_ms")
    if not isinstance(data, dict) or any(not isinstance(data.get(k), list) for k in keys):
        raise ValueError(f"timing profile {path!r} must be a JSON object with lists {keys}")
    try:
        tables = [[float(v) for v in data[k]] for k in keys]
    except (TypeError, ValueError) as e:
        raise ValueError(f"timing profile {path!r}: values must be numbers") from e
    return TableTiming(*tables)
