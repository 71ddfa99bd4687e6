"""``csbp compare --repeats``: the rounds' seeds, rotated orders and directories, the paired
statistics and their verdicts, the table, JSON and plot of several rounds, fail-closed values, an
interrupted multi-round comparison resumed (one process), and CP-only vs CSBP in two rounds on 2
gloo processes (slow).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from csbp.cli.main import main
from csbp.compare import CompareOptions, run_compare
from csbp.compare import budget as budget_module
from csbp.compare.report_rounds import format_rounds_table, group_rounds, plot_rounds, summarize_rounds
from csbp.compare.rounds import balance_note, layout_dir, round_order
from csbp.compare.runner import plan_layouts
from csbp.compare.stats import NO_INTERVAL, WITHIN_NOISE, chance_of_agreement, paired_difference, t_975
from csbp.config import config_from_dict
from test_training_run import config_dict, make_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def _bd3_dict(artifact: Path, **changes: Any) -> dict[str, Any]:
    base = {"train.max_steps": 100000, "train.grad_accum": 1, "train.eval_every": 0, "train.save_every": 0}
    return config_dict(artifact, **{**base, **changes})


def test_rounds_rotate_the_order_and_change_the_seed(artifact: Path, tmp_path: Path) -> None:
    """Round r trains --layouts rotated by r - 1 with seed run.seed + r - 1, in OUT/round-<r>/<layout>;
    one round keeps OUT/<layout> and the config's own seed (the comparison without --repeats)."""
    assert [round_order(("cp", "csbp"), r) for r in range(3)] == [("cp", "csbp"), ("csbp", "cp"), ("cp", "csbp")]
    assert [round_order(("a", "b", "c"), r)[0] for r in range(3)] == ["a", "b", "c"]  # each first once
    assert layout_dir(tmp_path, "cp", 0, 1) == tmp_path / "cp"
    assert layout_dir(tmp_path, "cp", 1, 3) == tmp_path / "round-2" / "cp"
    assert balance_note(("cp", "csbp"), 4) is None and balance_note(("cp", "csbp"), 1) is None
    assert "fix: --repeats a multiple of 2" in str(balance_note(("cp", "csbp"), 3))
    # compiled layouts share the compiled code: one round leaves the compilation to its first layout
    assert balance_note(("cp", "csbp"), 1, compiled=True) == (
        "note: train.compile: the layouts of a round share their processes' compiled code, so cp, which ran first, "
        "paid the compilation in its budget (fix: --repeats a multiple of 2, which puts every layout first equally often)"
    )
    assert balance_note(("cp", "csbp"), 2, compiled=True) is None and balance_note(("cp",), 1, compiled=True) is None
    cfg = config_from_dict(_bd3_dict(artifact, **{"run.seed": 7}))
    options = CompareOptions(layouts=("cp", "csbp"), budget_s=1.0, nproc=2, out_dir=tmp_path / "cmp", repeats=3)
    rounds = plan_layouts(cfg, options)
    assert [[run.layout for run in runs] for runs in rounds] == [["cp", "csbp"], ["csbp", "cp"], ["cp", "csbp"]]
    assert [[run.cfg.run.seed for run in runs] for runs in rounds] == [[7, 7], [8, 8], [9, 9]]
    assert rounds[1][0].run_dir == tmp_path / "cmp" / "round-2" / "csbp" and rounds[1][0].round == 2
    for runs in rounds:  # only the seed and the topology differ from the run's config
        for run in runs:
            assert run.cfg.model == cfg.model and run.cfg.optim == cfg.optim and run.cfg.data == cfg.data
    [[single, _]] = plan_layouts(cfg, CompareOptions(**{**options.__dict__, "repeats": 1}))
    assert single.run_dir == tmp_path / "cmp" / "cp" and single.cfg.run.seed == 7


def test_planning_does_not_grow_with_the_rounds(artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round was built and checked before training: --repeats 2**62 hung before its header. Round
    1 is checked, a later round (only its seed differs) is built when reached, and a last round's seed
    above the largest is refused up front naming --repeats."""
    from csbp.compare import runner

    built: list[int] = []
    original = runner._plan_layout
    monkeypatch.setattr(runner, "_plan_layout", lambda cfg, name, index, options: built.append(index) or original(
        cfg, name, index, options))
    cfg = config_from_dict(_bd3_dict(artifact, **{"run.seed": 3}))
    options = CompareOptions(layouts=("cp", "csbp"), budget_s=1.0, nproc=2, out_dir=tmp_path / "cmp", repeats=50)
    rounds = plan_layouts(cfg, options)
    assert built == [0, 0] and len(rounds) == 50
    huge = plan_layouts(cfg, CompareOptions(**{**options.__dict__, "repeats": 2**62}))
    last = huge[2**62 - 1]
    assert [run.cfg.run.seed for run in last] == [3 + 2**62 - 1] * 2 and last[0].round == 2**62
    assert built == [0, 0, 0, 0, 2**62 - 1, 2**62 - 1]
    top = config_from_dict(_bd3_dict(artifact, **{"run.seed": 2**63 - 2}))
    with pytest.raises(ValueError, match=r"^--repeats 3: round 3 trains with seed run.seed \+ 2 = 9223372036854775808, "
                       r"above the largest seed 9223372036854775807 \(fix: --repeats 2 or fewer, or a lower run.seed\)$"):
        plan_layouts(top, CompareOptions(**{**options.__dict__, "repeats": 3}))


def test_paired_difference_interval_and_verdict() -> None:
    assert t_975(1) == 12.706 and t_975(30) == t_975(100) == 2.042
    spread_out = paired_difference([1.0, 2.0, 3.0])  # sd 1: mean 2 +- 4.303 / sqrt(3)
    assert spread_out.mean == 2.0 and spread_out.low == pytest.approx(2 - 4.303 / math.sqrt(3))
    assert spread_out.verdict("higher", "lower") == WITHIN_NOISE
    assert paired_difference([-0.10, -0.12, -0.11]).verdict("higher", "lower") == "lower"
    assert paired_difference([3.0, 4.0]).verdict("more", "fewer") == WITHIN_NOISE  # 3.5 +- 6.35
    assert paired_difference([3.0, 3.1]).verdict("more", "fewer") == "more"
    disagreeing = [1.0] * 9 + [-0.1]  # the interval excludes 0, one round disagrees: no verdict
    assert paired_difference(disagreeing).low > 0
    assert paired_difference(disagreeing).verdict("higher", "lower") == WITHIN_NOISE
    assert paired_difference([0.5]).verdict("higher", "lower") == NO_INTERVAL
    assert paired_difference([0.0, 0.0]).verdict("higher", "lower") == WITHIN_NOISE
    # The untrained point 0 of CP-only and CSBP differs by float rounding in every round alike: it
    # was reported as 'higher' (a zero-width interval above 0); within the tolerance it has no sign.
    rounding = paired_difference([3e-7, 3e-7], tolerance=8.4e-5)
    assert rounding.low is not None and rounding.low > 0 and rounding.verdict("higher", "lower") == WITHIN_NOISE
    assert chance_of_agreement(2) == 0.5 and chance_of_agreement(5) == 0.0625


def _result(layout: str, round_: int, steps: int, last: float, *, start: float = 8.4) -> dict[str, Any]:
    points = [
        {"index": 0, "target_s": 0.0, "clock_s": 0.0, "step": 0, "metric": start, "val_loss": start, "metrics": {}},
        {"index": 1, "target_s": 30.0, "clock_s": 30.1, "step": steps, "metric": last, "val_loss": last, "metrics": {}},
    ]
    return {
        "layout": layout,
        "round": round_,
        "seed": round_ - 1,
        "topology": {"dp": 1, "cp": 2, "bp": 2 if layout == "csbp" else 1},
        "steps": steps,
        "clock_s": 30.1,
        "step_s": {"steps": steps, "median": 30.0 / steps, "p10": 0.4, "p90": 0.7},
        "points": points,
    }


def test_the_rounds_table_gives_a_verdict_only_where_every_round_agrees(tmp_path: Path) -> None:
    """The measured one-run comparisons (cp,csbp: csbp 1.21x the steps; csbp,cp: 0.75x) as two rounds
    are within noise; rounds that agree on a clear step ratio and loss get 'more' and 'lower'."""
    noisy = [_result("cp", 1, 52, 6.4434), _result("csbp", 1, 63, 6.4420),
             _result("cp", 2, 28, 6.5240), _result("csbp", 2, 21, 6.5280)]
    rounds = group_rounds(noisy)
    assert [[r["layout"] for r in runs] for runs in rounds] == [["cp", "csbp"], ["cp", "csbp"]]
    summary = summarize_rounds(rounds)
    text = format_rounds_table(rounds, summary, metric="val_loss", higher_is_better=False)
    assert "val_loss (lower is better); 2 rounds, mean [min..max] over rounds" in text
    assert "6.4837 [6.4434..6.5240]" in text  # cp's mean and range at the budget
    assert "round 2 (seed 1, order csbp,cp): csbp 21 steps 6.5280, cp 28 steps 6.5240" in text
    assert "at the budget: csbp - cp val_loss +0.0013 [-0.0330, +0.0356]: within noise (per round -0.0014 +0.0040)" in text
    assert "steps at the budget: csbp - cp +2.0 [-112.4, +116.4]: within noise (1.05x the steps; per round +11 -7)" in text
    assert "trained: cp 40.0 [28..52] steps in 30.1 [30.1..30.1] s (step median 0.824 [0.577..1.071] s)" in text
    assert "better" not in text.replace("lower is better", "")
    assert " lower " not in text and " more " not in text
    clear = [_result("cp", r, 50 + r, 6.45 + 0.01 * r) for r in (1, 2, 3)]
    clear += [_result("csbp", r, 60 + r, 6.44 + 0.01 * r) for r in (1, 2, 3)]
    rounds = group_rounds(sorted(clear, key=lambda result: result["round"]))
    summary = summarize_rounds(rounds)
    text = format_rounds_table(rounds, summary, metric="val_loss", higher_is_better=False)
    [difference] = summary["differences"]
    assert difference["points"][0]["verdict"] == WITHIN_NOISE  # point 0: equal in every round
    assert difference["points"][1]["verdict"] == difference["at_budget"]["verdict"] == "lower"
    assert difference["steps"]["verdict"] == "more" and difference["steps"]["per_round"] == [10.0, 10.0, 10.0]
    assert "steps at the budget: csbp - cp +10.0 [+10.0, +10.0]: more" in text
    assert "probability 25%" in text
    assert summary["layouts"][1]["steps"] == {"mean": 62.0, "min": 61, "max": 63, "rounds": 3}
    assert json.loads(json.dumps(summary)) == summary  # compare.json's summary
    assert plot_rounds(rounds, summary, tmp_path / "r.png", metric="val_loss", title="t").stat().st_size > 0
    rounds[1][0]["points"].pop()  # cp stopped at train.max_steps before its point 1 in round 2
    partial = summarize_rounds(rounds)
    assert partial["layouts"][0]["points"][1]["metric"]["rounds"] == 2
    assert [p["per_round"] for p in partial["differences"][0]["points"]][1] == pytest.approx([-0.01, -0.01])
    assert "at the budget" in format_rounds_table(rounds, partial, metric="val_loss", higher_is_better=False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"repeats": 0}, r"^--repeats 0: must be an integer >= 1$"),
        ({"repeats": 1.5}, r"^--repeats 1\.5: must be an integer >= 1$"),
        ({"points": 0}, r"^--points 0: must be an integer >= 1$"),
        ({"points": 3}, r"^--points 3: each time point is evaluated at the end of a training step, and the run stops "
         r"at train.max_steps=2, so more points than steps cannot each have their own \(fix: --points 2 or fewer"),
        ({"budget_s": math.nan}, r"^--budget-s nan: must be a finite number > 0$"),
        ({"budget_s": math.inf}, r"^--budget-s inf: must be a finite number > 0$"),
    ],
)
def test_bad_values_fail_before_any_work(artifact: Path, tmp_path: Path, change: dict[str, Any], message: str) -> None:
    """A NaN budget used to pass the library's `budget_s <= 0` check and train to train.max_steps."""
    cfg = config_from_dict(_bd3_dict(artifact, **{"train.max_steps": 2}))
    options = CompareOptions(layouts=("data",), budget_s=0.2, nproc=1, out_dir=tmp_path / "cmp", points=1)
    with pytest.raises(ValueError, match=message):
        run_compare(cfg, CompareOptions(**{**options.__dict__, **change}))
    out = tmp_path / "cmp"
    assert not out.exists() or [entry.name for entry in out.iterdir()] in ([], [".lock"])  # nothing trained


def test_cli_repeats_below_one_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "demo", "--budget-s", "5", "--repeats", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "argument --repeats: 0 must be >= 1" in err and len(err.splitlines()) == 1


def test_interrupted_rounds_resume(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two rounds on one process, interrupted in round 2 after its first point: --resume reads round 1
    back as it was and continues round 2 from its checkpoint; a changed --repeats is refused."""
    data = _bd3_dict(artifact)
    cfg = config_from_dict(data)
    out = tmp_path / "cmp"
    options = CompareOptions(layouts=("data",), budget_s=0.4, nproc=1, out_dir=out, points=2, repeats=2)
    original = budget_module.BudgetHook.after_step

    def interrupt_in_round_2(self: Any, loop: Any, step: int, seconds: float) -> bool:
        stop = original(self, loop, step, seconds)
        if self.run_dir.parent.name == "round-2" and len(self.state.points) == 2:
            raise KeyboardInterrupt
        return stop

    monkeypatch.setattr(budget_module.BudgetHook, "after_step", interrupt_in_round_2)
    with pytest.raises(KeyboardInterrupt):
        run_compare(cfg, options)
    monkeypatch.setattr(budget_module.BudgetHook, "after_step", original)
    first = json.loads((out / "round-1" / "data" / "result.json").read_text())
    saved = budget_module.load_budget_state(out / "round-2" / "data")
    assert saved is not None and len(saved.points) == 2 and not (out / "round-2" / "data" / "result.json").exists()
    assert not (out / "data").exists()
    resumed = CompareOptions(**{**options.__dict__, "resume": True})
    with pytest.raises(ValueError, match=r"^--repeats 3: .* started with --repeats 2, .*\(fix: --repeats 2 "):
        run_compare(cfg, CompareOptions(**{**resumed.__dict__, "repeats": 3}))
    one, two = run_compare(cfg, resumed)
    assert one == first  # read back as it was
    assert (one["round"], one["seed"], two["round"], two["seed"]) == (1, 0, 2, 1)
    assert [p["step"] for p in two["points"][:2]] == [p.step for p in saved.points] and two["clock_s"] >= 0.4
    assert two["points"][0]["val_loss"] != one["points"][0]["val_loss"]  # another seed: other initial weights
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    argv = ["compare", str(config_file), "--layouts", "data", "--budget-s", "0.4", "--points", "2", "--nproc", "1"]
    assert main([*argv, "--repeats", "2", "--out", str(out), "--resume"]) == 0  # all read back, no training
    text = capsys.readouterr().out
    assert "2 rounds, mean [min..max] over rounds" in text and "round 2 (seed 1, order data)" in text
    payload = json.loads((out / "compare.json").read_text())
    assert payload["repeats"] == 2 and [r["seed"] for r in payload["rounds"]] == [0, 1]
    assert payload["rounds"][0]["layouts"] == [one] and payload["summary"]["layouts"][0]["steps"]["rounds"] == 2
    assert "layouts" not in payload and (out / "compare.png").stat().st_size > 0


def test_one_round_keeps_the_output_of_a_comparison_without_repeats(artifact: Path, tmp_path: Path) -> None:
    """A comparison started before --repeats (compare_options.json without it) is one round: it
    resumes with the default and refuses --repeats 2."""
    cfg = config_from_dict(_bd3_dict(artifact))
    options = CompareOptions(layouts=("data",), budget_s=0.2, nproc=1, out_dir=tmp_path / "cmp", points=1)
    [result] = run_compare(cfg, options)
    assert (tmp_path / "cmp" / "data" / "result.json").is_file() and result["round"] == 1
    recorded = json.loads((tmp_path / "cmp" / "compare_options.json").read_text())
    assert recorded["repeats"] == 1 and recorded["layouts"] == ["data"]
    del recorded["repeats"], recorded["layouts"]
    (tmp_path / "cmp" / "compare_options.json").write_text(json.dumps(recorded))
    resumed = CompareOptions(**{**options.__dict__, "resume": True})
    with pytest.raises(ValueError, match=r"^--repeats 2: .* started with --repeats 1"):
        run_compare(cfg, CompareOptions(**{**resumed.__dict__, "repeats": 2}))
    assert run_compare(cfg, resumed) == [result]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(_bd3_dict(artifact)))
    argv = ["compare", str(config_file), "--layouts", "data", "--budget-s", "0.2", "--points", "1", "--nproc", "1"]
    assert main([*argv, "--out", str(tmp_path / "cmp"), "--resume"]) == 0  # read back: the one-round output
    payload = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert payload["repeats"] == 1 and payload["layouts"] == [result] and "rounds" not in payload


@pytest.mark.slow
def test_cp_vs_csbp_in_two_rounds_on_two_processes(
    artifact: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = config_from_dict(_bd3_dict(artifact))
    options = CompareOptions(layouts=("cp", "csbp"), budget_s=0.5, nproc=2, out_dir=tmp_path / "cmp", points=1, repeats=2)
    cp1, csbp1, cp2, csbp2 = run_compare(cfg, options)
    started = [line for line in capfd.readouterr().out.splitlines() if line.startswith("round ")]
    assert started == ["round 1/2: cp, seed 0", "round 1/2: csbp, seed 0", "round 2/2: csbp, seed 1", "round 2/2: cp, seed 1"]
    for a, b in ((cp1, csbp1), (cp2, csbp2)):  # same seed within a round: same untrained model
        assert a["round"] == b["round"] and a["seed"] == b["seed"]
        assert a["points"][0]["metric"] == pytest.approx(b["points"][0]["metric"], rel=1e-5)
    assert cp1["points"][0]["metric"] != cp2["points"][0]["metric"]  # another seed per round
    summary = summarize_rounds(group_rounds([cp1, csbp1, cp2, csbp2]))
    assert summary["differences"][0]["points"][0]["verdict"] == WITHIN_NOISE


def test_differences_within_the_tolerance_have_no_sign_either_way() -> None:
    """Rounding-sized differences get no verdict, below zero as above it; the tolerance is relative to the
    metric's largest magnitude. A one-sided tolerance check, or one relative to the smallest value, passed
    every test."""
    from csbp.compare.stats import METRIC_RTOL, metric_tolerance, paired_difference

    for values in ([1e-7, 1.2e-7, 0.9e-7], [-1e-7, -1.2e-7, -0.9e-7]):  # a tight interval off zero
        difference = paired_difference(values, tolerance=1e-5)
        assert (difference.low > 0 or difference.high < 0) and difference.sign == 0, values
        assert difference.verdict("higher", "lower") == "within noise"
    assert paired_difference([-1e-3, -1.2e-3, -0.9e-3], tolerance=1e-5).sign == -1
    assert paired_difference([1e-3, 1.2e-3, 0.9e-3], tolerance=1e-5).sign == 1
    assert metric_tolerance([1.0, -100.0]) == pytest.approx(METRIC_RTOL * 100)
