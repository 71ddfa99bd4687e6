"""CLI messages that must name what the user ran and offer only fixes that work: the damaged
checkpoint of ``csbp export``, the document-mask hint of ``csbp config validate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.cli.main import main
from csbp.training.checkpoint_integrity import find_resume_checkpoint


def damaged_run(root: Path) -> Path:
    """A run directory whose only checkpoint lacks its ``.metadata``."""
    step = root / "run" / "checkpoints" / "step_0000006"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 6}), encoding="utf-8")
    return root / "run"


def test_export_of_a_damaged_run_names_export_not_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = damaged_run(tmp_path)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"csbp: error: export: no intact checkpoint in {run / 'checkpoints'}: "
        f"{run / 'checkpoints' / 'step_0000006' / '.metadata'}: missing (the checkpoint is incomplete) "
        "(fix: restore the files, or export another run's checkpoint)"
    )
    assert "--resume" not in line


def test_the_caller_names_itself_in_the_damaged_checkpoint_error(tmp_path: Path) -> None:
    run = damaged_run(tmp_path)
    with pytest.raises(ValueError, match=r"^--resume: no intact checkpoint .* \(fix: restore the files, or start a new run"):
        find_resume_checkpoint(run)  # --resume keeps its message
    with pytest.raises(ValueError, match=r"^--run-dir: no intact checkpoint .* \(fix: pass --drafter\)$"):
        find_resume_checkpoint(run, caller="--run-dir", fix="pass --drafter")
