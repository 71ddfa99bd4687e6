"""Odd values of single config fields (found by driving every field through `csbp config validate`
and `csbp train`): each is one `csbp: error: <field>: ... (fix: ...)` line, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.config import load_config
from test_config_errors import error_lines, tiny


@pytest.mark.parametrize("value", ["[]", "[qwen3]", "{}"])
def test_a_list_or_mapping_for_model_arch_is_one_error_line(tmp_path: Path, value: str) -> None:
    # it used to raise TypeError (unhashable type) from the arch-defaults lookup: a traceback
    lines = error_lines(tiny(tmp_path), f"model.arch={value}")
    assert len(lines) == 1
    assert lines[0].startswith("--set: model.arch: got ")
    assert lines[0].endswith("(fix: use 'qwen3', 'llama' or 'qwen2')")


@pytest.mark.parametrize(("objective", "value"), [("bd3", "0"), ("bd3", "-0.0"), ("mdlm", "0.0")])
def test_t_min_zero_with_inv_t_weights_names_the_field(tmp_path: Path, objective: str, value: str) -> None:
    # it passed the config and was refused only by the objective, after the data was opened, in a line
    # naming no field: "csbp: error: loss_weight='inv_t' needs t_min > 0 (got 0.0); raise t_min or use 'unit'"
    overrides = [f"objective.name={objective}", f"objective.t_min={value}", "objective.loss_weight=inv_t"]
    if objective == "mdlm":
        overrides.append("objective.block_size=null")
    lines = error_lines(tiny(tmp_path), *overrides)
    assert lines == [
        f"--set: objective.t_min: t_min={float(value)} with loss_weight: inv_t weights a token masked at t = 0 by 1/0 "
        "(fix: raise t_min above 0 (the default is 0.001), or set loss_weight: unit)"
    ]


def test_t_min_zero_with_unit_weights_stays_valid(tmp_path: Path) -> None:
    cfg = load_config(tiny(tmp_path), ["objective.t_min=0", "objective.loss_weight=unit"])
    assert cfg.objective.t_min == 0.0
