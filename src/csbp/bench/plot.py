"""Speedup plots of the layout benchmarks: CSBP and BP-only step time relative to CP-only.

``plot_speedups`` reads benchmark records as dicts (the ``--json`` rows of ``csbp bench train`` or
``csbp bench attention``) with at least ``layout``, ``seq_len`` and ``step_time_s``, and draws one
panel per value of ``group_by`` (e.g. per objective): speedup ``t_cp / t_layout`` against context
length (log2 axis), one line per other layout (CSBP, BP-only and the mask-aware ``cp-aware``), with
the break-even line at 1; where the records hold their repeats (``step_times_s``) each point carries
an error bar from the slowest to the fastest pairing of the two layouts' repeats
(``speedup_range``): a bar that crosses 1 is no measured speedup. Rendering uses the
non-interactive Agg backend, so it works on machines without a display.

Usage::

    from csbp.bench.common import records_as_dicts

    plot_speedups(records_as_dicts(records), Path("train.png"), group_by="objective")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from csbp.figures import save_figure

LAYOUT_LABELS = {"csbp": "CSBP", "bp": "BP-only", "cp-aware": "CP-only, mask-aware"}
"""Layouts drawn against generic CP-only, when the records hold them: the mask-aware CP baseline too,
so a plot never shows CSBP against the weaker CP baseline alone."""
LAYOUT_STYLES = {
    "csbp": {"color": "tab:blue", "marker": "o"},
    "bp": {"color": "tab:orange", "marker": "s"},
    "cp-aware": {"color": "tab:green", "marker": "^"},
}


def speedup_series(
    records: Sequence[Mapping[str, object]], layout: str, group: object, group_by: str | None
) -> tuple[list[int], list[float]]:
    """``(seq_lens, t_cp / t_layout)`` of one layout in one group, sorted by length; lengths without
    a CP-only baseline are skipped."""
    in_group = [r for r in records if group_by is None or r.get(group_by) == group]
    baseline = {int(r["seq_len"]): float(r["step_time_s"]) for r in in_group if r["layout"] == "cp"}  # type: ignore[arg-type]
    points = sorted(
        (int(r["seq_len"]), baseline[int(r["seq_len"])] / float(r["step_time_s"]))  # type: ignore[arg-type]
        for r in in_group
        if r["layout"] == layout and int(r["seq_len"]) in baseline and float(r["step_time_s"]) > 0  # type: ignore[arg-type]
    )
    return [n for n, _ in points], [s for _, s in points]


def _repeats(record: Mapping[str, object]) -> list[float]:
    times = record.get("step_times_s")
    return [float(t) for t in times if isinstance(t, int | float)] if isinstance(times, list | tuple) else []


def speedup_range(
    records: Sequence[Mapping[str, object]], layout: str, group: object, group_by: str | None
) -> tuple[list[int], list[float], list[float]]:
    """``(seq_lens, low, high)`` of ``t_cp / t_layout`` over every pair of the two layouts' repeats, for the
    lengths ``speedup_series`` gives (the median speedup at both ends where a record has no repeats)."""
    in_group = [r for r in records if group_by is None or r.get(group_by) == group]
    baseline = {int(r["seq_len"]): r for r in in_group if r["layout"] == "cp"}  # type: ignore[arg-type]
    seq_lens, speedups = speedup_series(records, layout, group, group_by)
    low, high = list(speedups), list(speedups)
    for r in in_group:
        if r["layout"] != layout or int(r["seq_len"]) not in seq_lens:  # type: ignore[arg-type]
            continue
        index = seq_lens.index(int(r["seq_len"]))  # type: ignore[arg-type]
        mine, cp = _repeats(r), _repeats(baseline[seq_lens[index]])
        if mine and cp and min(mine) > 0:
            low[index], high[index] = min(cp) / max(mine), max(cp) / min(mine)
    return seq_lens, low, high


def plot_speedups(
    records: Sequence[Mapping[str, object]],
    path: Path,
    *,
    group_by: str | None = None,
    title: str = "speedup over CP-only",
) -> Path:
    """Write the speedup figure to ``path`` (format from the suffix, PNG by default); return ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(r["layout"] == "cp" for r in records):
        raise ValueError("speedups are relative to CP-only: the records contain no 'cp' layout")
    groups: list[object] = [None]
    if group_by is not None:
        groups = list(dict.fromkeys(r.get(group_by) for r in records))
    seq_lens_all = sorted({int(r["seq_len"]) for r in records})  # type: ignore[arg-type]
    figure, axes = plt.subplots(1, len(groups), figsize=(5.0 * len(groups), 4.0), squeeze=False)
    for axis, group in zip(axes[0], groups, strict=True):
        for layout, label in LAYOUT_LABELS.items():
            seq_lens, speedups = speedup_series(records, layout, group, group_by)
            if seq_lens:
                _, low, high = speedup_range(records, layout, group, group_by)
                errors = [[max(0.0, s - lo) for s, lo in zip(speedups, low)],
                          [max(0.0, hi - s) for s, hi in zip(speedups, high)]]
                axis.plot(seq_lens, speedups, label=label, **LAYOUT_STYLES[layout])  # type: ignore[arg-type]
                axis.errorbar(seq_lens, speedups, yerr=errors, fmt="none", capsize=3,
                              ecolor=LAYOUT_STYLES[layout]["color"])
        axis.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="CP-only")
        axis.set_xscale("log", base=2)
        axis.set_xticks(seq_lens_all, [str(n) for n in seq_lens_all])
        axis.minorticks_off()
        axis.set_xlabel("context length (tokens)")
        axis.set_ylabel("speedup vs CP-only (t_cp / t; bars: min-max)")
        axis.set_title(str(group) if group is not None else title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    if group_by is not None:
        figure.suptitle(title)
    figure.tight_layout()
    return save_figure(figure, path, dpi=120)
