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


# Written out by hand from the Calibration docstring (not read from RATES/SHARES, which they check):
# the factors that divide work or bytes into seconds, and the shares of traffic or compute hidden.
DOCUMENTED_RATES = ("gemm_eff", "attn_eff", "interval_fwd", "interval_bwd", "net_eff", "intra_eff", "drafter_eff")
DOCUMENTED_SHARES = ("overlap_cp", "overlap_csbp", "overlap_stream", "grad_overlap")


@pytest.mark.parametrize("name", DOCUMENTED_RATES)
def test_every_rate_of_zero_is_refused(tmp_path: Path, name: str) -> None:
    """``net_eff`` or ``intra_eff`` dropped from RATES: a 0 link efficiency loaded and the planner divided by it."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({name: 0}))
    with pytest.raises(ValueError, match=rf"factor '{name}' divides work or bytes into seconds, got 0 \(fix"):
        load_calibration(path)


@pytest.mark.parametrize("name", DOCUMENTED_SHARES)
def test_every_share_above_one_is_refused(tmp_path: Path, name: str) -> None:
    """``grad_overlap`` dropped from SHARES: 1.5 of the gradient sync hidden (negative exposed time) loaded."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({name: 1.5}))
    with pytest.raises(ValueError, match=rf"factor '{name}' is the share of traffic hidden, got 1.5 \(fix"):
        load_calibration(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"attn_eff": 0.5, "nope": 1}', "unknown factor 'nope' (known: gemm_eff, attn_eff,"),
        ("[0.5]", "a calibration file is a JSON object of factors"),
        ('{"fit": "attn_eff"}', "'fit' must be a list of factor names"),
        ('{"fit": ["attn_eff", 1]}', "'fit' must be a list of factor names"),
        ('{"attn_eff": 0.5}\n\n{', "not valid JSON (Extra data at line 3)"),
    ],
)
def test_a_malformed_calibration_file_is_one_line_naming_it(tmp_path: Path, capsys, text: str, message: str) -> None:
    """Each was accepted (an unknown factor, a fit string read as its characters) or crashed with a
    traceback (a list has no items; a dataclass has no field 'nope') when its check was dropped."""
    path = tmp_path / "cal.json"
    path.write_text(text)
    code = main([*PLAN, "--calibration", str(path)])
    out, err = capsys.readouterr()
    assert code == USER_ERROR_EXIT_CODE and out == ""
    assert f"{path}: {message}" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("where", ["missing.json", "."])
def test_a_calibration_path_that_is_no_file_is_one_line(tmp_path: Path, capsys, where: str) -> None:
    """A directory read as the calibration file raised IsADirectoryError (a traceback) without the check."""
    path = tmp_path / where
    code = main([*PLAN, "--calibration", str(path)])
    out, err = capsys.readouterr()
    assert code == USER_ERROR_EXIT_CODE and out == ""
    assert f"calibration file not found: {path}" in err and len(err.strip().splitlines()) == 1, err


def test_with_values_refuses_a_factor_the_calibration_has_not() -> None:
    cal = packaged_calibration("h200")
    with pytest.raises(ValueError, match=r"unknown calibration factor\(s\) \['nope'\]: known are gemm_eff, attn_eff"):
        cal.with_values({"attn_eff": 0.5, "nope": 1.0}, source="test")
    assert cal.with_values({"attn_eff": 0.25, "gemm_eff": 0.5}, source="s").fit == (*cal.fit, "gemm_eff")


def test_the_published_calibration_is_exactly_what_calibrate_published_writes() -> None:
    """Every factor, the priors too (``overlap_stream`` 0.8 is the prior docs/planning.md names): a
    changed ``Calibration`` default passed every test, which compared the fitted factors only."""
    from csbp.plan.fit import fit_published

    packaged, fitted = packaged_calibration("h200"), fit_published()
    assert packaged.fit == fitted.fit and packaged.source == fitted.source
    for name in FACTOR_NAMES:
        assert getattr(packaged, name) == pytest.approx(getattr(fitted, name), rel=1e-6), name
    assert (packaged.gemm_eff, packaged.overlap_stream, packaged.grad_overlap) == (0.55, 0.8, 0.8)
