"""The statistics of ``csbp compare --repeats``: spread over rounds, paired differences, verdicts.

A paired difference is one number per round (layout minus the first layout, both trained in that
round with the same seed). Its interval is the 95% Student-t interval of the mean,
``mean +- t(0.975, n - 1) sd / sqrt(n)``. A verdict (``higher``/``lower``, ``more``/``fewer``) is
given only when the interval excludes 0 *and* every round's difference has the same sign and is
larger than the comparison's tolerance; otherwise the difference is ``within noise``. With one round
there is no interval and no verdict. The tolerance of a metric is :data:`METRIC_RTOL` of its size:
two layouts evaluate the same weights alike only up to floating-point rounding (the untrained point
0 of a round: measured 2.4e-7 apart on a validation loss of 8.42 between CP-only and CSBP), which is
no difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""The 0.975 quantile of Student's t with 1..30 degrees of freedom, to 3 decimals. Above 30 the value
for 30 is used: larger than the exact one (which falls from 2.042 towards 1.960), so the interval
errs on the wide side."""

METRIC_RTOL = 1e-5
"""Differences of a metric up to this fraction of its magnitude are float rounding, not a sign."""

WITHIN_NOISE = "within noise"
NO_INTERVAL = "one round, no interval"


def t_975(degrees_of_freedom: int) -> float:
    """The 0.975 quantile of Student's t (``degrees_of_freedom >= 1``; conservative above 30)."""
    if degrees_of_freedom < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {degrees_of_freedom}")
    return T_975[min(degrees_of_freedom, len(T_975)) - 1]


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """``{"mean", "min", "max", "rounds"}`` of ``values`` (one per round; at least one)."""
    if not values:
        raise ValueError("spread of no values")
    return {"mean": math.fsum(values) / len(values), "min": min(values), "max": max(values), "rounds": len(values)}


@dataclass(frozen=True)
class PairedDifference:
    """Per-round differences, their mean and 95% t-interval (None with one round) and its sign;
    differences up to ``tolerance`` have no sign."""

    per_round: tuple[float, ...]
    mean: float
    low: float | None
    high: float | None
    tolerance: float = 0.0

    @property
    def sign(self) -> int:
        """+1 or -1 when the interval excludes 0 and every round's difference is beyond the tolerance
        with that sign, else 0."""
        if self.low is None or self.high is None:
            return 0
        if self.low > 0 and all(value > self.tolerance for value in self.per_round):
            return 1
        if self.high < 0 and all(value < -self.tolerance for value in self.per_round):
            return -1
        return 0

    def verdict(self, up: str, down: str) -> str:
        """``up``/``down`` for a clear sign, else ``within noise`` (``one round, no interval`` with one)."""
        if self.low is None:
            return NO_INTERVAL
        return {1: up, -1: down}.get(self.sign, WITHIN_NOISE)

    def as_dict(self, up: str, down: str) -> dict[str, object]:
        return {
            "per_round": list(self.per_round),
            "mean": self.mean,
            "low": self.low,
            "high": self.high,
            "tolerance": self.tolerance,
            "verdict": self.verdict(up, down),
        }


def paired_difference(values: Sequence[float], tolerance: float = 0.0) -> PairedDifference:
    """The mean of ``values`` (one difference per round) and its 95% t-interval; ``tolerance``: the
    size up to which a difference has no sign."""
    if not values:
        raise ValueError("paired difference of no rounds")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return PairedDifference(tuple(values), mean, None, None, tolerance)
    sd = math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (n - 1))
    half = t_975(n - 1) * sd / math.sqrt(n)
    return PairedDifference(tuple(values), mean, mean - half, mean + half, tolerance)


def metric_tolerance(values: Sequence[float]) -> float:
    """The tolerance of differences between ``values`` of a metric: :data:`METRIC_RTOL` of the largest."""
    return METRIC_RTOL * max((abs(value) for value in values), default=0.0)


def chance_of_agreement(rounds: int) -> float:
    """The probability that ``rounds`` differences of a symmetric noise all share a sign: ``2 / 2^rounds``."""
    return min(1.0, 2.0 * 0.5**rounds)
