"""``csbp plan`` flags a DFlash drafter's cost model cannot price are refused, not ignored."""

from __future__ import annotations

import pytest

from csbp.cli.main import USER_ERROR_EXIT_CODE, main

DRAFTER = ["plan", "--model", "dflash2-qwen3.8", "--seq-len", "4096", "--gpus", "8"]


@pytest.mark.parametrize("value", ["full", "both"])
def test_plan_refuses_checkpointing_for_a_drafter(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--checkpointing was ignored for drafters (every layout priced with none, the table saying so)
    and defaulted to both, so an explicit value could not be told from the default."""
    code = main([*DRAFTER, "--checkpointing", value])
    out, err = capsys.readouterr()
    assert (code, out) == (USER_ERROR_EXIT_CODE, "")
    assert err.strip().splitlines() == [
        f"csbp: error: --checkpointing {value}: csbp plan prices a DFlash drafter without activation checkpointing "
        "only (its drafter memory and time model is fitted on such runs) (fix: drop --checkpointing)"
    ]


def test_plan_prices_a_drafter_without_checkpointing_by_default_or_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (DRAFTER, [*DRAFTER, "--checkpointing", "none"]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert (code, err) == (0, "") and "  1 dp" in out
