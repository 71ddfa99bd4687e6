"""Odd values of single config fields (found by driving every field through `csbp config validate`
and `csbp train`): each is one `csbp: error: <field>: ... (fix: ...)` line, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.config import ConfigError, load_config
from test_config_errors import error_lines, tiny


@pytest.mark.parametrize("value", ["[]", "[qwen3]", "{}"])
def test_a_list_or_mapping_for_model_arch_is_one_error_line(tmp_path: Path, value: str) -> None:
    # it used to raise TypeError (unhashable type) from the arch-defaults lookup: a traceback
    lines = error_lines(tiny(tmp_path), f"model.arch={value}")
    assert len(lines) == 1
    assert lines[0].startswith("--set: model.arch: got ")
    assert lines[0].endswith("(fix: use 'qwen3', 'llama', 'qwen2' or 'mistral')")


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


def test_an_lr_whose_first_adamw_step_overflows_float32_is_refused(tmp_path: Path) -> None:
    # `csbp train --set optim.lr=1e300` died in torch's AdamW step with a traceback
    # (RuntimeError: value cannot be converted to type float without overflow)
    lines = error_lines(tiny(tmp_path), "optim.lr=1e300")
    assert lines == [
        "--set: optim.lr: lr=1e+300 makes AdamW's first step size lr / (1 - betas[0]) = 1e+301, beyond the largest "
        "float32 (3.4e+38): torch cannot apply it to the float32 weights (fix: use an lr below 3.4e+37 (typical: "
        "1e-5 to 1e-2))"
    ]
    # the bound follows beta1 (the first step is lr / (1 - beta1)) and the weights' dtype
    assert error_lines(tiny(tmp_path), "optim.lr=1e31", "optim.betas=[0.99999999, 0.999]")[0].startswith(
        "--set: optim.lr: lr=1e+31 makes AdamW's first step size lr / (1 - betas[0]) = 1e+39"
    )
    fp64 = load_config(tiny(tmp_path), ["optim.lr=1e300", "optim.weight_decay=0", "train.precision=fp64", "model.dtype=float64"])
    assert fp64.optim.lr == 1e300
    large = load_config(tiny(tmp_path), ["optim.lr=1000", "optim.weight_decay=0"])  # a large lr that only diverges
    assert large.optim.lr == 1000


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        # 0 in float32: a weight without gradient was updated by 0/0, and the NaN stop blamed optim.lr
        ("1e-300", "eps=1e-300 is below the smallest normal float32 (1.18e-38): a weight that gets no gradient is "
                   "updated by 0/0 = NaN (fix: use eps >= 1e-30 (the default is 1e-8))"),
        # inf in float32: every update was 0, the run "trained" without changing a weight
        ("1e300", "eps=1e+300 is inf in float32: every AdamW update is divided by it, so nothing trains (fix: use a "
                  "small eps (the default is 1e-8))"),
    ],
)
def test_an_adamw_eps_that_is_0_or_inf_in_float32_is_refused(tmp_path: Path, value: str, problem: str) -> None:
    assert error_lines(tiny(tmp_path), f"optim.eps={value}") == [f"--set: optim.eps: {problem}"]


@pytest.mark.parametrize(
    ("override", "line"),
    [
        # 0 in the float32 RoPE tables: step 1 was NaN, and the stop's fix named optim.lr
        ("model.rope_theta=1e-300", "--set: model.rope_theta: must be >= 1.0, got 1e-300"),
        ("model.rope_theta=0.5", "--set: model.rope_theta: must be >= 1.0, got 0.5"),
        # inf in float32: every channel but the first stopped turning, silently
        ("model.rope_theta=1e300", "--set: model.rope_theta: must be <= 3.4028234663852886e+38, got 1e+300"),
        # inf in float32: every RMSNorm output was 0 and the run trained at loss ln(vocab), silently
        ("model.rms_norm_eps=1e300", "--set: model.rms_norm_eps: must be <= 3.4028234663852886e+38, got 1e+300"),
    ],
)
def test_model_numbers_float32_cannot_hold_are_refused(tmp_path: Path, override: str, line: str) -> None:
    (error,) = error_lines(tiny(tmp_path), override)
    assert error.startswith(f"{line} (fix: set it to a value "), error


def test_model_numbers_in_range_stay_valid(tmp_path: Path) -> None:
    cfg = load_config(tiny(tmp_path), ["model.rope_theta=1", "model.rms_norm_eps=1e-300"])
    assert (cfg.model.rope_theta, cfg.model.rms_norm_eps) == (1.0, 1e-300)


def test_a_window_beyond_int64_is_refused(tmp_path: Path) -> None:
    # it passed validation, then every rank of `csbp train` died with OverflowError (a traceback) building
    # its attention rows: torch computes the window bounds in int64
    (error,) = error_lines(tiny(tmp_path), f"topology.window={10**30}")
    assert error.startswith(f"--set: topology.window: must be <= 9223372036854775807, got {10**30} (fix: set it to "), error
    assert load_config(tiny(tmp_path), [f"topology.window={2**63 - 1}"]).topology.window == 2**63 - 1


def test_a_collective_timeout_below_torchs_millisecond_is_refused(tmp_path: Path) -> None:
    # 1e-300 s passed validation and became a 0 ms limit: the first collective of a 2-process run failed
    # ("timed out after 0ms ... another rank probably died")
    (error,) = error_lines(tiny(tmp_path), "train.collective_timeout_s=1e-300")
    assert error.startswith("--set: train.collective_timeout_s: must be >= 0.001, got 1e-300 (fix: "), error
    assert load_config(tiny(tmp_path), ["train.collective_timeout_s=0.001"]).train.collective_timeout_s == 0.001


def test_a_duplicate_key_in_a_set_mapping_gets_one_fix(tmp_path: Path) -> None:
    # it ended "(first on line 1; fix: merge the two) (fix: quote it)": two fixes, the second wrong
    with pytest.raises(ConfigError) as info:
        load_config(tiny(tmp_path), ["topology={dp: 1, dp: 2}"])
    assert info.value.lines == [
        "--set topology: value '{dp: 1, dp: 2}' is not valid YAML: line 1: duplicate key 'dp' (first on line 1) "
        "(fix: merge the two)"
    ]


def test_a_weight_decay_that_zeroes_or_flips_the_weights_is_refused(tmp_path: Path) -> None:
    # weight_decay=1e300 diverged like a huge lr, and the NaN stop then blamed optim.lr
    lines = error_lines(tiny(tmp_path), "optim.lr=0.001", "optim.weight_decay=1e300")
    assert lines == [
        "--set: optim.weight_decay: weight_decay=1e+300 with lr=0.001: AdamW's decoupled decay multiplies each decayed "
        "weight by 1 - lr x weight_decay = -1e+297 per step at the peak lr, which zeroes the weights or flips their "
        "signs (fix: use a weight_decay below 1 / lr = 1e+03 (typical: 0 to 0.1), or an lr below 1 / weight_decay = "
        "1e-300)"
    ]
    # the default weight_decay (0.01) with an lr of 100 or more: named once, the lr's own bound first
    assert "optim.weight_decay: weight_decay=0.01 with lr=100: " in error_lines(tiny(tmp_path), "optim.lr=100")[0]
    assert len(error_lines(tiny(tmp_path), "optim.lr=1e300")) == 1
    assert error_lines(tiny(tmp_path), "optim.lr=0.5", "optim.weight_decay=2")[0].startswith(
        "--set: optim.weight_decay: weight_decay=2 with lr=0.5: AdamW's decoupled decay multiplies each decayed weight "
        "by 1 - lr x weight_decay = 0 per step"
    )
    cfg = load_config(tiny(tmp_path), ["optim.lr=0.5", "optim.weight_decay=1.9"])  # decays hard, but decays
    assert cfg.optim.weight_decay == 1.9
