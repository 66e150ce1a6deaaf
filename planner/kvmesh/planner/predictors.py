"""Load predictors: one value per adjustment interval in (request rate, mean prompt length,
mean output length), the value expected `steps` intervals ahead out.

Always available (nothing to install): `constant` (the last value), `moving-average` (mean of
the last `window`), `kalman` (a local linear trend Kalman filter: level and slope, so a ramp is
followed and extrapolated). Optional extras: `arima` (statsmodels' ARIMA, `pip install
'kvmesh[arima]'`) and `prophet` (`pip install 'kvmesh[prophet]'`); both answer with the last
value until they have enough history to fit.

Every predictor is a small state machine fed one observation per interval (`observe`), pure
and clock-free, so the live planner and the simulator drive the same code. Predictions are
never negative.
"""

from __future__ import annotations

import enum
import importlib
import math
from collections import deque
from typing import Any, Protocol

from kvmesh.runtime.errors import Unimplemented

__all__ = [
    "ArimaPredictor",
    "ConstantPredictor",
    "KalmanPredictor",
    "MovingAveragePredictor",
    "Predictor",
    "PredictorKind",
    "ProphetPredictor",
    "RateTrend",
    "make_predictor",
]


class PredictorKind(enum.Enum):
    """Which load predictor the planner uses."""

    CONSTANT = "constant"
    MOVING_AVERAGE = "moving-average"
    KALMAN = "kalman"
    ARIMA = "arima"
    PROPHET = "prophet"


class Predictor(Protocol):
    """Predicts a series observed once per interval."""

    def observe(self, value: float) -> None:
        """The value of the interval that just ended."""
        ...

    def predict(self, steps: float = 1) -> float:
        """The value expected `steps` intervals after the last one observed (0 before any
        observation); a fraction of an interval is allowed (the optional fitted predictors
        round it up)."""
        ...


class ConstantPredictor:
    """The next interval looks like the last one."""

    def __init__(self) -> None:
        self.last = 0.0

    def observe(self, value: float) -> None:
        self.last = value

    def predict(self, steps: float = 1) -> float:
        return max(0.0, self.last)


class MovingAveragePredictor:
    """The mean of the last `window` intervals."""

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError("moving-average window must be >= 1")
        self.values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.values.append(value)

    def predict(self, steps: float = 1) -> float:
        return max(0.0, sum(self.values) / len(self.values)) if self.values else 0.0


class KalmanPredictor:
    """Local linear trend: the series is a level that moves by a slope, both drifting, seen
    through noise. State x = (level, slope), x' = F x with F = [[1, 1], [0, 1]]; observation
    y = level + noise. The filter is scale-free: the measurement noise variance R follows the
    squared innovations (exponentially weighted), and the process noises are multiples of it
    (`level_noise`, `slope_noise`: how fast level and slope may change, relative to the
    noise; their ratio to it, not its size, sets how fast the filter follows: the defaults
    pick up a ramp within two or three intervals and keep Poisson-like noise of a request rate
    counted over the interval mostly out). Prediction `steps` ahead: level + steps * slope.

    Damped near a turn (`damped`, the default): a trend that weakens is not carried on at full
    strength. The filter's slope lags the series' (it follows a change over a few intervals),
    so near a peak a straight extrapolation overshoots by a few intervals' worth of a rise
    that has already slowed. The series shows it first: over the last `DAMP_SPAN` intervals
    it fell short of what the trend predicted one interval ahead (the innovations, on average,
    went against the slope). The trend is then taken to be weakening by that share, phi = 1 -
    shortfall / slope per interval (0 when the shortfall is the whole slope: the rise has
    stopped), and the prediction adds slope * (phi + phi^2 + ...) over `steps` instead of
    slope * steps. A series that keeps up with its trend, or outruns it, is extrapolated
    straight (never amplified).
    """

    DAMP_SPAN = 2
    """Intervals whose innovations are averaged to judge the trend (against their noise)."""

    def __init__(
        self,
        level_noise: float = 2.0,
        slope_noise: float = 0.5,
        noise_memory: float = 0.1,
        *,
        damped: bool = True,
    ) -> None:
        self.q_level = level_noise
        self.q_slope = slope_noise
        self.memory = noise_memory
        self.damped = damped
        self.level = 0.0
        self.slope = 0.0
        self.p = [[1.0, 0.0], [0.0, 1.0]]
        self.r = 0.0
        self.n = 0
        self.innovations: deque[float] = deque(maxlen=self.DAMP_SPAN)
        """The last observations less what the filter predicted for them, one interval ahead."""

    def observe(self, value: float) -> None:
        if self.n == 0:
            self.level, self.n = value, 1
            self.r = (0.1 * value) ** 2 or 1.0
            self.p = [[self.r, 0.0], [0.0, self.r]]
            return
        self.n += 1
        # predict
        level = self.level + self.slope
        slope = self.slope
        (p00, p01), (p10, p11) = self.p
        q0, q1 = self.q_level * self.r, self.q_slope * self.r
        a00 = p00 + p01 + p10 + p11 + q0
        a01 = p01 + p11
        a10 = p10 + p11
        a11 = p11 + q1
        # update
        innovation = value - level
        self.innovations.append(innovation)
        s = a00 + self.r
        k0, k1 = a00 / s, a10 / s
        self.level = level + k0 * innovation
        self.slope = slope + k1 * innovation
        self.p = [
            [(1 - k0) * a00, (1 - k0) * a01],
            [a10 - k1 * a00, a11 - k1 * a01],
        ]
        # the noise follows the innovations (floored so a flat series keeps a tiny noise)
        m = self.memory
        self.r = max((1 - m) * self.r + m * innovation * innovation, 1e-9 * (1 + value * value))

    def damping(self) -> float:
        """phi, in [0, 1]: 1 - the share of the slope the series fell short of over the last
        `DAMP_SPAN` intervals (1: undamped)."""
        if not self.damped or len(self.innovations) < self.DAMP_SPAN or self.slope == 0:
            return 1.0
        shortfall = -sum(self.innovations) / len(self.innovations) / self.slope
        return _clamp01(1 - shortfall)

    def predict(self, steps: float = 1) -> float:
        phi = self.damping()
        # slope * (phi + phi^2 + ... ), `steps` terms (a fraction of an interval allowed)
        ahead = steps if phi >= 1.0 else phi * (1 - phi**steps) / (1 - phi)
        return max(0.0, self.level + ahead * self.slope)


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


class RateTrend:
    """The arrival rate's level and slope over the last `span_s` seconds, from request counts
    over windows of any length (the planner's intervals and the surge checks between them):
    a least-squares line through each window's rate at its midpoint, weighted by the window's
    length (a Poisson count's rate has variance rate / length). `forecast(at)` extrapolates
    the line to the time `at` and gives the standard error of that value (Poisson, at the
    window's mean rate), so a caller can act on what the trend shows past its noise."""

    MIN_WINDOWS = 3

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.windows: deque[tuple[float, float, int]] = deque()
        """(start, end, count), oldest first."""

    def add(self, end: float, duration: float, count: int) -> None:
        """`count` requests arrived over the `duration` seconds up to `end`."""
        if duration <= 0:
            return
        self.windows.append((end - duration, end, max(0, count)))
        while self.windows and self.windows[0][1] <= end - self.span_s:
            self.windows.popleft()

    def _fit(self) -> tuple[float, float, float, float] | None:
        """(length, mean rate, centre, sum of squares about it) of the windows; None with
        fewer than `MIN_WINDOWS` of them."""
        ws = self.windows
        if len(ws) < self.MIN_WINDOWS:
            return None
        length = sum(e - s for s, e, _ in ws)
        mean = sum(c for _, _, c in ws) / length
        centre = sum((s + e) / 2 * (e - s) for s, e, _ in ws) / length
        sxx = sum((e - s) * ((s + e) / 2 - centre) ** 2 for s, e, _ in ws)
        return length, mean, centre, sxx

    def _slope(self, centre: float, sxx: float) -> float:
        return sum(c * ((s + e) / 2 - centre) for s, e, c in self.windows) / sxx

    def forecast(self, at: float) -> tuple[float, float]:
        """(rate at `at`, its standard error); (NaN, inf) with fewer than 3 windows."""
        fit = self._fit()
        if fit is None:
            return math.nan, math.inf
        length, mean, centre, sxx = fit
        if sxx <= 0:
            return mean, math.inf
        lever = at - centre
        variance = max(mean, 1 / length) * (1 / length + lever * lever / sxx)
        return max(0.0, mean + self._slope(centre, sxx) * lever), math.sqrt(variance)

    def falling(self, z: float) -> bool:
        """Whether the rate falls by more than `z` standard errors of its slope (Poisson, at
        the windows' mean rate); False with fewer than 3 windows."""
        fit = self._fit()
        if fit is None or fit[3] <= 0:
            return False
        length, mean, centre, sxx = fit
        return self._slope(centre, sxx) < -z * math.sqrt(max(mean, 1 / length) / sxx)


def _optional(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Unimplemented(
            f"the {extra} predictor needs {module.split('.')[0]}: pip install 'kvmesh[{extra}]'"
        ) from None


class ArimaPredictor:
    """ARIMA(p, d, q) refitted on the last `window` values each interval (statsmodels)."""

    def __init__(self, order: tuple[int, int, int] = (1, 1, 1), window: int = 60) -> None:
        self._arima = _optional("statsmodels.tsa.arima.model", "arima").ARIMA
        self._warnings = importlib.import_module("warnings")
        self.order = order
        self.values: deque[float] = deque(maxlen=window)
        self.min_points = max(8, 2 * sum(order) + 2)
        self._forecast: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)
        self._forecast = []

    def predict(self, steps: float = 1) -> float:
        if len(self.values) < self.min_points or len(set(self.values)) < 2:
            return max(0.0, self.values[-1]) if self.values else 0.0
        steps = max(1, math.ceil(steps))
        if len(self._forecast) < steps:
            with self._warnings.catch_warnings():
                self._warnings.simplefilter("ignore")  # convergence chatter on short series
                try:
                    fit = self._arima(list(self.values), order=self.order).fit()
                    self._forecast = [float(v) for v in fit.forecast(steps=max(steps, 1))]
                except (ValueError, ArithmeticError, IndexError):
                    self._forecast = [self.values[-1]] * steps
        value = self._forecast[steps - 1]
        return max(0.0, value) if math.isfinite(value) else max(0.0, self.values[-1])


class ProphetPredictor:
    """Prophet (trend + seasonality) fitted on the last `window` intervals; interval i is
    dated i * `interval_s` seconds after an arbitrary epoch."""

    def __init__(self, interval_s: float, window: int = 240) -> None:
        self._prophet = _optional("prophet", "prophet").Prophet
        self._pandas = importlib.import_module("pandas")
        self.interval_s = interval_s
        self.values: deque[float] = deque(maxlen=window)
        self.count = 0
        self.min_points = 12

    def observe(self, value: float) -> None:
        self.values.append(value)
        self.count += 1

    def predict(self, steps: float = 1) -> float:
        if len(self.values) < self.min_points:
            return max(0.0, self.values[-1]) if self.values else 0.0
        pd = self._pandas
        first = self.count - len(self.values)
        ds = pd.to_datetime(
            [(first + i) * self.interval_s for i in range(len(self.values))], unit="s"
        )
        model = self._prophet()
        model.fit(pd.DataFrame({"ds": ds, "y": list(self.values)}))
        ahead = self.count - 1 + math.ceil(steps)
        future = pd.DataFrame({"ds": pd.to_datetime([ahead * self.interval_s], unit="s")})
        return max(0.0, float(model.predict(future)["yhat"].iloc[0]))


def make_predictor(kind: PredictorKind, interval_s: float, window: int = 5) -> Predictor:
    """A new predictor of `kind` (Unimplemented when its optional package is missing)."""
    if kind is PredictorKind.CONSTANT:
        return ConstantPredictor()
    if kind is PredictorKind.MOVING_AVERAGE:
        return MovingAveragePredictor(window)
    if kind is PredictorKind.KALMAN:
        return KalmanPredictor()
    if kind is PredictorKind.ARIMA:
        return ArimaPredictor()
    return ProphetPredictor(interval_s)
