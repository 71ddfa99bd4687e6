"""The spread of a benchmark's timed repeats, and when a ratio of two timings is noise.

Every ``csbp bench`` reports the median of ``--repeats`` timed steps; the records also keep every
repeat (``step_times_s``, ``times_s``), so a reader can tell a 1.05x ratio from the machine's noise:

* ``spread_percent``: half the min-max range of the repeats, as a percentage of their median (the
  ``±%`` column of the tables);
* ``within_noise``: whether two timings' min-max ranges overlap, i.e. whether the ratio of their
  medians could be 1 on some pair of repeats. The tables mark such a ratio with ``~``
  (``NOISE_MARK``) and print ``NOISE_NOTE`` under the table: it is not a speedup or a slowdown;
* ``rates_within_noise``: the same for a ratio of two *rates* over different amounts of work (``bench
  kernels``' ``x dense``: TFLOP/s on a mask's allowed pairs against dense attention's on all pairs):
  whether the two timings' ranges of seconds per unit of work overlap.

With one repeat there is no spread: nothing is marked and the ``±%`` column shows ``-``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

NOISE_MARK = "~"
NOISE_NOTE = (
    "~: the two timings' min-max ranges over the repeats overlap: the ratio is within the noise, "
    "not a speedup (±: half the min-max range, % of the median)"
)


def spread_percent(times: Sequence[float]) -> float:
    """Half the min-max range of ``times`` in percent of their median (nan with fewer than 2 finite repeats)."""
    finite = [t for t in times if math.isfinite(t)]
    if len(finite) < 2:
        return math.nan
    median = statistics.median(finite)
    return 50.0 * (max(finite) - min(finite)) / median if median > 0 else math.nan


def format_spread(times: Sequence[float], width: int = 4) -> str:
    """``±4%`` (``-`` without a spread), right-aligned in ``width`` characters."""
    value = spread_percent(times)
    text = "-" if math.isnan(value) else f"±{value:.0f}%"
    return f"{text:>{width}}"


def within_noise(times: Sequence[float], other: Sequence[float]) -> bool:
    """Whether the min-max ranges of two timings overlap (False when either has fewer than 2 repeats)."""
    a = [t for t in times if math.isfinite(t)]
    b = [t for t in other if math.isfinite(t)]
    if len(a) < 2 or len(b) < 2:
        return False
    return min(a) <= max(b) and min(b) <= max(a)


def ratio_range(times: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """``(low, high)`` of ``t / t_reference`` over every pair of repeats (nan, nan without repeats)."""
    a = [t for t in times if math.isfinite(t)]
    b = [t for t in reference if math.isfinite(t) and t > 0]
    if not a or not b:
        return math.nan, math.nan
    return min(a) / max(b), max(a) / min(b)


def rates_within_noise(times: Sequence[float], work: float, other: Sequence[float], other_work: float) -> bool:
    """Whether the rates ``work / t`` and ``other_work / t_other`` could be equal on some pair of repeats:
    ``within_noise`` of the seconds per unit of work (False when a work count is not positive)."""
    if not (work > 0 and other_work > 0):
        return False
    return within_noise([t / work for t in times], [t / other_work for t in other])
