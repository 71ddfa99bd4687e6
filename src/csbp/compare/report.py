"""What ``csbp compare`` prints and writes: a table of the metric at each time point per layout,
``compare.json`` (every point of every layout, with steps, exact clock and all validation
metrics) and a plot of the metric against the training clock, one line per layout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from csbp.atomic import write_json_atomic
from csbp.compare.stats import metric_tolerance
from csbp.figures import save_figure

LAYOUT_LABELS = {"data": "data parallel", "cp": "CP-only", "bp": "BP-only", "csbp": "CSBP"}


def _topology_text(topology: dict[str, Any]) -> str:
    return f"dp{topology['dp']}xcp{topology['cp']}xbp{topology['bp']}"


def format_table(results: list[dict[str, Any]], *, metric: str, higher_is_better: bool) -> str:
    """One row per time point: target time, then ``metric (step)`` of each layout; then the steps,
    clock and step-time spread of each layout, every layout against the first at the last point
    (the difference, not a verdict) and :func:`noise_lines`."""
    header = f"{'point':>5} {'t (s)':>8}" + "".join(
        f"  {r['layout'] + ' ' + _topology_text(r['topology']):>26}" for r in results
    )
    lines = [f"metric: {metric} ({'higher' if higher_is_better else 'lower'} is better)", header, "-" * len(header)]
    count = max(len(r["points"]) for r in results)
    for index in range(count):
        target = next(r["points"][index]["target_s"] for r in results if index < len(r["points"]))
        cells = []
        for r in results:
            if index < len(r["points"]):
                point = r["points"][index]
                cells.append(f"{point['metric']:.4f} (step {point['step']})")
            else:
                cells.append("-")
        lines.append(f"{index:>5} {target:>8.1f}" + "".join(f"  {cell:>26}" for cell in cells))
    steps = "  ".join(f"{r['layout']} {r['steps']} steps in {r['clock_s']:.1f} s{_step_text(r)}" for r in results)
    lines.append(f"trained: {steps}")
    base = results[0]
    for other in results[1:]:
        a, b = base["points"][-1]["metric"], other["points"][-1]["metric"]
        lines.append(
            f"at the budget: {other['layout']} {b:.4f} vs {base['layout']} {a:.4f} ({_difference_text(other, a, b)}; "
            f"{other['steps'] / max(base['steps'], 1):.2f}x the steps)" + _nelbo_text(base, other)
        )
    return "\n".join(lines + noise_lines(results))


def _difference_text(other: dict[str, Any], a: float, b: float) -> str:
    """``csbp higher by 0.1228``: the sign only, no verdict (one run per layout has no error bar);
    ``equal`` within float rounding (:data:`csbp.compare.stats.METRIC_RTOL`)."""
    if abs(b - a) <= metric_tolerance([a, b]):
        return "equal"
    return f"{other['layout']} {'higher' if b > a else 'lower'} by {abs(b - a):.4f}"


def _step_text(result: dict[str, Any]) -> str:
    summary = result.get("step_s")
    if not summary:
        return ""
    return f" (step {summary['median']:.3f} s median, {summary['p10']:.3f}-{summary['p90']:.3f} s p10-p90)"


def noise_lines(results: list[dict[str, Any]]) -> list[str]:
    """What the comparison can say about noise: one run per layout gives the metric no error bar;
    the step times' spread (p10-p90) is the timing noise each layout ran under, and where two
    layouts' ranges overlap their step-rate difference is within it."""
    if len(results) < 2:  # one layout: no difference to put an error bar on
        return []
    lines = [
        "noise: one run per layout, so the differences above have no error bar (for one: --repeats 2 or more, "
        "rounds with other seeds and the layout order rotated)"
    ]
    base = results[0]
    for other in results[1:]:
        first, second = base.get("step_s"), other.get("step_s")
        if not (first and second):
            continue
        ranges = (
            f"{base['layout']} {first['p10']:.3f}-{first['p90']:.3f} s, {other['layout']} "
            f"{second['p10']:.3f}-{second['p90']:.3f} s"
        )
        if first["p10"] <= second["p90"] and second["p10"] <= first["p90"]:
            lines.append(
                f"noise: the step-time p10-p90 ranges overlap ({ranges}): the step-rate difference of "
                f"{other['layout']} and {base['layout']} is within the timing noise of this comparison"
            )
        else:
            lines.append(
                f"noise: the step-time p10-p90 ranges do not overlap ({ranges}), but the layouts ran one after the "
                "other, so a change in the machine's load between them would look the same (check: rerun with "
                "--layouts in the other order)"
            )
    return lines


def budget_notes(results: list[dict[str, Any]], *, budget_s: float, max_steps: int) -> list[str]:
    """One line per layout that stopped at ``train.max_steps`` before its training-clock budget (its
    last point is then not at the budget, and layouts that both stop there compare equal steps, not
    equal time), and one per layout whose steps outlasted the interval between points (several
    points then share one step's evaluation)."""
    notes = []
    for result in results:
        if result["steps"] >= max_steps and result["clock_s"] < budget_s:
            enough = math.ceil(1.5 * max_steps * budget_s / max(result["clock_s"], 1e-9))
            notes.append(
                f"note: {result['layout']} reached train.max_steps={max_steps} after {result['clock_s']:.1f} s of its "
                f"{budget_s:g} s budget, so its last point is not at the budget (fix: raise it, e.g. --set "
                f"train.max_steps={enough})"
            )
        points = result["points"]
        repeated = [point["index"] for before, point in zip(points, points[1:]) if point["step"] == before["step"]]
        if repeated:
            notes.append(
                f"note: {result['layout']}: a step outlasted the time between points, so point(s) "
                f"{', '.join(map(str, repeated))} repeat the evaluation of the point before (fix: a larger "
                "--budget-s or fewer --points)"
            )
    return notes


def _nelbo_text(base: dict[str, Any], other: dict[str, Any]) -> str:
    """``; val_nelbo X vs Y`` (validation metric ``nelbo``) at the last point when both runs report it: the unclipped bound is
    comparable across recipes, while ``val_loss`` is the (possibly clipped) training objective."""
    last = [r["points"][-1].get("metrics", {}).get("nelbo") for r in (other, base)]
    if None in last:
        return ""
    return f"; val_nelbo {last[0]:.4f} vs {last[1]:.4f}"


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """``payload`` as JSON through a temporary file and ``os.replace``."""
    write_json_atomic(path, payload)
    return path


def plot_compare(results: list[dict[str, Any]], path: Path, *, metric: str, title: str) -> Path:
    """The metric against the training clock, one line per layout (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    for result in results:
        points = result["points"]
        label = f"{LAYOUT_LABELS.get(result['layout'], result['layout'])} ({_topology_text(result['topology'])})"
        axis.plot([p["clock_s"] for p in points], [p["metric"] for p in points], "o-", label=label, markersize=4)
    axis.set_xlabel("training wall-clock (s)")
    axis.set_ylabel(metric)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return save_figure(figure, path)
