"""``csbp compare``'s clock at exact time points and the rounds summary's numbers (mutation audit of
``csbp.compare``), against hand-computed values:

* a step whose clock lands exactly on a time point takes it (``>=``), and also every later point it
  lands exactly on;
* the rounds summary's point ``target_s`` is the point's target and its ``clock_s`` the mean over
  rounds; rounding-sized differences get no verdict at a point nor at the budget (the tolerance applies
  to both); the single-run table prints ``val_nelbo`` as "other vs base".

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_compare_summary.py -q``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csbp.compare import budget as budget_module
from csbp.compare.report import format_table
from csbp.compare.report_rounds import summarize_rounds
from test_compare import FakeLoop

TOPOLOGY = {"dp": 1, "cp": 2, "bp": 1}


def test_a_clock_exactly_on_a_time_point_takes_it(tmp_path: Path) -> None:
    # budget 4 s, points every 1 s; steps of exactly 1 s, then one of 2 s (lands on points 2 and 3)
    hook = budget_module.BudgetHook(budget_s=4.0, num_points=4, metric="val_loss", max_steps=100, run_dir=tmp_path)
    loop = FakeLoop()
    hook.on_start(loop, 0)
    stops = [hook.after_step(loop, step, seconds) for step, seconds in ((1, 1.0), (2, 2.0), (3, 1.0))]
    assert stops == [False, False, True]
    assert [(p.index, p.step, p.clock_s) for p in hook.state.points] == [
        (0, 0, 0.0), (1, 1, 1.0), (2, 2, 3.0), (3, 2, 3.0), (4, 3, 4.0)]  # fmt: skip
    assert loop.evaluated == [0, 1, 2, 3]


def result(layout: str, round_index: int, points: list[tuple[float, float, int]], **extra: Any) -> dict[str, Any]:
    """A layout's result: ``points`` as ``(clock_s, metric, step)`` at targets 0, 1, 2, ..."""
    return {
        "layout": layout, "round": round_index, "seed": round_index, "topology": TOPOLOGY,
        "points": [{"index": i, "target_s": float(i), "clock_s": c, "metric": m, "step": s, "val_loss": m,
                    "metrics": extra.get("metrics", {})} for i, (c, m, s) in enumerate(points)],
        "steps": points[-1][2], "clock_s": points[-1][0], "step_s": None,
    }  # fmt: skip


def test_the_rounds_summary_points_and_rounding_sized_differences() -> None:
    base = 8.0
    tiny = base * 1e-7  # far below the 1e-5 relative tolerance, but of one sign in every round
    rounds = [
        [result("cp", r + 1, [(0.0, base, 0), (clock, base, 3)]),
         result("csbp", r + 1, [(0.0, base + d * tiny, 0), (1.1, base + d * tiny, 4)])]
        for r, (clock, d) in enumerate([(1.2, 1.0), (1.4, 1.2), (1.6, 0.9)])  # a tight interval off zero
    ]
    summary = summarize_rounds(rounds)
    cp_points = summary["layouts"][0]["points"]
    assert [p["target_s"] for p in cp_points] == [0.0, 1.0]
    assert cp_points[1]["clock_s"] == pytest.approx(1.4)  # the mean of 1.2, 1.4, 1.6, not one round's
    (difference,) = summary["differences"]
    assert [p["verdict"] for p in difference["points"]] == ["within noise", "within noise"]
    assert difference["at_budget"]["verdict"] == "within noise"
    assert difference["steps"]["verdict"] == "more"  # one more step in every round: a real difference


def test_the_table_prints_val_nelbo_of_the_other_layout_first() -> None:
    cp = result("cp", 1, [(0.0, 9.0, 0), (1.0, 8.0, 3)], metrics={"nelbo": 7.5})
    csbp = result("csbp", 1, [(0.0, 9.0, 0), (1.0, 7.0, 4)], metrics={"nelbo": 6.25})
    table = format_table([cp, csbp], metric="val_loss", higher_is_better=False)
    assert "at the budget: csbp 7.0000 vs cp 8.0000 (csbp lower by 1.0000; 1.33x the steps); val_nelbo 6.2500 vs " \
           "7.5000" in table  # fmt: skip
