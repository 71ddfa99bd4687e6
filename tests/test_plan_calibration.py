"""``csbp plan --calibration FILE``: a factor outside its domain fails closed in one line.

An overlap above 1 made the exposed communication negative (a plan ranked by time it saved twice),
a rate of 0 crashed the planner with a ZeroDivisionError traceback and ``Infinity`` made attention
free; each must be refused before anything is predicted, naming the file, the factor and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.cli.main import USER_ERROR_EXIT_CODE, main
from csbp.plan.calibration import FACTOR_NAMES, RATES, SHARES, load_calibration, packaged_calibration

PLAN = ("plan", "--model", "nemotron-8b", "--seq-len", "256K", "--gpus", "8", "--gpu", "h200")


@pytest.mark.parametrize(
    ("factors", "message"),
    [
        ({"overlap_cp": 1.5}, "factor 'overlap_cp' is the share of traffic hidden, got 1.5 (fix: a value in [0, 1]"),
        ({"overlap_stream": -0.1}, "factor 'overlap_stream' is the share of traffic hidden, got -0.1"),
        ({"attn_eff": 0}, "factor 'attn_eff' divides work or bytes into seconds, got 0 (fix: a value > 0"),
        ({"interval_fwd": 0.0}, "factor 'interval_fwd' divides work or bytes into seconds, got 0.0"),
        ({"drafter_eff": 0}, "factor 'drafter_eff' divides work or bytes into seconds"),
        ({"mem_fixed_gib": -1}, "factor 'mem_fixed_gib' must be >= 0, got -1 (fix: a value >= 0"),
        ({"gemm_eff": float("inf")}, "factor 'gemm_eff' must be a finite number, got inf"),
        ({"attn_eff": True}, "factor 'attn_eff' must be a finite number, got True"),
    ],
)
def test_a_factor_outside_its_domain_is_one_line(tmp_path: Path, capsys, factors, message) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(factors))  # json writes inf as Infinity, which json reads back
    code = main([*PLAN, "--calibration", str(path)])
    out, err = capsys.readouterr()
    assert code == USER_ERROR_EXIT_CODE and out == ""
    assert f"{path}: {message}" in err and len(err.strip().splitlines()) == 1, err


def test_every_factor_has_a_domain_and_the_packaged_calibrations_are_in_it(tmp_path: Path) -> None:
    assert SHARES <= set(FACTOR_NAMES) and RATES <= set(FACTOR_NAMES)
    for gpu in ("h200", "cpu"):
        cal = packaged_calibration(gpu)
        path = tmp_path / f"{gpu}.json"
        path.write_text(json.dumps(cal.to_json()))
        assert load_calibration(path) == cal
    edges = {**{name: 1.0 for name in SHARES}, **{name: 1e-6 for name in RATES}, "step_overhead_s": 0}
    path = tmp_path / "edges.json"
    path.write_text(json.dumps(edges))
    assert load_calibration(path).overlap_cp == 1.0
