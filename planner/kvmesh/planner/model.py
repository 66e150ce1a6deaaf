"""The latency model the SLA planner plans with: from a performance profile, the TTFT and ITL one
worker shows at a given request rate, and the highest rate that meets given targets.

Aggregated worker, `rate` requests/s of `isl` prompt and `osl` output tokens (the mocker's and
vLLM's continuous batching with chunked prefill: a step that prefills also delays the decodes
running with it):

  * prefill busy fraction rho = rate * p, with p the profile's TTFT of one prompt of the
    `isl - cached` tokens a request does not find in the prefix cache (a cached prefix costs no
    prefill; its tokens still count as decode context);
  * TTFT = p + the mean wait of an M/D/1 queue, rho * p / (2 * (1 - rho));
  * ITL = d / (1 - rho): the decode step d (the profile's decode grid at the context
    isl + osl / 2 and the concurrency Little's law gives, rate * (TTFT + osl * ITL)) stretched
    by the prefill work interleaved with it.

Prefill worker: the same TTFT. Decode worker: ITL = d (no prefill interleaved; the few prompts
it prefills itself under conditional disaggregation are what the observed/expected correction
absorbs). Every function is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.planner.profile import DecodeGrid, PrefillCurve

__all__ = ["Latency", "WorkerModel"]


@dataclass(frozen=True, slots=True)
class Latency:
    """Predicted mean latencies (ms); inf when the load cannot be served."""

    ttft_ms: float
    itl_ms: float


_INFEASIBLE = Latency(math.inf, math.inf)


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """One worker of a pool: it prefills (`prefill`), decodes (`decode`), or both."""

    prefill: PrefillCurve | None
    decode: DecodeGrid | None

    def latency(self, rate: float, isl: float, osl: float, cached: float = 0.0) -> Latency:
        """Mean TTFT and ITL at `rate` requests/s per worker, requests of `isl` prompt tokens
        (`cached` of them found in the prefix cache) and `osl` output tokens (see the module
        doc)."""
        rate = max(rate, 0.0)
        ttft_ms = 0.0
        rho = 0.0
        if self.prefill is not None:
            p = self.prefill.ttft_at(max(1.0, isl - max(cached, 0.0))) / 1e3
            rho = rate * p
            if rho >= 1.0:
                return _INFEASIBLE
            ttft_ms = 1e3 * (p + rho * p / (2 * (1 - rho)))
        if self.decode is None:
            return Latency(ttft_ms, 0.0)
        context = isl + osl / 2
        itl_ms = self.decode.itl_at(context, 1.0) / (1 - rho)
        for _ in range(8):  # fixed point: concurrency depends on ITL and ITL on concurrency
            e2e_s = (ttft_ms + max(osl - 1, 0) * itl_ms) / 1e3
            concurrency = max(1.0, rate * e2e_s)
            itl_ms = self.decode.itl_at(context, concurrency) / (1 - rho)
            if not math.isfinite(itl_ms):
                return _INFEASIBLE
        return Latency(ttft_ms, itl_ms)

    def capacity(
        self, isl: float, osl: float, ttft_ms: float, itl_ms: float, cached: float = 0.0
    ) -> float:
        """The highest rate (requests/s per worker) whose predicted TTFT and ITL stay within
        `ttft_ms` and `itl_ms` (0: not even one request at a time does)."""

        def ok(rate: float) -> bool:
            lat = self.latency(rate, isl, osl, cached)
            return (self.prefill is None or lat.ttft_ms <= ttft_ms) and (
                self.decode is None or lat.itl_ms <= itl_ms
            )

        if not ok(1e-9):
            return 0.0
        hi = 1.0
        while ok(hi):
            hi *= 2
            if hi > 1e7:
                return hi
        lo = hi / 2 if hi > 1.0 else 0.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo
