"""Performance profiles: what one worker of an engine does at a given load, measured by
`kvmesh profile` and read by the SLA planner (and by any routing policy that predicts latency).

File format (JSON, `"format": "kvmesh-perf-profile"`, `"version": 1`):

    {
      "format": "kvmesh-perf-profile",
      "version": 1,
      "engine": "mocker",                 # the engine measured (model card's engine name)
      "model": "tiny-llama",              # served model name
      "source": "virtual-time mocker",    # how it was measured (or "grpc 10.0.0.2:7000")
      "created": "2026-11-24T22:00:00Z",
      "kv_capacity_tokens": 1048576,      # KV cache of one worker, in tokens (0: unknown)
      "roles": {
        "aggregated": {                   # and/or "prefill", "decode": one entry per role
          "prefill": {
            "isl":         [128, 1024, 8192],        # prompt tokens, increasing
            "ttft_ms":     [18.0, 34.0, 170.0],      # TTFT of one request alone on the worker
            "throughput_tokens_per_s": [7e3, 3e4, 4.8e4]  # prompt tokens/s, many prompts at once
          },
          "decode": {
            "context":     [512, 4096],              # tokens per sequence, increasing
            "concurrency": [1, 8, 64],               # sequences decoding at once, increasing
            "itl_ms":      [[6.0, 6.1, 7.0], [6.0, 7.5, null]],   # [context][concurrency]
            "throughput_tokens_per_s": [[166, 1311, 9142],
                                        [166, 1066, null]]
          }
        }
      }
    }

A role holds `prefill`, `decode` or both (an aggregated worker does both; a prefill worker's
profile has only `prefill`, a decode worker's only `decode`). A `null` decode cell was not
measurable: that many sequences of that length do not fit the KV cache. Readers interpolate
linearly between points (and bilinearly on the decode grid); prefill curves extrapolate
linearly past their last point, decode grids do not (a load past the grid is infeasible).
Version 1 readers refuse other versions; unknown keys are ignored (newer minor additions).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.plotting import pyplot
from kvmesh.runtime.types import Role

__all__ = [
    "FORMAT",
    "VERSION",
    "DecodeGrid",
    "PerfProfile",
    "PrefillCurve",
    "ProfileError",
    "RoleProfile",
    "interpolate",
    "plot_profile",
]

FORMAT = "kvmesh-perf-profile"
VERSION = 1


class ProfileError(InvalidRequest):
    """A profile file that cannot be read or does not follow the format."""


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float, *, extrapolate: bool) -> float:
    """Piecewise-linear value at `x` of the points (xs increasing); past the ends: the linear
    continuation of the nearest segment (`extrapolate`) or the end value."""
    if len(xs) == 1:
        return ys[0]
    if not extrapolate:
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _floats(data: Any, name: str) -> list[float]:
    if not isinstance(data, list) or not data:
        raise ProfileError(f"profile: {name} must be a non-empty list of numbers")
    try:
        out = [float(v) for v in data]
    except (TypeError, ValueError):
        raise ProfileError(f"profile: {name} must hold numbers") from None
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ProfileError(f"profile: {name} values must be finite and >= 0")
    return out


def _increasing(xs: list[float], name: str) -> None:
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ProfileError(f"profile: {name} must be strictly increasing")


@dataclass(frozen=True)
class PrefillCurve:
    """Prefill vs prompt length: TTFT of a prompt alone, and prompt tokens/s when saturated."""

    isl: list[float]
    ttft_ms: list[float]
    throughput_tokens_per_s: list[float]

    def __post_init__(self) -> None:
        _increasing(self.isl, "prefill.isl")
        if not len(self.isl) == len(self.ttft_ms) == len(self.throughput_tokens_per_s):
            raise ProfileError("profile: prefill lists must have the same length")

    def ttft_at(self, isl: float) -> float:
        """TTFT (ms) of an `isl`-token prompt on an idle worker."""
        return max(0.0, interpolate(self.isl, self.ttft_ms, isl, extrapolate=True))

    def throughput_at(self, isl: float) -> float:
        """Saturated prefill throughput (prompt tokens/s) with prompts of `isl` tokens."""
        return max(0.0, interpolate(self.isl, self.throughput_tokens_per_s, isl, extrapolate=False))

    def to_json(self) -> dict[str, Any]:
        return {
            "isl": self.isl,
            "ttft_ms": self.ttft_ms,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
        }

    @classmethod
    def from_json(cls, data: Any) -> PrefillCurve:
        if not isinstance(data, dict):
            raise ProfileError("profile: prefill must be an object")
        return cls(
            _floats(data.get("isl"), "prefill.isl"),
            _floats(data.get("ttft_ms"), "prefill.ttft_ms"),
            _floats(data.get("throughput_tokens_per_s"), "prefill.throughput_tokens_per_s"),
        )


def _grid(data: Any, rows: int, cols: int, name: str) -> list[list[float | None]]:
    if not isinstance(data, list) or len(data) != rows:
        raise ProfileError(f"profile: {name} must have one row per context length")
    out: list[list[float | None]] = []
    for row in data:
        if not isinstance(row, list) or len(row) != cols:
            raise ProfileError(f"profile: each {name} row must have one cell per concurrency")
        cells: list[float | None] = []
        for v in row:
            if v is None:
                cells.append(None)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ProfileError(f"profile: {name} cells must be numbers >= 0 or null")
            cells.append(float(v))
        out.append(cells)
    return out


@dataclass(frozen=True)
class DecodeGrid:
    """Decode vs context length and concurrency: inter-token latency and output tokens/s."""

    context: list[float]
    concurrency: list[float]
    itl_ms: list[list[float | None]]
    """[context][concurrency]; None: not measurable (does not fit the KV cache)."""
    throughput_tokens_per_s: list[list[float | None]]

    def __post_init__(self) -> None:
        _increasing(self.context, "decode.context")
        _increasing(self.concurrency, "decode.concurrency")
        if self.itl_ms[0][0] is None:
            raise ProfileError("profile: decode.itl_ms needs a value at its first point")

    def itl_at(self, context: float, concurrency: float) -> float:
        """ITL (ms) with `concurrency` sequences of `context` tokens decoding; inf when that
        load lies past what was measurable (more sequences than the KV cache holds)."""
        ctx = self.context
        conc = self.concurrency
        concurrency = max(concurrency, conc[0])
        if concurrency > conc[-1]:
            return math.inf
        context = min(max(context, ctx[0]), ctx[-1])
        if len(ctx) == 1:
            return self._along_concurrency(0, concurrency)
        i = min(max(bisect.bisect_right(ctx, context), 1), len(ctx) - 1)
        w = (context - ctx[i - 1]) / (ctx[i] - ctx[i - 1])
        lo = self._along_concurrency(i - 1, concurrency)
        if w <= 0:
            return lo
        hi = self._along_concurrency(i, concurrency)
        if w >= 1:
            return hi
        return lo + (hi - lo) * w if math.isfinite(hi) and math.isfinite(lo) else math.inf

    def _along_concurrency(self, row: int, concurrency: float) -> float:
        xs: list[float] = []
        ys: list[float] = []
        for x, y in zip(self.concurrency, self.itl_ms[row], strict=True):
            if y is None:
                break
            xs.append(x)
            ys.append(y)
        if not xs:
            return math.inf
        if concurrency > xs[-1]:
            return math.inf
        return interpolate(xs, ys, concurrency, extrapolate=False)

    def max_concurrency(self, context: float, itl_ms: float) -> float:
        """The most sequences of `context` tokens that decode with ITL <= `itl_ms` (0: none)."""
        lo, hi = 0.0, self.concurrency[-1]
        if self.itl_at(context, 1.0) > itl_ms:
            return 0.0
        for _ in range(40):
            mid = (lo + hi) / 2
            if self.itl_at(context, mid) <= itl_ms:
                lo = mid
            else:
                hi = mid
        return lo

    def to_json(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "concurrency": self.concurrency,
            "itl_ms": self.itl_ms,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
        }

    @classmethod
    def from_json(cls, data: Any) -> DecodeGrid:
        if not isinstance(data, dict):
            raise ProfileError("profile: decode must be an object")
        context = _floats(data.get("context"), "decode.context")
        concurrency = _floats(data.get("concurrency"), "decode.concurrency")
        rows, cols = len(context), len(concurrency)
        return cls(
            context,
            concurrency,
            _grid(data.get("itl_ms"), rows, cols, "decode.itl_ms"),
            _grid(
                data.get("throughput_tokens_per_s"), rows, cols, "decode.throughput_tokens_per_s"
            ),
        )


@dataclass(frozen=True)
class RoleProfile:
    """What workers of one role measured: prefill, decode, or both."""

    prefill: PrefillCurve | None = None
    decode: DecodeGrid | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.prefill is not None:
            out["prefill"] = self.prefill.to_json()
        if self.decode is not None:
            out["decode"] = self.decode.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, role: str) -> RoleProfile:
        if not isinstance(data, dict) or not ({"prefill", "decode"} & data.keys()):
            raise ProfileError(f"profile: role {role!r} needs prefill and/or decode")
        prefill = data.get("prefill")
        decode = data.get("decode")
        return cls(
            PrefillCurve.from_json(prefill) if prefill is not None else None,
            DecodeGrid.from_json(decode) if decode is not None else None,
        )


@dataclass(frozen=True)
class PerfProfile:
    """A performance profile (the file format is in the module doc)."""

    engine: str
    model: str
    source: str
    roles: dict[Role, RoleProfile]
    kv_capacity_tokens: int = 0
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings the measurement used (block size, chunk budget, ...), kept for the record."""

    def prefill_curve(self, role: Role) -> PrefillCurve:
        """The prefill curve for a pool of `role`: its own, else the aggregated workers'."""
        for r in (role, Role.AGGREGATED, Role.PREFILL):
            found = self.roles.get(r)
            if found is not None and found.prefill is not None:
                return found.prefill
        raise ProfileError(f"profile has no prefill measurements for the {role.value} pool")

    def decode_grid(self, role: Role) -> DecodeGrid:
        """The decode grid for a pool of `role`: its own, else the aggregated workers'."""
        for r in (role, Role.AGGREGATED, Role.DECODE):
            found = self.roles.get(r)
            if found is not None and found.decode is not None:
                return found.decode
        raise ProfileError(f"profile has no decode measurements for the {role.value} pool")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "engine": self.engine,
            "model": self.model,
            "source": self.source,
            "created": self.created,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "settings": self.extra,
            "roles": {r.value: p.to_json() for r, p in self.roles.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> PerfProfile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"not a kvmesh performance profile (format must be {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ProfileError(
                f"profile version {data.get('version')!r} is not supported (this kvmesh reads "
                f"version {VERSION})"
            )
        raw_roles = data.get("roles")
        if not isinstance(raw_roles, dict) or not raw_roles:
            raise ProfileError("profile: roles must be a non-empty object")
        roles: dict[Role, RoleProfile] = {}
        for name, body in raw_roles.items():
            try:
                role = Role(name)
            except ValueError:
                raise ProfileError(
                    f"profile: unknown role {name!r} (aggregated, prefill, decode)"
                ) from None
            roles[role] = RoleProfile.from_json(body, name)
        capacity = data.get("kv_capacity_tokens", 0)
        if not isinstance(capacity, int) or capacity < 0:
            raise ProfileError("profile: kv_capacity_tokens must be an integer >= 0")
        settings = data.get("settings", {})
        return cls(
            engine=str(data.get("engine", "")),
            model=str(data.get("model", "")),
            source=str(data.get("source", "")),
            roles=roles,
            kv_capacity_tokens=capacity,
            created=str(data.get("created", "")),
            extra=settings if isinstance(settings, dict) else {},
        )

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfProfile:
        """Read a profile file; ProfileError if it cannot be read or is malformed."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(
                f"cannot read profile {str(path)!r}: {exc.strerror or exc}"
            ) from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {str(path)!r} is not JSON ({exc.msg})") from None
        return cls.from_json(data)


def plot_profile(profile: PerfProfile, prefix: str) -> list[str]:
    """PNG plots of every curve of `profile` (matplotlib, kvmesh[plot]): `PREFIX-ROLE-prefill.png`
    (TTFT alone and saturated throughput vs prompt length) and `PREFIX-ROLE-decode.png` (ITL and
    output throughput vs concurrency, one line per context length). Returns the paths."""
    plt = pyplot()
    written: list[str] = []
    title = f"{profile.engine} {profile.model} ({profile.source})".strip()
    for role, rp in profile.roles.items():
        if rp.prefill is not None:
            c = rp.prefill
            fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
            a.plot(c.isl, c.ttft_ms, marker="o")
            a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT alone (ms)")
            b.plot(c.isl, c.throughput_tokens_per_s, marker="o")
            b.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s (saturated)")
            written.append(_save(plt, fig, f"{prefix}-{role.value}-prefill.png", title))
        if rp.decode is not None:
            g = rp.decode
            fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
            for ctx, itl, thpt in zip(g.context, g.itl_ms, g.throughput_tokens_per_s, strict=True):
                xs = [x for x, y in zip(g.concurrency, itl, strict=True) if y is not None]
                a.plot(xs, [y for y in itl if y is not None], marker="o", label=f"{ctx:.0f} tok")
                ts = [y for y in thpt if y is not None]
                b.plot(xs[: len(ts)], ts, marker="o", label=f"{ctx:.0f} tok")
            a.set(xscale="log", xlabel="sequences decoding", ylabel="ITL (ms)")
            b.set(xscale="log", yscale="log", xlabel="sequences decoding", ylabel="output tokens/s")
            a.legend(title="context", fontsize=8)
            written.append(_save(plt, fig, f"{prefix}-{role.value}-decode.png", title))
    return written


def _save(plt: Any, fig: Any, path: str, title: str) -> str:
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
