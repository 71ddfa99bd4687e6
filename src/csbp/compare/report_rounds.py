"""What ``csbp compare --repeats R`` (R > 1) prints and writes: the spread over rounds and the
paired differences between layouts.

:func:`summarize_rounds` gives, per layout and time point, the metric's mean and min-max over the
rounds, and per layout against the first one (``--layouts`` order) the per-round differences at
every point, of the metric at the budget (each round's last point) and of the steps reached there,
each with its mean, 95% t-interval and verdict (:mod:`csbp.compare.stats`: ``lower``/``higher``,
``more``/``fewer`` steps, only when every round agrees in sign and the interval excludes 0, else
``within noise``). :func:`format_rounds_table` prints it, :func:`plot_rounds` draws the mean with
the min-max band over rounds and every round's line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from csbp.compare.report import LAYOUT_LABELS, _topology_text
from csbp.compare.rounds import round_order
from csbp.compare.stats import chance_of_agreement, metric_tolerance, paired_difference, spread
from csbp.figures import save_figure


def group_rounds(results: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The flat results of :func:`csbp.compare.runner.run_compare` grouped by round, in order."""
    rounds: dict[int, list[dict[str, Any]]] = {}
    for result in results:
        rounds.setdefault(int(result.get("round", 1)), []).append(result)
    return [rounds[index] for index in sorted(rounds)]


def _at(result: dict[str, Any], index: int) -> dict[str, Any] | None:
    points = result["points"]
    return points[index] if index < len(points) else None


def _step_median(result: dict[str, Any]) -> float | None:
    summary = result.get("step_s")
    return None if not summary else float(summary["median"])


def summarize_rounds(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The per-layout spread and the paired differences (module docstring), as ``compare.json``'s
    ``summary``. Every round holds the same layouts in the same order."""
    names = [result["layout"] for result in rounds[0]]
    count = max(len(result["points"]) for runs in rounds for result in runs)
    layouts = []
    for column, name in enumerate(names):
        runs = [r[column] for r in rounds]
        points = []
        for index in range(count):
            present = [point for point in (_at(result, index) for result in runs) if point is not None]
            if present:
                points.append(
                    {
                        "index": index,
                        "target_s": present[0]["target_s"],
                        "clock_s": spread([p["clock_s"] for p in present])["mean"],
                        "metric": spread([p["metric"] for p in present]),
                        "step": spread([p["step"] for p in present]),
                    }
                )
        medians = [m for m in (_step_median(result) for result in runs) if m is not None]
        layouts.append(
            {
                "layout": name,
                "topology": runs[0]["topology"],
                "points": points,
                "steps": spread([result["steps"] for result in runs]),
                "clock_s": spread([result["clock_s"] for result in runs]),
                "step_median_s": spread(medians) if medians else None,
            }
        )
    differences = []
    for column, name in enumerate(names[1:], start=1):
        pairs = [(r[0], r[column]) for r in rounds]
        points = []
        for index in range(count):
            both = [(a, b) for a, b in ((_at(a, index), _at(b, index)) for a, b in pairs) if a and b]
            if both:
                diffs = [b["metric"] - a["metric"] for a, b in both]
                tolerance = metric_tolerance([p["metric"] for pair in both for p in pair])
                difference = paired_difference(diffs, tolerance).as_dict("higher", "lower")
                points.append({"index": index, "target_s": both[0][0]["target_s"], **difference})
        last = [(a["points"][-1]["metric"], b["points"][-1]["metric"]) for a, b in pairs]
        at_budget = paired_difference([b - a for a, b in last], metric_tolerance([v for pair in last for v in pair]))
        differences.append(
            {
                "layout": name,
                "base": names[0],
                "points": points,
                "at_budget": at_budget.as_dict("higher", "lower"),
                "steps": paired_difference([float(b["steps"] - a["steps"]) for a, b in pairs]).as_dict("more", "fewer"),
                "steps_ratio": sum(b["steps"] for _, b in pairs) / max(sum(a["steps"] for a, _ in pairs), 1),
            }
        )
    return {
        "rounds": len(rounds),
        "seeds": [r[0].get("seed") for r in rounds],
        "interval": "95% Student-t interval of the mean paired difference over rounds",
        "verdict": "given only when every round's difference has the same sign and the interval excludes 0",
        "layouts": layouts,
        "differences": differences,
    }


def _range(stat: dict[str, Any], digits: int, range_digits: int | None = None) -> str:
    """``mean [min..max]``; the range with ``range_digits`` (default ``digits``) decimals."""
    ends = digits if range_digits is None else range_digits
    return f"{stat['mean']:.{digits}f} [{stat['min']:.{ends}f}..{stat['max']:.{ends}f}]"


def _interval(diff: dict[str, Any], digits: int) -> str:
    if diff["low"] is None:
        return f"{diff['mean']:+.{digits}f}"
    return f"{diff['mean']:+.{digits}f} [{diff['low']:+.{digits}f}, {diff['high']:+.{digits}f}]"


def _per_round(diff: dict[str, Any], digits: int) -> str:
    return " ".join(f"{value:+.{digits}f}" for value in diff["per_round"])


def format_rounds_table(
    rounds: list[list[dict[str, Any]]], summary: dict[str, Any], *, metric: str, higher_is_better: bool
) -> str:
    """The table of a comparison with several rounds (module docstring)."""
    names = [layout["layout"] for layout in summary["layouts"]]
    width = 30
    lines = [
        f"metric: {metric} ({'higher' if higher_is_better else 'lower'} is better); {summary['rounds']} rounds, "
        "mean [min..max] over rounds",
    ]
    header = f"{'point':>5} {'t (s)':>8}" + "".join(
        f"  {layout['layout'] + ' ' + _topology_text(layout['topology']):>{width}}" for layout in summary["layouts"]
    )
    lines += [header, "-" * len(header)]
    count = max(len(layout["points"]) for layout in summary["layouts"])
    for index in range(count):
        cells, target = [], None
        for layout in summary["layouts"]:
            point = next((p for p in layout["points"] if p["index"] == index), None)
            cells.append("-" if point is None else _range(point["metric"], 4))
            target = target if point is None or target is not None else point["target_s"]
        lines.append(f"{index:>5} {target:>8.1f}" + "".join(f"  {cell:>{width}}" for cell in cells))
    trained = []
    for layout in summary["layouts"]:
        text = f"{layout['layout']} {_range(layout['steps'], 1, 0)} steps in {_range(layout['clock_s'], 1)} s"
        if layout["step_median_s"]:
            text += f" (step median {_range(layout['step_median_s'], 3)} s)"
        trained.append(text)
    lines.append("trained: " + "; ".join(trained))
    for index, runs in enumerate(rounds):
        order = round_order(tuple(names), index)
        by_name = {result["layout"]: result for result in runs}
        cells = ", ".join(
            f"{name} {by_name[name]['steps']} steps {by_name[name]['points'][-1]['metric']:.4f}" for name in order
        )
        lines.append(f"round {index + 1} (seed {runs[0].get('seed')}, order {','.join(order)}): {cells}")
    for diff in summary["differences"]:
        pair = f"{diff['layout']} - {diff['base']}"
        lines.append(f"{pair}, paired by round: mean [95% interval], verdict, per round")
        for point in diff["points"]:
            lines.append(
                f"{point['index']:>5} {point['target_s']:>8.1f}  {_interval(point, 4):<34} {point['verdict']:<14}"
                f"{_per_round(point, 4)}"
            )
        budget, steps = diff["at_budget"], diff["steps"]
        lines.append(
            f"at the budget: {pair} {metric} {_interval(budget, 4)}: {budget['verdict']} (per round "
            f"{_per_round(budget, 4)})"
        )
        lines.append(
            f"steps at the budget: {pair} {_interval(steps, 1)}: {steps['verdict']} ({diff['steps_ratio']:.2f}x the "
            f"steps; per round {_per_round(steps, 0)})"
        )
    return "\n".join(lines + rounds_noise_lines(summary["rounds"]))


def rounds_noise_lines(rounds: int) -> list[str]:
    """What the rounds control and what a verdict means."""
    return [
        f"noise: {rounds} rounds; within a round every layout has the same seed (paired), the seed changes per round "
        "(run.seed + round - 1: initialisation, data order, corruption and validation draws) and the layout order "
        "rotates per round, so the spread holds training and timing noise",
        "noise: a verdict (lower/higher, more/fewer) needs every round's difference to have the same sign and the "
        f"95% interval to exclude 0, else 'within noise' (all {rounds} rounds agree in sign by chance alone with "
        f"probability {100 * chance_of_agreement(rounds):g}%)",
    ]


def plot_rounds(rounds: list[list[dict[str, Any]]], summary: dict[str, Any], path: Path, *, metric: str, title: str) -> Path:
    """The metric against the training clock per layout: the mean over rounds (at the mean clock of
    each point), its min-max band and every round's line (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    for column, layout in enumerate(summary["layouts"]):
        color = f"C{column}"
        for runs in rounds:
            points = runs[column]["points"]
            axis.plot([p["clock_s"] for p in points], [p["metric"] for p in points], "-", color=color, alpha=0.3, lw=1)
        clocks = [p["clock_s"] for p in layout["points"]]
        label = f"{LAYOUT_LABELS.get(layout['layout'], layout['layout'])} ({_topology_text(layout['topology'])})"
        axis.plot(clocks, [p["metric"]["mean"] for p in layout["points"]], "o-", color=color, markersize=4,
                  label=f"{label}, mean of {summary['rounds']} rounds")
        axis.fill_between(clocks, [p["metric"]["min"] for p in layout["points"]],
                          [p["metric"]["max"] for p in layout["points"]], color=color, alpha=0.15)
    axis.set_xlabel("training wall-clock (s)")
    axis.set_ylabel(f"{metric} (band: min-max over rounds)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return save_figure(figure, path)
