"""``csbp compare``'s clock at exact time points and the rounds summary's numbers (mutation audit of
``csbp.compare``), against hand-computed values:

* a step whose clock lands exactly on a time point takes it (``>=``), and also every later point it
  lands exactly on;
* the rounds summary's point ``target_s`` is the point's target and its ``clock_s`` the mean over
  rounds; rounding-sized differences get no verdict at a point nor at the budget (the tolerance applies
  to both); the single-run table prints ``val_nelbo`` as "other vs base";
* the step-time spread is numpy's linear percentiles, an infinite budget is refused, a resumed start
  without budget state evaluates no point 0, ``train.max_steps`` before the budget is a last point, and a
  cp-only run's ``csbp`` layout is ``cp = bp = local``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_compare_summary.py -q``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csbp.compare import budget as budget_module
from csbp.compare.layouts import layout_config
from csbp.compare.report import format_table
from csbp.compare.report_rounds import summarize_rounds
from test_compare import FakeLoop, _bd3, artifact  # noqa: F401

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


def test_step_time_spread_is_the_linear_percentiles() -> None:
    summary = budget_module.step_time_summary([4.0, 1.0, 3.0, 2.0])
    assert summary == {"steps": 4, "median": 2.5, "p10": pytest.approx(1.3), "p90": pytest.approx(3.7)}


def test_the_hook_refuses_an_endless_budget_and_a_resumed_start_is_not_point_zero(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--budget-s \(inf\) must be > 0"):
        budget_module.BudgetHook(budget_s=float("inf"), num_points=2, metric="val_loss", max_steps=9, run_dir=tmp_path)
    hook = budget_module.BudgetHook(budget_s=1.0, num_points=2, metric="val_loss", max_steps=9, run_dir=tmp_path)
    loop = FakeLoop()
    hook.on_start(loop, 5)  # a checkpoint without its budget state: the trained model is no point 0
    assert loop.evaluated == [] and hook.state.points == []


def test_a_cp_only_run_topology_is_not_the_csbp_layout(artifact: Path) -> None:  # noqa: F811
    cfg = _bd3(artifact, **{"topology.cp": 2, "train.micro_batch_size": 2})
    topology = layout_config(cfg, "csbp", 2).topology
    assert (topology.cp, topology.bp) == (2, 2)  # context and block parallel, not the run's cp-only layout


def test_train_max_steps_before_the_budget_is_a_last_point(tmp_path: Path) -> None:
    hook = budget_module.BudgetHook(budget_s=10.0, num_points=2, metric="val_loss", max_steps=2, run_dir=tmp_path)
    loop = FakeLoop()
    hook.on_start(loop, 0)
    assert [hook.after_step(loop, step, 1.0) for step in (1, 2)] == [False, True]
    assert [(p.index, p.step, p.target_s) for p in hook.state.points] == [(0, 0, 0.0), (1, 2, 5.0)]
